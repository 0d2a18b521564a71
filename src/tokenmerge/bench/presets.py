"""Architecture presets with random weights: real timings and memory, not images (no download needed).

The configurations are the published shapes of the SD 1.5, SD 2.1 (768-v) and SDXL base 1.0 UNets, and of the
PixArt-alpha 512 and SD3 medium transformers, written here. ``flux-2+4`` has Flux.1-dev's real block widths but 2
double-stream and 4 single-stream blocks (of 19 and 38): the full 12B model does not fit this machine in fp32.

The video and 2025-2026 image transformers have their published widths and REDUCED block counts, named in the
preset (``wan-2b``: 2 of Wan 2.1 1.3B's 30 blocks, ``wan-1b`` (the demo's) 1; ``hunyuan-video-1+2``: 1 of 20
double- and 2 of 40 single-stream blocks); the family names (``wan``, ``hunyuan-video``, ``ltx``, ``flux2``,
``qwen-image``, ``sana``) are aliases of them. Their step inputs are the pipeline's: the latent of ``--frames``
pixel frames (the VAE's temporal and spatial compression), prompt embeddings of the text encoder's width and the pipeline's token count
(padded as it pads, with its mask), and guidance as the pipeline runs it: the batch doubled in one call (LTX,
SANA), separate conditional and unconditional calls (Wan, Qwen-Image), or guidance-distilled, one call
(HunyuanVideo, Flux.2 dev).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tools.pipelines import load_pipeline
from .cell import size as _size
from .inputs import BUILDERS

__all__ = ["PRESETS", "ALIASES", "GUIDANCE", "Preset", "load_model", "load_pipeline", "resolve"]


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    unet: dict
    text_tokens: int = 77
    added_cond: dict = field(default_factory=dict)  # name -> trailing shape of SDXL-style extra conditioning
    vae_scale: int = 8
    model: str | None = None  # a real pipeline (folder or hub id) instead of random weights
    family: str = "unet"  # which diffusers class ``unet`` (the denoiser's config) is for; see _CLASSES
    text_dim: int | None = None  # transformers: channels of the text embeddings they take
    guidance: str | None = None  # how a pipeline step runs guidance: one of GUIDANCE (None: Flux.1 "distilled",
    # the others "batch")
    negative_tokens: int | None = None  # guidance "calls": text tokens of the unconditional call (None: text_tokens)
    prompt_tokens: int | None = None  # the prompt's tokens in a padded, masked text (None: no mask passed)
    frames_per_latent: int | None = None  # video: pixel frames per latent frame (the VAE's temporal compression)
    default_frames: int = 33  # video: pixel frames when --frames is not given
    patch: int = 1  # spatial patch size after the VAE (2x2 latent pixels per token: 2)
    multiple: int = 8  # resolutions must be multiples of this (the VAE's scale x the patch size)
    sizes: tuple = ()  # full-size presets: the model's usual resolutions (pixels, or "HxW")
    full_size: bool = False  # every block of the published model (the GPU presets): built in the target dtype

    def build(self, dtype=torch.float32, device="cpu"):
        """The model with random weights (seeded), on ``device`` in ``dtype``, in eval mode.

        Parameters are created on ``device`` in ``dtype`` directly (the default dtype is switched while the model is
        built, then restored): a 14B model never has a float32 or CPU copy. ``device="meta"`` builds the structure
        only (parameter counts without memory).

        Args:
            dtype: parameter dtype (float32, float16, bfloat16).
            device: where the parameters are created.
        """
        import diffusers

        if self.model is not None:
            return load_model(self.model, dtype)[0].to(device).eval()
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = getattr(diffusers, _CLASSES[self.family])(**self.unet)
        finally:
            torch.set_default_dtype(previous)
        # a buffer or parameter made in an explicit dtype stays so; diffusers warns on every ``.to(dtype)`` of a
        # UNet, even a no-op one: cast only when a parameter differs
        if any(p.dtype != dtype for p in model.parameters()):
            model = model.to(dtype)
        return model.eval()

    def __post_init__(self):
        if self.guidance is None:
            object.__setattr__(self, "guidance", "distilled" if self.family == "flux" else "batch")
        if self.guidance not in GUIDANCE:
            raise ValueError(f"guidance must be one of {', '.join(GUIDANCE)}; got {self.guidance!r}")

    @property
    def video(self) -> bool:
        """Whether the preset is a video model (its inputs take ``frames``)."""
        return self.frames_per_latent is not None

    def latent_frames(self, frames: int | None) -> int:
        """Latent frames of ``frames`` pixel frames: ``(frames - 1) / temporal compression + 1``."""
        frames = self.default_frames if frames is None else frames
        return (frames - 1) // self.frames_per_latent + 1

    def check_frames(self, frames: int) -> str | None:
        """Why ``frames`` does not suit this preset (None if it does)."""
        if not self.video:
            return f"{self.name} is an image preset: --frames applies to video presets only"
        k = self.frames_per_latent
        if frames < 1 or (frames - 1) % k:
            return (f"{self.name} takes {k}k+1 frames (its VAE compresses {k} frames into one latent frame after the "
                    f"first): e.g. {k + 1}, {4 * k + 1}, {8 * k + 1}; got {frames}")
        return None

    def check_resolution(self, resolution: int | str) -> str | None:
        """Why ``resolution`` does not suit this preset (None if it does)."""
        h, w = _size(resolution)
        if h != w and self.family == "unet":
            return f"{self.name} takes square resolutions (one number); got {resolution}"
        if h % self.multiple or w % self.multiple:
            return (f"{self.name} needs sides that are multiples of {self.multiple} (the VAE's scale x the patch "
                    f"size); got {resolution}")
        return None

    def grid(self, resolution: int | str, frames: int | None = None) -> tuple[int, ...]:
        """The token grid of one call after patching: ``(frames, height, width)`` for video, else
        ``(height, width)`` (UNets: their finest level)."""
        h, w = _size(resolution)
        scale = self.vae_scale * self.patch
        spatial = (h // scale, w // scale)
        return ((self.latent_frames(frames),) + spatial) if self.video else spatial

    def merged_resolution(self, resolution: int | str, ratio: float, frames: int | None = None) -> str:
        """The resolution whose token grid holds what ``ratio`` leaves of this one's: the grid's rows times
        ``1 - ratio`` (rounded, at least one), the width kept: ``"HxW"`` (the ``grid-limit`` reference of
        whole-block merging; transformers only: a UNet's levels would all shrink).

        Args:
            resolution: pixels per side or ``"HxW"``.
            ratio: the merge ratio.
            frames: pixel frames (video).
        """
        if self.family == "unet":
            raise ValueError(f"grid-limit runs a transformer at the merged token count; {self.name} is a UNet, "
                             "whose every level would shrink (use limit with scope=block)")
        h, w = _size(resolution)
        rows = self.grid(resolution, frames)[-2]
        kept = max(1, round(rows * (1 - ratio)))
        return f"{h * kept // rows}x{w}"

    @property
    def guidance_text(self) -> str:
        return GUIDANCE[self.guidance]

    def inputs(self, batch: int, resolution: int | str, dtype, device, timestep: int = 500,
               frames: int | None = None) -> dict | list[dict]:
        """Keyword inputs of one denoising step for ``batch`` images or videos, as the pipeline makes them: one
        call with the batch doubled (guidance "batch": the denoiser sees ``2 * batch``), one call per
        conditional / unconditional prediction (guidance "calls": a list of two dicts), or one call
        (guidance-distilled). ``resolution``: pixels per side or ``"HxW"``; ``frames``: pixel frames (video)."""
        if frames is not None and not self.video:
            raise ValueError(f"{self.name} is an image preset: it takes no frames")
        g = torch.Generator().manual_seed(0)
        h, w = _size(resolution)
        n = 2 * batch if self.guidance == "batch" else batch

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(device, dtype)

        t = torch.full((n,), float(timestep), device=device)
        if self.family in BUILDERS:
            calls = BUILDERS[self.family](self, n, h, w, frames, t, randn, device)
            return calls[0] if len(calls) == 1 else calls
        if isinstance(resolution, str) and h != w and self.family == "unet":
            raise ValueError(f"{self.name} takes square resolutions; got {resolution}")
        lh, lw = h // self.vae_scale, w // self.vae_scale
        if self.family == "unet":
            extra = {k: randn(n, *shape) for k, shape in self.added_cond.items()}
            inputs = dict(sample=randn(n, self.unet["in_channels"], lh, lw), timestep=t,
                          encoder_hidden_states=randn(n, self.text_tokens, self.unet["cross_attention_dim"]))
            return dict(inputs, added_cond_kwargs=extra) if extra else inputs
        text = randn(n, self.text_tokens, self.text_dim)
        if self.family == "pixart":
            conditions = {"resolution": None, "aspect_ratio": None}
            if self.unet.get("use_additional_conditions", self.unet.get("sample_size") == 128):
                # PixArtAlphaPipeline at 1024: the micro-conditions (height, width) and height / width
                conditions = {"resolution": torch.tensor([[float(h), float(w)]] * n).to(device, dtype),
                              "aspect_ratio": torch.tensor([[h / w]] * n).to(device, dtype)}
            return dict(hidden_states=randn(n, 4, lh, lw), timestep=t, encoder_hidden_states=text,
                        added_cond_kwargs=conditions)
        if self.family == "sd3":
            return dict(hidden_states=randn(n, self.unet["in_channels"], lh, lw), timestep=t,
                        encoder_hidden_states=text, pooled_projections=randn(n, self.unet["pooled_projection_dim"]))
        rows, cols = lh // 2, lw // 2  # Flux packs 2x2 latent pixels into one token
        ids = torch.zeros(rows, cols, 3)
        ids[..., 1], ids[..., 2] = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
        guidance = {"guidance": torch.full((n,), 3.5, device=device)} if self.unet.get("guidance_embeds") else {}
        return dict(hidden_states=randn(n, rows * cols, self.unet["in_channels"]), timestep=t / 1000,
                    encoder_hidden_states=text, pooled_projections=randn(n, self.unet["pooled_projection_dim"]),
                    img_ids=ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(self.text_tokens, 3, device=device),
                    **guidance)

    @property
    def latent_channels(self) -> int:
        """Channels of the VAE latent (Flux packs 2x2 latent pixels into one token's channels)."""
        channels = self.unet.get("in_channels", 4)
        return channels // 4 if self.family == "flux" else channels


_CLASSES = {"unet": "UNet2DConditionModel", "pixart": "PixArtTransformer2DModel", "sd3": "SD3Transformer2DModel",
            "flux": "FluxTransformer2DModel", "wan": "WanTransformer3DModel",
            "hunyuan-video": "HunyuanVideoTransformer3DModel", "ltx": "LTXVideoTransformer3DModel",
            "flux2": "Flux2Transformer2DModel", "qwen-image": "QwenImageTransformer2DModel",
            "sana": "SanaTransformer2DModel", "z-image": "ZImageTransformer2DModel",
            "cogvideox": "CogVideoXTransformer3DModel"}

GUIDANCE = {
    "batch": "classifier-free guidance in one call, the batch doubled (the denoiser sees 2 x batch)",
    "calls": "classifier-free guidance as two calls of the batch, conditional then unconditional",
    "distilled": "guidance-distilled: one call of the batch (the guidance scale is an input)",
}


_SD = dict(
    in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
)

_PIXART = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
               cross_attention_dim=1152, sample_size=64, patch_size=2, caption_channels=4096,
               norm_type="ada_norm_single", use_additional_conditions=False)

PRESETS = {
    "tiny": Preset(
        "tiny", "a tiny SD-1.x-shaped UNet for tests (seconds on a CPU)",
        dict(in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
             cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32, sample_size=32),
        text_tokens=8,
    ),
    "sd15": Preset("sd15", "Stable Diffusion 1.5 UNet (860M parameters)",
                   dict(_SD, cross_attention_dim=768, attention_head_dim=8, sample_size=64)),
    "sd21": Preset("sd21", "Stable Diffusion 2.1 768-v UNet (865M parameters)",
                   dict(_SD, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True,
                        sample_size=96)),
    "sdxl": Preset(
        "sdxl", "SDXL base 1.0 UNet (2.6B parameters)",
        dict(in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
             down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
             up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
             transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
             use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
             projection_class_embeddings_input_dim=2816, sample_size=128),
        added_cond={"text_embeds": (1280,), "time_ids": (6,)},
    ),
    "pixart": Preset("pixart", "PixArt-alpha 512 transformer (610M parameters, 28 blocks)", _PIXART,
                     text_tokens=120, family="pixart", text_dim=4096, patch=2),
    "pixart-7": Preset("pixart-7",
                       "PixArt-alpha widths (1152 wide, 16 heads x 72) with 7 of its 28 blocks (REDUCED)",
                       dict(_PIXART, num_layers=7), text_tokens=120, family="pixart", text_dim=4096, patch=2),
    "sd3": Preset(
        "sd3", "Stable Diffusion 3 medium MMDiT (2B parameters, 24 joint blocks)",
        dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
             num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
             pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192),
        text_tokens=333, family="sd3", text_dim=4096, patch=2,
    ),
    "flux-2+4": Preset(
        "flux-2+4", "Flux.1-dev widths with 2 double- and 4 single-stream blocks (of 19 and 38; REDUCED)",
        dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56)),
        text_tokens=512, family="flux", text_dim=4096, patch=2,
    ),
}


