"""The embedded image transformer: a small class-conditional Flux.1-style DiT trained on Fashion-MNIST.

A diffusers ``FluxTransformer2DModel`` (2 double-stream and 4 single-stream blocks, 128 wide, 4 heads, 3-axis
rotary positions, joint text + image attention) in pixel space: a 32 x 32 image is packed into 16 x 16 tokens of
2 x 2 pixels (256 image tokens), the "text" is a learned table of 4 tokens (and a pooled vector) per class, as the
UNet model's is. Trained with rectified flow (``x_t = (1 - t) x_0 + t noise``, the model predicts
``noise - x_0``) by ``scripts/train_fashion_dit.py``; sampled from t = 1 to 0 with its scheduler
(``schedulers.py``: by default SD3's flow-matching Euler, shift 3) and classifier-free
guidance. Timesteps go to the model on Flux's 0..1 scale. Weights: ``weights/fashion_dit.safetensors`` (fp16).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from .flow import TimestepMixin, check_call, load_parts, sample, transformer_class
from .model import CLASS_NAMES, NULL_CLASS, class_ids

__all__ = ["DIT_CONFIG", "DIT_WEIGHTS", "SIZE", "build_dit", "ClassText", "FashionDiT", "load_fashion_dit",
           "pack", "unpack", "image_ids"]

DIT_WEIGHTS = Path(__file__).with_name("weights") / "fashion_dit.safetensors"
SIZE = 32  # pixels (Fashion-MNIST's 28 x 28 padded with background)
PATCH = 2  # pixels per token side
TEXT_TOKENS, TEXT_DIM, POOLED_DIM = 4, 64, 64

DIT_CONFIG = dict(
    patch_size=1, in_channels=PATCH * PATCH, num_layers=2, num_single_layers=4, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM, guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)


def build_dit():
    return transformer_class("FluxTransformer2DModel", "0.30")(**DIT_CONFIG)


class ClassText(ModelMixin, ConfigMixin):
    """The "text encoder": class id -> (tokens (B, 4, 64), pooled (B, 64)), learned tables."""

    @register_to_config
    def __init__(self, num_classes: int = NULL_CLASS + 1):
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(num_classes, TEXT_TOKENS, TEXT_DIM) * 0.02)
        self.pooled = nn.Parameter(torch.randn(num_classes, POOLED_DIM) * 0.02)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[ids], self.pooled[ids]


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, 1, 32, 32) pixels -> (B, 256, 4) tokens of 2 x 2 pixels, row-major over the 16 x 16 grid."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens: torch.Tensor, size: int = SIZE) -> torch.Tensor:
    b, g = tokens.shape[0], size // PATCH
    x = tokens.reshape(b, g, g, 1, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, 1, size, size)


def image_ids(size: int = SIZE, device=None) -> torch.Tensor:
    """Flux's (N, 3) position ids of the image tokens: (0, row, column)."""
    g = size // PATCH
    rows, cols = torch.meshgrid(torch.arange(g, device=device), torch.arange(g, device=device), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()


class FashionDiT(TimestepMixin, DiffusionPipeline):
    """Prompt -> images with the embedded DiT: ``FashionDiT(...)(["a sneaker"], num_inference_steps=20)``."""

    class_names = CLASS_NAMES
    size = SIZE  # pixels a side

    grid = ("euler", 3.0)  # SD3's flow-matching Euler, shift 3 (schedulers.py)

    def __init__(self, transformer, text: ClassText, scheduler=None):
        from .schedulers import flow_scheduler

        super().__init__()
        self.register_modules(transformer=transformer, text=text,
                              scheduler=scheduler if scheduler is not None else flow_scheduler(*self.grid))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor, pooled: torch.Tensor):
        ids = image_ids(self.size, x.device)
        txt_ids = torch.zeros(tokens.shape[1], 3, device=x.device)
        out = self.transformer(hidden_states=pack(x), encoder_hidden_states=tokens, pooled_projections=pooled,
                               timestep=t, img_ids=ids, txt_ids=txt_ids, return_dict=False)[0]
        return unpack(out, self.size)

    def encode(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompts' ``(tokens, pooled)``, and those of no prompt (classifier-free guidance's unconditional)."""
        ids = torch.tensor(class_ids(prompts), device=device)
        return (*self.text(ids), *self.text(torch.full_like(ids, NULL_CLASS)))

    @torch.no_grad()
    def __call__(self, prompt: str | list[str], num_inference_steps: int = 20, guidance_scale: float = 2.0,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 output_type: str = "pil"):
        """Images ``(B, 1, size, size)`` in [0, 1] (``output_type="pt"``), PIL or numpy, in ``.images``."""
        from .pipeline import as_output

        check_call(num_inference_steps, output_type)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        param = next(self.transformer.parameters())
        device, dtype = param.device, param.dtype
        tokens, pooled, null_tokens, null_pooled = self.encode(prompts, device)
        if guidance_scale != 1.0:
            tokens, pooled = torch.cat([null_tokens, tokens]), torch.cat([null_pooled, pooled])
        tokens, pooled = tokens.to(dtype), pooled.to(dtype)
        shape = (len(prompts), 1, self.size, self.size)
        x = latents.to(device, dtype) if latents is not None else \
            torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)
        x = sample(lambda inp, t: self.velocity(inp, t, tokens, pooled), x, num_inference_steps, guidance_scale,
                   self)
        return as_output((x.float().clamp(-1, 1) + 1) / 2, output_type)


def load_fashion_dit(weights: str | Path | None = None) -> FashionDiT:
    """The embedded DiT with its shipped weights (or ``weights``, a file of ``scripts/train_fashion_dit.py``)."""
    path = Path(weights) if weights is not None else DIT_WEIGHTS
    return FashionDiT(*load_parts(path, build_dit(), ClassText(), "DiT", "train_fashion_dit.py"))
