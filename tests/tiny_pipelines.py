"""Whole diffusers pipelines of tiny random parts, for end-to-end tests (no download, no tokenizer files).

Each ``PipelineCase`` builds a pipeline from the matching tiny transformer of ``tiny_denoisers.CATALOGUE`` (or a
tiny config of its own), a tiny VAE of the family's class, and the family's scheduler; text encoders and tokenizers
are ``None`` and the prompt embeddings (with their masks, pooled and negative embeddings) are passed as seeded random
tensors of the shapes the transformer takes (Wan 2.1 I2V's CLIP vision tower is built from a config). Sizes give
the transformer 8x8 tokens per image or frame (SANA 16x16) and 3 latent frames for video (9 frames), and calls take 2
steps, so a whole generation takes a few tens of milliseconds on one CPU thread.

Example:
    >>> from tiny_pipelines import CASES
    >>> case = CASES["wan-t2v"]
    >>> if case.available() is None:
    ...     pipe, kwargs = case.build()
    ...     video = case.generate(pipe, kwargs)
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from tiny_denoisers import CATALOGUE

TXT = 5  # prompt tokens (odd on purpose)


@dataclass(frozen=True)
class PipelineCase:
    """One pipeline of tiny parts and how to call it.

    Args:
        name: short id ("flux2-klein", "wan-i2v", ...).
        cls: the diffusers pipeline class name.
        build: ``build() -> (pipeline, call kwargs)``; the kwargs hold everything but ``generator``.
        video: the pipeline generates video (``.frames``), else images (``.images``).
        denoiser: the catalogue entry of its transformer (for ``tiny_denoisers.available``).
        requires: other diffusers classes the build needs (VAEs, schedulers).
        guidance: the call kwargs that turn classifier-free guidance off (one denoiser call per step).
        grid: the token grid the transformer gets for the generated image or video ((H, W) or (F, H, W)).
        reference: reference-image tokens the transformer gets after the generated image's (edit pipelines).
        schedule_steps: enough steps for the family's scheduler to reach past half of the denoising process
            (progress 1 - t/1000 > 0.5) in some step: shifted flow schedules stay at high noise for long.
        around: a context manager factory each generation runs inside (``None``: none).
        notes: what is special about the case.
        denoisers: the components the patch must find (Ideogram 4 has a conditional and an unconditional one).
        todo: whether the family takes ToDo (else ``apply_todo`` must refuse it).
    """

    name: str
    cls: str
    build: Callable[[], tuple]
    video: bool = False
    grid: tuple[int, ...] = (8, 8)
    reference: int = 0
    denoiser: str = ""
    requires: tuple[str, ...] = ()
    guidance: dict = field(default_factory=dict)
    schedule_steps: int = 4
    around: Callable | None = None
    notes: str = ""
    denoisers: tuple[str, ...] = ("transformer",)  # the pipeline's components that get patched
    todo: bool = True  # False: the family refuses ToDo (with its reason)

    def available(self) -> str | None:
        """None if the case can be built on the installed diffusers, else the reason it cannot."""
        import diffusers

        for name in (self.cls, *self.requires):
            if getattr(diffusers, name, None) is None:
                return f"{name} is not in diffusers {diffusers.__version__}"
        if self.denoiser:
            from tiny_denoisers import available

            reason = available(self.denoiser)
            if reason is not None:
                return reason
        return None

    def generate(self, pipe, kwargs: dict, seed: int = 0, **extra) -> torch.Tensor:
        """One seeded generation: the decoded images (B, C, H, W) or video (B, F, C, H, W) as a float tensor."""
        with self.around() if self.around is not None else contextlib.nullcontext():
            out = pipe(generator=torch.Generator().manual_seed(seed), **{**kwargs, **extra})
        result = out.frames if self.video else out.images
        return result if isinstance(result, torch.Tensor) else torch.as_tensor(result)


CASES: dict[str, PipelineCase] = {}


def _add(case: PipelineCase) -> None:
    CASES[case.name] = case


def _d(name: str):
    return getattr(importlib.import_module("diffusers"), name)


def _randn(g: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _seeded(build: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build().float().eval()


def _pipe(cls: str, **parts):
    pipe = _d(cls)(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(size: int = 32, seed: int = 3):
    """A seeded random RGB reference image (PIL), as the edit pipelines take it."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