# ---- video and 2025-2026 image transformers: published widths, REDUCED block counts (named in the preset) --------
# Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json)
_WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                 text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# HunyuanVideo 1.0 T2V (hunyuanvideo-community/HunyuanVideo, transformer/config.json)
_HUNYUAN_VIDEO = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                      num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                      qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                      rope_theta=256.0, rope_axes_dim=(16, 56, 56))
# LTX-Video 2B 0.9 (Lightricks/LTX-Video, transformer/config.json)
_LTX_2B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
               attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
               qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096,
               attention_bias=True, attention_out_bias=True)
# Flux.2 [dev] (black-forest-labs/FLUX.2-dev, transformer/config.json: diffusers' defaults)
_FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                  num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                  axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)
# Qwen-Image (Qwen/Qwen-Image, transformer/config.json)
_QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# SANA 1600M 1024px (Efficient-Large-Model/Sana_1600M_1024px_diffusers, transformer/config.json)
_SANA_1600M = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                   num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                   caption_channels=2304, mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=32, patch_size=1,
                   norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None)

# Z-Image (Tongyi-MAI/Z-Image-Turbo, transformer/config.json)
_Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
                n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
                t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])

_VIDEO = dict(frames_per_latent=4, vae_scale=8, patch=2, multiple=16)  # Wan / HunyuanVideo: VAE 4x time, 8x space
_LTX_VIDEO = dict(frames_per_latent=8, vae_scale=32, patch=1, multiple=32)  # LTX's VAE: 8x time, 32x space
_IMAGE16 = dict(vae_scale=8, patch=2, multiple=16)  # Flux.2, Qwen-Image: 8x VAE, 2x2 latent pixels per token
_IMAGE32 = dict(vae_scale=32, patch=1, multiple=32)  # SANA's DC-AE: 32x


