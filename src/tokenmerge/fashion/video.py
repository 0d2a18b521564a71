"""The embedded video transformer: a small class-conditional Wan-style video DiT trained on moving Fashion-MNIST.

A diffusers ``WanTransformer3DModel`` (4 blocks, 128 wide, 4 heads, 3-D rotary positions, cross-attention to the
"text") in pixel space: a clip of 8 frames of 32 x 32 pixels, patched (1, 4, 4) into 8 x 8 x 8 = 512 tokens. The
clips are synthesised by ``scripts/train_fashion_video.py``: one Fashion-MNIST item (shrunk to 24 x 24) moving in a
straight line across the frame, bouncing off its edges. The "text" is a learned table of 4 tokens per class.
Rectified flow as the image DiT (``fashion/dit.py``); timesteps go to the model on Wan's 0..1000 scale.
Weights: ``weights/fashion_video.safetensors`` (fp16).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from .flow import TimestepMixin, check_call, load_parts, sample, transformer_class
from .model import CLASS_NAMES, NULL_CLASS, class_ids

__all__ = ["VIDEO_CONFIG", "VIDEO_WEIGHTS", "FRAMES", "SIZE", "build_video", "ClassTokens", "FashionVideo",
           "load_fashion_video", "strip"]

VIDEO_WEIGHTS = Path(__file__).with_name("weights") / "fashion_video.safetensors"
FRAMES, SIZE = 8, 32
TEXT_TOKENS, TEXT_DIM = 4, 64

VIDEO_CONFIG = dict(
    patch_size=(1, 4, 4), num_attention_heads=4, attention_head_dim=32, in_channels=1, out_channels=1,
    text_dim=TEXT_DIM, freq_dim=64, ffn_dim=384, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)


def build_video():
    return transformer_class("WanTransformer3DModel", "0.33")(**VIDEO_CONFIG)


class ClassTokens(ModelMixin, ConfigMixin):
    """The "text encoder": class id -> (B, 4, 64) tokens, a learned table."""

    @register_to_config
    def __init__(self, num_classes: int = NULL_CLASS + 1):
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(num_classes, TEXT_TOKENS, TEXT_DIM) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens[ids]


def strip(frames: torch.Tensor) -> torch.Tensor:
    """(B, F, 1, H, W) -> (B, 1, H, F * W): the frames side by side, one image per clip."""
    b, f, c, h, w = frames.shape
    return frames.permute(0, 2, 3, 1, 4).reshape(b, c, h, f * w)


class FashionVideo(TimestepMixin, DiffusionPipeline):
    """Prompt -> clips: ``.frames`` ``(B, 8, 1, 32, 32)`` in [0, 1]; ``.images``: each clip as a frame strip (PIL,
    numpy or tensor by ``output_type``), which is what ``tokenmerge quality`` compares."""

    class_names = CLASS_NAMES
    frames = FRAMES  # what ``tokenmerge quality`` reads to score clips per frame

    grid = ("unipc", 3.0)  # Wan 2.1 480p's UniPC on flow sigmas, shift 3 (schedulers.py)

    def __init__(self, transformer, text: ClassTokens, scheduler=None):
        from .schedulers import flow_scheduler

        super().__init__()
        self.register_modules(transformer=transformer, text=text,
                              scheduler=scheduler if scheduler is not None else flow_scheduler(*self.grid))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``x`` (B, 1, F, H, W), ``t`` (B,) in 0..1 (1 = noise)."""
        return self.transformer(hidden_states=x, timestep=t * 1000, encoder_hidden_states=tokens,
                                return_dict=False)[0]

    @torch.no_grad()
    def __call__(self, prompt: str | list[str], num_inference_steps: int = 20, guidance_scale: float = 2.0,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 output_type: str = "pil"):
        from .pipeline import as_output

        check_call(num_inference_steps, output_type)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        param = next(self.transformer.parameters())
        device, dtype = param.device, param.dtype
        ids = torch.tensor(class_ids(prompts), device=device)
        tokens = self.text(ids)
        if guidance_scale != 1.0:
            tokens = torch.cat([self.text(torch.full_like(ids, NULL_CLASS)), tokens])
        tokens = tokens.to(dtype)
        shape = (len(prompts), 1, self.frames, SIZE, SIZE)
        x = latents.to(device, dtype) if latents is not None else \
            torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)
        x = sample(lambda inp, t: self.velocity(inp, t, tokens), x, num_inference_steps, guidance_scale, self)
        frames = ((x.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 1, 3, 4)  # (B, F, 1, H, W)
        out = as_output(strip(frames), output_type)
        out.frames = frames
        return out


def load_fashion_video(weights: str | Path | None = None) -> FashionVideo:
    """The embedded video model with its shipped weights (or ``weights``, from ``scripts/train_fashion_video.py``)."""
    path = Path(weights) if weights is not None else VIDEO_WEIGHTS
    return FashionVideo(*load_parts(path, build_video(), ClassTokens(), "video model", "train_fashion_video.py"))
