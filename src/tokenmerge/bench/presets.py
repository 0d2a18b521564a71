"""Architecture presets with random weights: real timings and memory, not images (no download needed).

The configurations are the published shapes of the SD 1.5, SD 2.1 (768-v) and SDXL base 1.0 UNets, and of the
PixArt-alpha 512 and SD3 medium transformers, written here. ``flux-2+4`` has Flux.1-dev's real block widths but 2
double-stream and 4 single-stream blocks (of 19 and 38): the full 12B model does not fit this machine in fp32.

The video and 2025-2026 image transformers have their published widths and REDUCED block counts, named in the
preset (``wan-2b``: 2 of Wan 2.1 1.3B's 30 blocks, ``wan-1b`` (the demo's) 1; ``hunyuan-video-1+2``: 1 of 20
double- and 2 of 40 single-stream blocks); the family names (``wan``, ``hunyuan-video``, ``ltx``, ``flux2``,
``qwen-image``, ``sana``) are aliases of them. Their step inputs are the pipeline's: the latent of ``--frames``
pixel frames (the VAE's temporal and spatial compression), prompt embeddings of the text encoder's width and the
pipeline's token count (padded as it pads, with its mask), and guidance as the pipeline runs it: the batch doubled
in one call (LTX, SANA), separate conditional and unconditional calls (Wan, Qwen-Image), or guidance-distilled, one call
(HunyuanVideo, Flux.2 dev).

The full-size presets for the GPU (every block, named by the model: ``flux1-dev``, ``wan2.1-14b``...) are in
``full_size.py`` and registered here too; the ``Preset`` record is in ``preset.py``, the published configs in
``configs.py``.
"""

from __future__ import annotations

import torch

from ..tools.pipelines import load_pipeline
from .configs import (
    FLUX2_DEV,
    HUNYUAN_VIDEO,
    IMAGE16,
    IMAGE32,
    LTX_2B,
    LTX_VIDEO,
    PIXART_512,
    QWEN_IMAGE,
    SANA_1600M,
    SD_UNET,
    VIDEO,
    WAN_1_3B,
    Z_IMAGE,
)
from .full_size import FULL_SIZE, FULL_SIZE_NAMES
from .preset import _CLASSES, GUIDANCE, Preset, load_model

__all__ = ["PRESETS", "ALIASES", "GUIDANCE", "Preset", "load_model", "load_pipeline", "resolve"]
_ = _CLASSES  # re-exported: the tests name a preset's diffusers class through it

PRESETS = {
    "tiny": Preset(
        "tiny", "a tiny SD-1.x-shaped UNet for tests (seconds on a CPU)",
        dict(in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
             cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32, sample_size=32),
        text_tokens=8,
    ),
    "sd15": Preset("sd15", "Stable Diffusion 1.5 UNet (860M parameters)",
                   dict(SD_UNET, cross_attention_dim=768, attention_head_dim=8, sample_size=64)),
    "sd21": Preset("sd21", "Stable Diffusion 2.1 768-v UNet (865M parameters)",
                   dict(SD_UNET, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20),
                        use_linear_projection=True, sample_size=96)),
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
    "pixart": Preset("pixart", "PixArt-alpha 512 transformer (610M parameters, 28 blocks)", PIXART_512,
                     text_tokens=120, family="pixart", text_dim=4096, patch=2),
    "pixart-7": Preset("pixart-7",
                       "PixArt-alpha widths (1152 wide, 16 heads x 72) with 7 of its 28 blocks (REDUCED)",
                       dict(PIXART_512, num_layers=7), text_tokens=120, family="pixart", text_dim=4096, patch=2),
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


def _wan_1_3b(blocks: int) -> Preset:
    """Wan 2.1 T2V 1.3B at its real widths with ``blocks`` of its 30 blocks: ``wan-{blocks}b``."""
    return Preset(
        f"wan-{blocks}b", "Wan 2.1 T2V 1.3B widths (1536 wide, 12 heads x 128, ffn 8960) with "
        f"{blocks} of its 30 blocks (REDUCED); umT5 text 512 x 4096; guidance: cond + uncond calls",
        dict(WAN_1_3B, num_layers=blocks), text_tokens=512, family="wan", text_dim=4096, guidance="calls", **VIDEO)