def _wan_1_3b(blocks: int) -> Preset:
    """Wan 2.1 T2V 1.3B at its real widths with ``blocks`` of its 30 blocks: ``wan-{blocks}b``."""
    return Preset(
        f"wan-{blocks}b", "Wan 2.1 T2V 1.3B widths (1536 wide, 12 heads x 128, ffn 8960) with "
        f"{blocks} of its 30 blocks (REDUCED); umT5 text 512 x 4096; guidance: cond + uncond calls",
        dict(_WAN_1_3B, num_layers=blocks), text_tokens=512, family="wan", text_dim=4096, guidance="calls", **_VIDEO)


PRESETS.update({
    "wan-2b": _wan_1_3b(2),
    "wan-1b": _wan_1_3b(1),
    "hunyuan-video-1+2": Preset(
        "hunyuan-video-1+2", "HunyuanVideo widths (3072 wide, 24 heads x 128) with 1 of its 20 double- and 2 of its "
        "40 single-stream blocks (REDUCED); LLaMA text 256 x 4096 (64 prompt tokens, masked); guidance-distilled",
        dict(_HUNYUAN_VIDEO, num_layers=1, num_single_layers=2), text_tokens=256, prompt_tokens=64,
        family="hunyuan-video", text_dim=4096, guidance="distilled", **_VIDEO),
    "ltx-4b": Preset(
        "ltx-4b", "LTX-Video 2B widths (2048 wide, 32 heads x 64) with 4 of its 28 blocks (REDUCED); T5 text 128 x "
        "4096 (64 prompt tokens, masked); guidance: batch doubled",
        dict(_LTX_2B, num_layers=4), text_tokens=128, prompt_tokens=64, family="ltx", text_dim=4096,
        guidance="batch", **_LTX_VIDEO),
    "flux2-1+1": Preset(
        "flux2-1+1", "Flux.2 dev widths (6144 wide, 48 heads x 128) with 1 of its 8 double- and 1 of its 48 "
        "single-stream blocks (REDUCED); Mistral text 512 x 15360; guidance-distilled",
        dict(_FLUX2_DEV, num_layers=1, num_single_layers=1), text_tokens=512, family="flux2", text_dim=15360,
        guidance="distilled", **_IMAGE16),
    "qwen-image-2b": Preset(
        "qwen-image-2b", "Qwen-Image widths (3072 wide, 24 heads x 128) with 2 of its 60 blocks (REDUCED); "
        "Qwen2.5-VL text 128 x 3584 (negative prompt 6 tokens); true guidance: cond + uncond calls",
        dict(_QWEN_IMAGE, num_layers=2), text_tokens=128, negative_tokens=6, family="qwen-image", text_dim=3584,
        guidance="calls", **_IMAGE16),
    "sana-4b": Preset(
        "sana-4b", "SANA 1600M 1024px widths (2240 wide, 70 linear-attention heads x 32) with 4 of its 20 blocks "
        "(REDUCED); Gemma-2 text 300 x 2304 (64 prompt tokens, masked); guidance: batch doubled",
        dict(_SANA_1600M, num_layers=4), text_tokens=300, prompt_tokens=64, family="sana", text_dim=2304,
        guidance="batch", **_IMAGE32),
    "z-image-1+1": Preset(
        "z-image-1+1", "Z-Image widths (3840 wide, 30 heads x 128, ffn 10240) with 1 of its 2 noise-refiner, 1 of its "
        "2 caption-refiner and 1 of its 30 main layers (REDUCED); Qwen3 caption 64 x 2560 (negative prompt 6); "
        "guidance: batch doubled",
        dict(_Z_IMAGE, n_layers=1, n_refiner_layers=1), text_tokens=64, prompt_tokens=64, negative_tokens=6,
        family="z-image", text_dim=2560, guidance="batch", **_IMAGE16),
    # tiny versions for tests (seconds on a CPU): the same families and inputs at toy widths
    "tiny-wan": Preset(
        "tiny-wan", "a tiny Wan-shaped video transformer for tests",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
        text_tokens=8, family="wan", text_dim=16, guidance="calls", **_VIDEO),
    "tiny-hunyuan-video": Preset(
        "tiny-hunyuan-video", "a tiny HunyuanVideo-shaped video transformer for tests",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16,
             pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
        text_tokens=8, prompt_tokens=5, family="hunyuan-video", text_dim=16, guidance="distilled", **_VIDEO),
    "tiny-ltx": Preset(
        "tiny-ltx", "a tiny LTX-Video-shaped video transformer for tests",
        dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
             cross_attention_dim=16, num_layers=2, caption_channels=16),
        text_tokens=8, prompt_tokens=5, family="ltx", text_dim=16, guidance="batch", **_LTX_VIDEO),
    "tiny-cogvideox": Preset(
        "tiny-cogvideox", "a tiny CogVideoX-5B-shaped video transformer for tests (3-D rotary)",
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
             text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
             temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True),
        text_tokens=8, family="cogvideox", text_dim=16, guidance="batch", **_VIDEO),
    "tiny-flux2": Preset(
        "tiny-flux2", "a tiny Flux.2-shaped image transformer for tests",
        dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32, mlp_ratio=3.0,
             axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True),
        text_tokens=8, family="flux2", text_dim=32, guidance="distilled", **_IMAGE16),
    "tiny-qwen-image": Preset(
        "tiny-qwen-image", "a tiny Qwen-Image-shaped image transformer for tests",
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        text_tokens=8, negative_tokens=3, family="qwen-image", text_dim=32, guidance="calls", **_IMAGE16),
    "tiny-sana": Preset(
        "tiny-sana", "a tiny SANA-shaped image transformer for tests",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
             num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8,
             mlp_ratio=2.5, sample_size=8, patch_size=1),
        text_tokens=8, prompt_tokens=5, family="sana", text_dim=8, guidance="batch", **_IMAGE32),
    "tiny-z-image": Preset(
        "tiny-z-image", "a tiny Z-Image-shaped image transformer for tests",
        dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
             n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[256, 64, 64]),
        text_tokens=8, prompt_tokens=8, negative_tokens=3, family="z-image", text_dim=16, guidance="batch",
        **_IMAGE16),
})