# ---- VAEs ------------------------------------------------------------------------------------------------------
def _vae_kl(latent_channels: int = 4, levels: int = 2, **extra):
    """AutoencoderKL, 2**(levels-1) x spatial compression (Flux, Chroma, HiDream use this class)."""
    return _seeded(lambda: _d("AutoencoderKL")(
        block_out_channels=(8,) * levels, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, latent_channels=latent_channels, norm_num_groups=4,
        layers_per_block=1, **extra))


def _vae_flux2():
    return _seeded(lambda: _d("AutoencoderKLFlux2")(
        block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4, norm_num_groups=4,
        use_quant_conv=False, use_post_quant_conv=False, sample_size=32))


def _vae_wan_like(cls: str, z_dim: int = 4, down: tuple = (True, True)):
    """AutoencoderKLWan / AutoencoderKLQwenImage: 2**len(down) x spatial, 2**sum(down) x temporal compression
    (the Wan pipelines read them from the config's scale factors, the Qwen pipelines from ``temperal_downsample``)."""
    extra = {}
    if cls == "AutoencoderKLWan":
        extra = dict(scale_factor_spatial=2 ** len(down), scale_factor_temporal=2 ** sum(down))
    return _seeded(lambda: _d(cls)(
        base_dim=8, z_dim=z_dim, dim_mult=[1] * (len(down) + 1), num_res_blocks=1, temperal_downsample=list(down),
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim, **extra))


def _vae_dc():
    return _seeded(lambda: _d("AutoencoderDC")(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407))


def _vae_hunyuan_video():
    return _seeded(lambda: _d("AutoencoderKLHunyuanVideo")(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 8), layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4, mid_block_add_attention=True))


def _vae_ltx():
    def build():
        vae = _d("AutoencoderKLLTXVideo")(
            latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=1, patch_size_t=1, encoder_causal=True,
            decoder_causal=False)
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        return vae

    return _seeded(build)