PRESETS.update({
    "wan-2b": _wan_1_3b(2),
    "wan-1b": _wan_1_3b(1),
    "hunyuan-video-1+2": Preset(
        "hunyuan-video-1+2", "HunyuanVideo widths (3072 wide, 24 heads x 128) with 1 of its 20 double- and 2 of its "
        "40 single-stream blocks (REDUCED); LLaMA text 256 x 4096 (64 prompt tokens, masked); guidance-distilled",
        dict(HUNYUAN_VIDEO, num_layers=1, num_single_layers=2), text_tokens=256, prompt_tokens=64,
        family="hunyuan-video", text_dim=4096, guidance="distilled", **VIDEO),
    "ltx-4b": Preset(
        "ltx-4b", "LTX-Video 2B widths (2048 wide, 32 heads x 64) with 4 of its 28 blocks (REDUCED); T5 text 128 x "
        "4096 (64 prompt tokens, masked); guidance: batch doubled",
        dict(LTX_2B, num_layers=4), text_tokens=128, prompt_tokens=64, family="ltx", text_dim=4096,
        guidance="batch", **LTX_VIDEO),
    "flux2-1+1": Preset(
        "flux2-1+1", "Flux.2 dev widths (6144 wide, 48 heads x 128) with 1 of its 8 double- and 1 of its 48 "
        "single-stream blocks (REDUCED); Mistral text 512 x 15360; guidance-distilled",
        dict(FLUX2_DEV, num_layers=1, num_single_layers=1), text_tokens=512, family="flux2", text_dim=15360,
        guidance="distilled", **IMAGE16),
    "qwen-image-2b": Preset(
        "qwen-image-2b", "Qwen-Image widths (3072 wide, 24 heads x 128) with 2 of its 60 blocks (REDUCED); "
        "Qwen2.5-VL text 128 x 3584 (negative prompt 6 tokens); true guidance: cond + uncond calls",
        dict(QWEN_IMAGE, num_layers=2), text_tokens=128, negative_tokens=6, family="qwen-image", text_dim=3584,
        guidance="calls", **IMAGE16),
    "sana-4b": Preset(
        "sana-4b", "SANA 1600M 1024px widths (2240 wide, 70 linear-attention heads x 32) with 4 of its 20 blocks "
        "(REDUCED); Gemma-2 text 300 x 2304 (64 prompt tokens, masked); guidance: batch doubled",
        dict(SANA_1600M, num_layers=4), text_tokens=300, prompt_tokens=64, family="sana", text_dim=2304,
        guidance="batch", **IMAGE32),
    "z-image-1+1": Preset(
        "z-image-1+1", "Z-Image widths (3840 wide, 30 heads x 128, ffn 10240) with 1 of its 2 noise-refiner, 1 of its "
        "2 caption-refiner and 1 of its 30 main layers (REDUCED); Qwen3 caption 64 x 2560 (negative prompt 6); "
        "guidance: batch doubled",
        dict(Z_IMAGE, n_layers=1, n_refiner_layers=1), text_tokens=64, prompt_tokens=64, negative_tokens=6,
        family="z-image", text_dim=2560, guidance="batch", **IMAGE16),
    # tiny versions for tests (seconds on a CPU): the same families and inputs at toy widths
    "tiny-wan": Preset(
        "tiny-wan", "a tiny Wan-shaped video transformer for tests",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
        text_tokens=8, family="wan", text_dim=16, guidance="calls", **VIDEO),
    "tiny-hunyuan-video": Preset(
        "tiny-hunyuan-video", "a tiny HunyuanVideo-shaped video transformer for tests",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16,
             pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
        text_tokens=8, prompt_tokens=5, family="hunyuan-video", text_dim=16, guidance="distilled", **VIDEO),
    "tiny-ltx": Preset(
        "tiny-ltx", "a tiny LTX-Video-shaped video transformer for tests",
        dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
             cross_attention_dim=16, num_layers=2, caption_channels=16),
        text_tokens=8, prompt_tokens=5, family="ltx", text_dim=16, guidance="batch", **LTX_VIDEO),
    "tiny-cogvideox": Preset(
        "tiny-cogvideox", "a tiny CogVideoX-5B-shaped video transformer for tests (3-D rotary)",
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
             text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
             temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True),
        text_tokens=8, family="cogvideox", text_dim=16, guidance="batch", **VIDEO),
    "tiny-flux2": Preset(
        "tiny-flux2", "a tiny Flux.2-shaped image transformer for tests",
        dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32, mlp_ratio=3.0,
             axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True),
        text_tokens=8, family="flux2", text_dim=32, guidance="distilled", **IMAGE16),
    "tiny-qwen-image": Preset(
        "tiny-qwen-image", "a tiny Qwen-Image-shaped image transformer for tests",
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        text_tokens=8, negative_tokens=3, family="qwen-image", text_dim=32, guidance="calls", **IMAGE16),
    "tiny-sana": Preset(
        "tiny-sana", "a tiny SANA-shaped image transformer for tests",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
             num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8,
             mlp_ratio=2.5, sample_size=8, patch_size=1),
        text_tokens=8, prompt_tokens=5, family="sana", text_dim=8, guidance="batch", **IMAGE32),
    "tiny-z-image": Preset(
        "tiny-z-image", "a tiny Z-Image-shaped image transformer for tests",
        dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
             n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[256, 64, 64]),
        text_tokens=8, prompt_tokens=8, negative_tokens=3, family="z-image", text_dim=16, guidance="batch",
        **IMAGE16),
})


PRESETS.update(FULL_SIZE)

# the family names: the reduced preset of each (the tables name the preset, with its block counts)
ALIASES = {"wan": "wan-2b", "hunyuan-video": "hunyuan-video-1+2", "ltx": "ltx-4b", "flux2": "flux2-1+1",
           "qwen-image": "qwen-image-2b", "sana": "sana-4b", "z-image": "z-image-1+1", **FULL_SIZE_NAMES}


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