# ---- full-size presets for the GPU: every block of the published model, named by the model -----------------------
# Built on the device in the target dtype (Preset.build); the parameter counts are checked on the meta device
# (tests/test_cli_bench.py). Configs: diffusers' transformer/config.json of each model (or its conversion script),
# as cited beside each; sizes and frames are the pipelines' usual ones; guidance as the pipeline runs it.
# CogVideoX-5B (THUDM/CogVideoX-5b; scripts/convert_cogvideox_to_diffusers.py: 42 layers, 48 heads, rotary)
_COGVIDEOX_5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, num_layers=42,
                     text_embed_dim=4096, time_embed_dim=512, sample_width=90, sample_height=60, sample_frames=49,
                     patch_size=2, temporal_compression_ratio=4, max_text_seq_length=226,
                     use_rotary_positional_embeddings=True)
# Wan 2.1 T2V 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json): 40 heads x 128 (5120 wide), ffn 13824
_WAN_14B = dict(_WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# Flux.1 [dev] (black-forest-labs/FLUX.1-dev, transformer/config.json): 19 double- and 38 single-stream blocks
_FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                  axes_dims_rope=(16, 56, 56))
# PixArt-Sigma XL/2 1024 (PixArt-alpha/PixArt-Sigma-XL-2-1024-MS; scripts/convert_pixart_sigma_to_diffusers.py:
# interpolation scale 2 at 1024, no micro-conditions)
_PIXART_SIGMA = dict(_PIXART, sample_size=128, interpolation_scale=2, use_additional_conditions=False)