def _vae_cogvideox():
    return _seeded(lambda: _d("AutoencoderKLCogVideoX")(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3, block_out_channels=(8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4))


# ---- image pipelines -------------------------------------------------------------------------------------------
def _flux2_klein(reference: bool = False):
    def build():
        g = torch.Generator().manual_seed(1)
        pipe = _pipe("Flux2KleinPipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_flux2(),
                     text_encoder=None, tokenizer=None, transformer=CATALOGUE["flux2-klein"].build())
        kw = dict(prompt_embeds=_randn(g, 1, TXT, 32), negative_prompt_embeds=_randn(g, 1, TXT, 32),
                  height=32, width=32, num_inference_steps=2, guidance_scale=4.0, output_type="pt")
        if reference:  # the pipeline takes references of 64 px or more: 16x16 reference tokens
            kw["image"] = _image(64)
        return pipe, kw

    return build


_add(PipelineCase("flux2-klein", "Flux2KleinPipeline", _flux2_klein(), denoiser="flux2-klein",
                  requires=("AutoencoderKLFlux2",), guidance=dict(guidance_scale=1.0),
                  notes="Flux.2 Klein (not step-distilled: CFG, two calls a step); 32x32 px -> 8x8 tokens"))
_add(PipelineCase("flux2-klein-edit", "Flux2KleinPipeline", _flux2_klein(reference=True), reference=256,
                  denoiser="flux2-klein", requires=("AutoencoderKLFlux2",), guidance=dict(guidance_scale=1.0),
                  notes="Klein with a 64x64 px reference image: its 16x16 tokens (ids T=10) after the 8x8 generated"))


def _qwen(edit: bool = False):
    def build():
        g = torch.Generator().manual_seed(1)
        parts = dict(scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_wan_like("AutoencoderKLQwenImage"),
                     text_encoder=None, tokenizer=None, transformer=CATALOGUE["qwen-image"].build())
        if edit:
            parts["processor"] = None
        pipe = _pipe("QwenImageEditPipeline" if edit else "QwenImagePipeline", **parts)
        kw = dict(prompt_embeds=_randn(g, 1, TXT, 32), prompt_embeds_mask=torch.ones(1, TXT, dtype=torch.long),
                  negative_prompt_embeds=_randn(g, 1, TXT, 32),
                  negative_prompt_embeds_mask=torch.ones(1, TXT, dtype=torch.long),
                  height=64, width=64, num_inference_steps=2, true_cfg_scale=4.0, output_type="pt")
        if edit:
            kw["image"] = _image(64)
        return pipe, kw

    return build


@contextlib.contextmanager
def _small_qwen_edit_reference(area: int = 64 * 64):
    """Qwen-Image-Edit resizes the reference image to about 1024x1024 whatever its size (``calculate_dimensions(1024
    * 1024, ratio)``), about 20 s of tiny-VAE encoding per call on a CPU: for the duration of a call, resize it to
    ``area`` instead (64x64: 8x8 reference tokens). Everything after the resize (VAE encoding, packing,
    ``img_shapes`` listing the generated image and the reference) is the pipeline's own."""
    module = importlib.import_module("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit")
    original = module.calculate_dimensions
    module.calculate_dimensions = lambda _target_area, ratio: original(area, ratio)
    try:
        yield
    finally:
        module.calculate_dimensions = original


_add(PipelineCase("qwen-image", "QwenImagePipeline", _qwen(), denoiser="qwen-image",
                  requires=("AutoencoderKLQwenImage",), guidance=dict(true_cfg_scale=1.0),
                  notes="true CFG (two calls a step); 64x64 px -> 16x16 latent -> 8x8 packed tokens"))
_add(PipelineCase("qwen-image-edit", "QwenImageEditPipeline", _qwen(edit=True), reference=64,
                  denoiser="qwen-image-edit", requires=("AutoencoderKLQwenImage",), guidance=dict(true_cfg_scale=1.0),
                  around=_small_qwen_edit_reference,
                  notes="the reference image resized to 64x64 (8x8 tokens) instead of ~1024x1024"))


def _sana():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("SanaPipeline", tokenizer=None, text_encoder=None, vae=_vae_dc(),
                 transformer=CATALOGUE["sana"].build(),
                 scheduler=_d("DPMSolverMultistepScheduler")(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                             flow_shift=3.0))
    return pipe, dict(prompt_embeds=_randn(g, 1, TXT, 8), prompt_attention_mask=torch.ones(1, TXT, dtype=torch.long),
                      negative_prompt_embeds=_randn(g, 1, TXT, 8),
                      negative_prompt_attention_mask=torch.ones(1, TXT, dtype=torch.long),
                      negative_prompt=None, height=32, width=32, num_inference_steps=2, guidance_scale=4.5,
                      output_type="pt", use_resolution_binning=False)


_add(PipelineCase("sana", "SanaPipeline", _sana, grid=(16, 16), denoiser="sana", requires=("AutoencoderDC",),
                  guidance=dict(guidance_scale=1.0),
                  notes="SANA's DPM-Solver on flow sigmas (shift 3), timesteps 0..1000; a 2x AutoencoderDC"))


def _hidream():
    g = torch.Generator().manual_seed(1)
    none = {f"{kind}{suffix}": None for kind in ("text_encoder", "tokenizer") for suffix in ("", "_2", "_3", "_4")}
    pipe = _pipe("HiDreamImagePipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(),
                 vae=_vae_kl(shift_factor=0.0),
                 transformer=CATALOGUE["hidream"].build(), **none)
    # the pipeline rescales every size to the area of default_sample_size latents (128: 1024 px); the tiny
    # transformer takes at most 16x16 latents (max_resolution)
    pipe.default_sample_size = 16
    return pipe, dict(prompt_embeds_t5=_randn(g, 1, TXT, 8), prompt_embeds_llama3=_randn(g, 2, 1, TXT, 4),
                      pooled_prompt_embeds=_randn(g, 1, 8), negative_prompt_embeds_t5=_randn(g, 1, TXT, 8),
                      negative_prompt_embeds_llama3=_randn(g, 2, 1, TXT, 4),
                      negative_pooled_prompt_embeds=_randn(g, 1, 8),
                      height=32, width=32, num_inference_steps=2, guidance_scale=5.0, output_type="pt")


_add(PipelineCase("hidream", "HiDreamImagePipeline", _hidream, denoiser="hidream", guidance=dict(guidance_scale=1.0),
                  notes="T5 and Llama-3 (2 layers) embeddings and the pooled CLIP embedding passed in"))


def _chroma():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("ChromaPipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_kl(shift_factor=0.0),
                 text_encoder=None, tokenizer=None, transformer=CATALOGUE["chroma"].build())
    # the pipeline's own masks are float, 1 up to the prompt's length and its first pad token: the last one is padding
    mask = torch.tensor([[1.0] * (TXT - 1) + [0.0]])
    return pipe, dict(prompt_embeds=_randn(g, 1, TXT, 32), prompt_attention_mask=mask,
                      negative_prompt_embeds=_randn(g, 1, TXT, 32), negative_prompt_attention_mask=mask.clone(),
                      height=32, width=32, num_inference_steps=2, guidance_scale=4.0, output_type="pt")


_add(PipelineCase("chroma", "ChromaPipeline", _chroma, denoiser="chroma", guidance=dict(guidance_scale=1.0),
                  notes="the [text | image] attention mask masks the prompt's last (padding) token"))


def _kontext():
    g = torch.Generator().manual_seed(1)
    none = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    # Flux.1's scheduler config: the shift follows the image's token count (the pipeline passes mu)
    scheduler = _d("FlowMatchEulerDiscreteScheduler")(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                     max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    pipe = _pipe("FluxKontextPipeline", scheduler=scheduler,
                 vae=_vae_kl(shift_factor=0.0), transformer=CATALOGUE["flux-kontext"].build(), **none)
    return pipe, dict(image=_image(32), prompt_embeds=_randn(g, 1, TXT, 32), pooled_prompt_embeds=_randn(g, 1, 16),
                      height=32, width=32, num_inference_steps=2, guidance_scale=2.5, output_type="pt",
                      max_area=32 * 32, _auto_resize=False)


_add(PipelineCase("flux-kontext", "FluxKontextPipeline", _kontext, reference=64, denoiser="flux-kontext",
                  notes="a 32x32 px reference image (no resize to Kontext's resolutions): 8x8 tokens after the "
                        "generated image's, ids' first column 1; guidance-distilled (no CFG)"))


# ---- video pipelines -------------------------------------------------------------------------------------------
def _wan_scheduler():
    """The scheduler Wan checkpoints ship: UniPC on flow sigmas (timesteps 0..1000 into the transformer)."""
    return _d("UniPCMultistepScheduler")(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def _clip_vision(hidden: int, size: int = 32, patch: int = 8) -> dict:
    """A tiny random CLIP vision tower and its image processor, built from configs (no files)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=hidden, intermediate_size=24, num_attention_heads=2,
                                               num_hidden_layers=2, image_size=size, patch_size=patch)).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return dict(image_encoder=encoder, image_processor=processor)


def _wan(i2v: bool = False):
    def build():
        g = torch.Generator().manual_seed(1)
        parts = dict(tokenizer=None, text_encoder=None, vae=_vae_wan_like("AutoencoderKLWan"),
                     scheduler=_wan_scheduler(),
                     transformer=CATALOGUE["wan-i2v" if i2v else "wan"].build())
        text = 512 if i2v else TXT  # Wan 2.1 I2V's attention takes the last 512 context tokens as the text
        kw = dict(prompt_embeds=_randn(g, 1, text, 16), negative_prompt_embeds=_randn(g, 1, text, 16),
                  height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0, output_type="pt")
        if i2v:  # Wan 2.1 I2V: CLIP image tokens (the image encoder's last-but-one layer) join the context
            parts.update(_clip_vision(hidden=16))
            kw["image"] = _image(32)
        return _pipe("WanImageToVideoPipeline" if i2v else "WanPipeline", **parts), kw

    return build


_add(PipelineCase("wan-t2v", "WanPipeline", _wan(), video=True, grid=(3, 8, 8), denoiser="wan",
                  requires=("AutoencoderKLWan", "UniPCMultistepScheduler"), guidance=dict(guidance_scale=1.0),
                  schedule_steps=6, notes="Wan 2.1 T2V; 9 frames of 64x64 px -> 3x8x8 tokens"))
_add(PipelineCase("wan-i2v", "WanImageToVideoPipeline", _wan(i2v=True), video=True, grid=(3, 8, 8),
                  denoiser="wan-i2v", requires=("AutoencoderKLWan", "UniPCMultistepScheduler"),
                  guidance=dict(guidance_scale=1.0), schedule_steps=6,
                  notes="Wan 2.1 I2V: a tiny CLIP vision tower's tokens join the context; the first frame's latent "
                        "and mask ride on channels"))


def _hunyuan_video():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("HunyuanVideoPipeline", text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                 transformer=CATALOGUE["hunyuan-video"].build(), vae=_vae_hunyuan_video(),
                 scheduler=_d("FlowMatchEulerDiscreteScheduler")(shift=7.0))
    return pipe, dict(prompt_embeds=_randn(g, 1, TXT, 16), pooled_prompt_embeds=_randn(g, 1, 8),
                      prompt_attention_mask=torch.ones(1, TXT, dtype=torch.long),
                      height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=6.0,
                      output_type="pt")


_add(PipelineCase("hunyuan-video", "HunyuanVideoPipeline", _hunyuan_video, video=True, grid=(3, 8, 8),
                  denoiser="hunyuan-video", requires=("AutoencoderKLHunyuanVideo",), schedule_steps=10,
                  notes="guidance-distilled (no CFG); the real scheduler's shift 7 keeps 9 of 10 steps above t=500"))


def _ltx():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("LTXPipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_ltx(),
                 text_encoder=None, tokenizer=None, transformer=CATALOGUE["ltx"].build())
    return pipe, dict(prompt_embeds=_randn(g, 1, TXT, 16), prompt_attention_mask=torch.ones(1, TXT, dtype=torch.long),
                      negative_prompt_embeds=_randn(g, 1, TXT, 16),
                      negative_prompt_attention_mask=torch.ones(1, TXT, dtype=torch.long),
                      height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=3.0,
                      output_type="pt")


_add(PipelineCase("ltx", "LTXPipeline", _ltx, video=True, grid=(3, 8, 8), denoiser="ltx",
                  requires=("AutoencoderKLLTXVideo",), guidance=dict(guidance_scale=1.0),
                  notes="a 4x spatial / 4x temporal tiny VAE: 9 frames of 32x32 px -> 3x8x8 tokens (patch 1)"))


def _ltx_condition():
    """LTXConditionPipeline with a conditioning image at frame 8: its latent frame's 8x8 tokens are appended before
    the video's (with their own video_coords), and the transformer gets video_coords instead of the grid sizes."""
    condition = importlib.import_module("diffusers.pipelines.ltx.pipeline_ltx_condition").LTXVideoCondition
    pipe, kw = _ltx()
    pipe = _pipe("LTXConditionPipeline", **pipe.components)
    return pipe, {**kw, "conditions": [condition(image=_image(32), frame_index=8)]}


_add(PipelineCase("ltx-condition", "LTXConditionPipeline", _ltx_condition, video=True, grid=(3, 8, 8), denoiser="ltx",
                  requires=("AutoencoderKLLTXVideo",), guidance=dict(guidance_scale=1.0), schedule_steps=8,
                  notes="the grid from video_coords (no num_frames/height/width); 64 conditioning tokens before the "
                        "video's pass whole; its linear-quadratic schedule stays at high noise for 7 of 8 steps"))


def _cogvideox():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("CogVideoXPipeline", tokenizer=None, text_encoder=None, vae=_vae_cogvideox(),
                 transformer=CATALOGUE["cogvideox"].build(), scheduler=_d("CogVideoXDDIMScheduler")())
    return pipe, dict(prompt_embeds=_randn(g, 1, TXT, 16), negative_prompt_embeds=_randn(g, 1, TXT, 16),
                      height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=6.0,
                      output_type="pt")


_add(PipelineCase("cogvideox", "CogVideoXPipeline", _cogvideox, video=True, grid=(3, 8, 8), denoiser="cogvideox",
                  requires=("AutoencoderKLCogVideoX", "CogVideoXDDIMScheduler"), guidance=dict(guidance_scale=1.0),
                  notes="CogVideoX 1.0 (sin-cos positions); its DDIM scheduler (timesteps 0..1000, not flow)"))


def _zimage():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("ZImagePipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_kl(16, shift_factor=0.0),
                 text_encoder=None, tokenizer=None, transformer=CATALOGUE["z-image"].build())
    # per-sample caption lists; the negative prompt is shorter, so guidance's batch has sequences of two lengths
    # (a key mask over the unified stream)
    return pipe, dict(prompt_embeds=[_randn(g, TXT, 16)], negative_prompt_embeds=[_randn(g, 3, 16)],
                      height=32, width=32, num_inference_steps=2, guidance_scale=4.0, output_type="pt")


_add(PipelineCase("z-image", "ZImagePipeline", _zimage, denoiser="z-image", guidance=dict(guidance_scale=0.0),
                  notes="cond + uncond in one call with captions of two lengths (a key mask); t passed as "
                        "(1000 - t) / 1000"))


def _lumina(cls: str, denoiser: str, size: int):
    """Lumina2Pipeline / LuminaPipeline: precomputed caption embeddings and masks, no text encoder."""

    def build():
        g = torch.Generator().manual_seed(1)
        pipe = _pipe(cls, scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_kl(shift_factor=0.0),
                     text_encoder=None, tokenizer=None, transformer=CATALOGUE[denoiser].build())
        pipe.vae_scale_factor = 2  # fixed at 8 by the pipeline; the tiny VAE compresses 2x
        mask = torch.ones(1, TXT, dtype=torch.long)
        return pipe, dict(prompt_embeds=_randn(g, 1, TXT, 16), prompt_attention_mask=mask,
                          negative_prompt_embeds=_randn(g, 1, TXT, 16), negative_prompt_attention_mask=mask,
                          height=size, width=size, num_inference_steps=2, guidance_scale=4.0, output_type="pt")

    return build


_lumina2 = _lumina("Lumina2Pipeline", "lumina2", 32)


_add(PipelineCase("lumina2", "Lumina2Pipeline", _lumina2, denoiser="lumina2", guidance=dict(guidance_scale=1.0),
                  notes="cond and uncond as separate calls (one caption length per call); timestep 1 - t/1000"))


_add(PipelineCase("lumina-next", "LuminaPipeline", _lumina("LuminaPipeline", "lumina-next", 16), denoiser="lumina-next",
                  grid=(4, 4),
                  requires=("LuminaPipeline",), guidance=dict(guidance_scale=1.0),
                  notes="cond + uncond in one call; proportional attention (base_sequence_length) on"))


def _ernie_image():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("ErnieImagePipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_flux2(),
                 text_encoder=None, tokenizer=None, transformer=CATALOGUE["ernie-image"].build())
    # the negative caption is shorter: guidance's batch pads it, with a key mask
    return pipe, dict(prompt_embeds=[_randn(g, TXT, 16)], negative_prompt_embeds=[_randn(g, 3, 16)],
                      height=32, width=32, num_inference_steps=2, guidance_scale=4.0, output_type="pt", use_pe=False)


_add(PipelineCase("ernie-image", "ErnieImagePipeline", _ernie_image, denoiser="ernie-image", grid=(8, 8),
                  requires=("ErnieImagePipeline", "AutoencoderKLFlux2"), guidance=dict(guidance_scale=1.0),
                  notes="uncond + cond in one call, captions of two lengths (a key mask); sequence-first layers"))


class _CharTokenizer:
    """A stand-in for the Qwen2 tokenizer / Qwen3-VL processor (whose files come from the hub): a chat template that
    wraps the prompt, and one id per character. Only what Ideogram4Pipeline.encode_prompt and QwenImage21Pipeline's
    constructor call."""

    @property
    def tokenizer(self):
        return self

    def encode(self, text):
        return [ord(c) % 250 + 1 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False, return_dict=False):
        text = "".join(part["text"] for m in messages for part in m["content"] if part.get("type") == "text")
        text = f"<user>{text}<assistant>" if add_generation_prompt else f"<user>{text}"
        return [self.encode(text)] if tokenize else text

    def __call__(self, text, return_tensors="pt", add_special_tokens=False):
        return {"input_ids": torch.tensor([self.encode(text)])}


def _ideogram4():
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS as taps
    from transformers import Qwen3VLConfig, Qwen3VLModel

    hidden = 8
    config = dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, intermediate_size=32,
                  adaln_dim=16, llm_features_dim=len(taps) * hidden, rope_theta=10_000, mrope_section=(2, 1, 1))
    text = Qwen3VLConfig(text_config=dict(hidden_size=hidden, num_hidden_layers=max(taps) + 1, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=16, head_dim=8, vocab_size=256,
                                          max_position_embeddings=256, rope_theta=10_000.0),
                         vision_config=dict(hidden_size=8, depth=1, num_heads=2, intermediate_size=16,
                                            out_hidden_size=hidden, patch_size=14))
    pipe = _pipe("Ideogram4Pipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_flux2(),
                 text_encoder=_seeded(lambda: Qwen3VLModel(text)), tokenizer=_CharTokenizer(),
                 transformer=_seeded(lambda: _d("Ideogram4Transformer2DModel")(**config)),
                 unconditional_transformer=_seeded(lambda: _d("Ideogram4Transformer2DModel")(**config), seed=1))
    return pipe, dict(prompt="a red cube", height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
                      guidance_schedule=None, max_sequence_length=32, output_type="pt")


_add(PipelineCase("ideogram4", "Ideogram4Pipeline", _ideogram4, denoiser="ideogram4", grid=(8, 8),
                  requires=("Ideogram4Pipeline", "AutoencoderKLFlux2"), denoisers=("transformer",
                                                                                 "unconditional_transformer"),
                  notes="[left padding | text | image] tagged per token; a conditional and an unconditional "
                        "transformer, both patched; a character-level stand-in for the Qwen2 tokenizer"))


def _bria_fibo2():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("BriaFibo2Pipeline", transformer=CATALOGUE["bria-fibo2"].build(),
                 scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=_vae_flux2(), text_encoder=None,
                 processor=None)
    mask = torch.ones(1, TXT, dtype=torch.bool)
    # text bundles (B, 1 + injections, L, D): the Perceiver's, then the injection block's
    return pipe, dict(prompt_embeds=_randn(g, 1, 2, TXT, 24), prompt_embeds_mask=mask,
                      negative_prompt_embeds=_randn(g, 1, 2, TXT, 24), negative_prompt_embeds_mask=mask,
                      height=32, width=32, num_inference_steps=2, guidance_scale=4.0, output_type="pt")


_add(PipelineCase("bria-fibo2", "BriaFibo2Pipeline", _bria_fibo2, denoiser="bria-fibo2", grid=(8, 8),
                  requires=("BriaFibo2Pipeline", "AutoencoderKLFlux2"), guidance=dict(guidance_scale=1.0),
                  notes="cond and uncond as two calls; [gist | image] layers; timestep 0..1 (1 = noise)"))


def _qwen21():
    g = torch.Generator().manual_seed(1)
    vae = _seeded(lambda: _d("AutoencoderKLQwenImage21")(
        base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1] * 5, num_res_blocks=1, temperal_downsample=[False] * 4,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4))  # 16x, as the pipeline assumes
    pipe = _pipe("QwenImage21Pipeline", scheduler=_d("FlowMatchEulerDiscreteScheduler")(), vae=vae, text_encoder=None,
                 processor=_CharTokenizer(), transformer=CATALOGUE["qwen-image-2.1"].build())
    mask = torch.ones(1, TXT, dtype=torch.long)
    return pipe, dict(prompt_embeds=_randn(g, 1, TXT, 8), prompt_embeds_mask=mask,
                      negative_prompt_embeds=_randn(g, 1, TXT, 8), negative_prompt_embeds_mask=mask,
                      height=128, width=128, num_inference_steps=2, true_cfg_scale=4.0, output_type="pt")


_add(PipelineCase("qwen-image-2.1", "QwenImage21Pipeline", _qwen21, denoiser="qwen-image-2.1", grid=(8, 8),
                  requires=("QwenImage21Pipeline", "AutoencoderKLQwenImage21"), guidance=dict(true_cfg_scale=1.0),
                  todo=False,
                  notes="prefix KV cache on (extract at the first step, cached after); cond and uncond as two calls "
                        "with their own caches; the processor (used only by the constructor here) a stand-in"))


def _cogview4():
    g = torch.Generator().manual_seed(1)
    pipe = _pipe("CogView4Pipeline", tokenizer=None, text_encoder=None, vae=_vae_kl(),
                 transformer=CATALOGUE["cogview4"].build(), scheduler=_d("FlowMatchEulerDiscreteScheduler")())
    # GLM embeddings of 16 tokens (the pipeline pads prompts to a multiple of 16)
    return pipe, dict(prompt_embeds=_randn(g, 1, 16, 8), negative_prompt_embeds=_randn(g, 1, 16, 8), height=32,
                      width=32, num_inference_steps=2, guidance_scale=4.0, output_type="pt")


_add(PipelineCase("cogview4", "CogView4Pipeline", _cogview4, denoiser="cogview4", requires=("CogView4Pipeline",),
                  guidance=dict(guidance_scale=1.0), notes="cond and uncond as two calls; joint [text | image]"))