def _full(name: str, description: str, config: dict, **fields) -> Preset:
    return Preset(name, description + " (full size, random weights)", config, full_size=True, **fields)


PRESETS.update({
    "pixart-alpha-1024": _full(
        "pixart-alpha-1024", "PixArt-alpha XL/2 1024 (PixArt-alpha/PixArt-XL-2-1024-MS: 28 blocks, 1152 wide; "
        "micro-conditions on); T5 text 120 x 4096; guidance: batch doubled; usual size 1024",
        dict(_PIXART, sample_size=128, use_additional_conditions=True), text_tokens=120, family="pixart",
        text_dim=4096, patch=2, sizes=(1024,)),
    "pixart-sigma-1024": _full(
        "pixart-sigma-1024", "PixArt-Sigma XL/2 1024 (28 blocks, 1152 wide); T5 text 300 x 4096; guidance: batch "
        "doubled; usual size 1024", _PIXART_SIGMA, text_tokens=300, family="pixart", text_dim=4096, patch=2,
        sizes=(1024,)),
    "flux1-dev": _full(
        "flux1-dev", "Flux.1 [dev] (19 double- and 38 single-stream blocks, 3072 wide); T5 text 512 x 4096; "
        "guidance-distilled; usual sizes 1024, 2048", _FLUX1_DEV, text_tokens=512, family="flux", text_dim=4096,
        patch=2, sizes=(1024, 2048)),
    "wan2.1-1.3b": _full(
        "wan2.1-1.3b", "Wan 2.1 T2V 1.3B (30 blocks, 1536 wide); umT5 text 512 x 4096; guidance: cond + uncond "
        "calls; usual size 480x832, 81 frames", _WAN_1_3B, text_tokens=512, family="wan", text_dim=4096,
        guidance="calls", sizes=("480x832",), **dict(_VIDEO, default_frames=81)),
    "wan2.1-14b": _full(
        "wan2.1-14b", "Wan 2.1 T2V 14B (40 blocks, 5120 wide, ffn 13824); umT5 text 512 x 4096; guidance: cond + "
        "uncond calls; usual sizes 480x832 and 720x1280, 81 frames", _WAN_14B, text_tokens=512, family="wan",
        text_dim=4096, guidance="calls", sizes=("480x832", "720x1280"), **dict(_VIDEO, default_frames=81)),
    "hunyuan-video-13b": _full(
        "hunyuan-video-13b", "HunyuanVideo (20 double- and 40 single-stream blocks, 3072 wide); LLaMA text 256 x "
        "4096 (64 prompt tokens, masked); guidance-distilled; usual sizes 720x1280 and 544x960, 129 frames",
        _HUNYUAN_VIDEO, text_tokens=256, prompt_tokens=64, family="hunyuan-video", text_dim=4096,
        guidance="distilled", sizes=("720x1280", "544x960"), **dict(_VIDEO, default_frames=129)),
    "ltx-video-2b": _full(
        "ltx-video-2b", "LTX-Video 2B 0.9 (28 blocks, 2048 wide); T5 text 128 x 4096 (64 prompt tokens, masked); "
        "guidance: batch doubled; usual size 480x704, 161 frames", _LTX_2B, text_tokens=128, prompt_tokens=64,
        family="ltx", text_dim=4096, guidance="batch", sizes=("480x704",), **dict(_LTX_VIDEO, default_frames=161)),
    "cogvideox-5b": _full(
        "cogvideox-5b", "CogVideoX-5B (42 blocks, 48 heads x 64, 3-D rotary); T5 text 226 x 4096; guidance: batch "
        "doubled; usual size 480x720, 49 frames", _COGVIDEOX_5B, text_tokens=226, family="cogvideox",
        text_dim=4096, guidance="batch", sizes=("480x720",), **dict(_VIDEO, default_frames=49)),
    "qwen-image-20b": _full(
        "qwen-image-20b", "Qwen-Image (60 blocks, 3072 wide); Qwen2.5-VL text 128 x 3584 (negative prompt 6 "
        "tokens); true guidance: cond + uncond calls; bfloat16 (20B: 41 GB); usual sizes 1328, 1024",
        _QWEN_IMAGE, text_tokens=128, negative_tokens=6, family="qwen-image", text_dim=3584, guidance="calls",
        sizes=(1328, 1024), **_IMAGE16),
    "sana-1600m": _full(
        "sana-1600m", "SANA 1600M 1024px (20 blocks, 2240 wide, linear attention); Gemma-2 text 300 x 2304 (64 "
        "prompt tokens, masked); guidance: batch doubled; usual size 1024", _SANA_1600M, text_tokens=300,
        prompt_tokens=64, family="sana", text_dim=2304, guidance="batch", sizes=(1024,), **_IMAGE32),
    "z-image-6b": _full(
        "z-image-6b", "Z-Image (30 layers, 2 noise- and 2 caption-refiner layers, 3840 wide); Qwen3 caption 64 x "
        "2560 (negative prompt 6); guidance: batch doubled; usual size 1024", _Z_IMAGE, text_tokens=64,
        prompt_tokens=64, negative_tokens=6, family="z-image", text_dim=2560, guidance="batch", sizes=(1024,),
        **_IMAGE16),
    "flux2-dev": _full(
        "flux2-dev", "Flux.2 [dev] (8 double- and 48 single-stream blocks, 6144 wide); Mistral text 512 x 15360; "
        "guidance-distilled; bfloat16 only: 32B parameters are 64 GB, so on an 80 GB card (H100) it fits at 1024 "
        "with about 14 GB left for activations (eager; 2048 and reduce-overhead's graph pools are tight), on a "
        "141 GB card (H200) at every size; usual size 1024", _FLUX2_DEV, text_tokens=512, family="flux2",
        text_dim=15360, guidance="distilled", sizes=(1024,), **_IMAGE16),
})
# the published models that the CPU presets above already hold at full size, under their model names
FULL_SIZE_NAMES = {"sd1.5": "sd15", "sd2.1": "sd21", "sdxl-base": "sdxl", "sd3-medium": "sd3"}

# the family names: the reduced preset of each (the tables name the preset, with its block counts)
ALIASES = {"wan": "wan-2b", "hunyuan-video": "hunyuan-video-1+2", "ltx": "ltx-4b", "flux2": "flux2-1+1",
           "qwen-image": "qwen-image-2b", "sana": "sana-4b", "z-image": "z-image-1+1", **FULL_SIZE_NAMES}


def load_model(path_or_id: str, dtype=torch.float32):
    """The UNet and VAE scale of a real diffusers pipeline; a clear ``FileNotFoundError`` when it is absent."""
    pipe = load_pipeline(path_or_id, dtype)
    unet = getattr(pipe, "unet", None)
    if unet is None:
        raise TypeError(f"{path_or_id!r} holds no UNet (components: {', '.join(pipe.components)})")
    return unet, getattr(pipe, "vae_scale_factor", 8)


def resolve(name: str | None = None, model: str | None = None, dtype=torch.float32) -> Preset:
    """A preset by name, or one that describes a real pipeline's UNet (loading it once to read its config)."""
    if model is None:
        return PRESETS[ALIASES.get(name, name)]
    unet, vae_scale = load_model(model, dtype)
    config = dict(unet.config)
    added = {}
    if config.get("addition_embed_type") == "text_time":
        time_dim = 6 * config["addition_time_embed_dim"]
        added = {"text_embeds": (config["projection_class_embeddings_input_dim"] - time_dim,), "time_ids": (6,)}
    return Preset(model.rstrip("/").split("/")[-1], f"the UNet of {model}", config, added_cond=added,
                  vae_scale=vae_scale, model=model)
