"""The embedded mosaic testbed: a Flux.1-style DiT at real token counts, prompted by sentences.

A diffusers ``FluxTransformer2DModel`` of the same layout as ``dit.py`` (2 double-stream and 4 single-stream blocks,
128 wide, 4 heads, 3-axis rotary positions, joint text + image attention) on 64 x 64 pixel mosaics of 2 x 2
Fashion-MNIST cells of 32 px (each cell an item or empty), packed into 32 x 32 tokens of 2 x 2 pixels: **1,024 image
tokens** per call. The prompt is a sentence saying which item is in which cell ("a bag at the top left and a sneaker
at the bottom right"; empty cells are not said, see ``data.py``), turned into **32 text tokens** (and a pooled
vector) by a small text encoder trained with the model: a word-level vocabulary, an embedding with learned
positions and two transformer layers. Trained with rectified flow by ``scripts/train_fashion_mosaic.py`` (the loop
of ``scripts/flow_training.py``); sampled as Flux.1-dev at 1024 px samples (flow-matching Euler, shift e^1.15 ~
3.16: ``schedulers.py``) with classifier-free guidance (the unconditional prompt:
all padding). Weights: ``weights/fashion_mosaic.safetensors`` (fp16).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from . import dit
from .data import MOSAIC_WORDS, mosaic_prompts
from .flow import load_parts, transformer_class
from .schedulers import FLUX_SHIFT

__all__ = ["MOSAIC_CONFIG", "MOSAIC_WEIGHTS", "SIZE", "PATCH", "TEXT_TOKENS", "VOCAB", "build_mosaic",
           "SentenceEncoder", "FashionMosaic", "load_fashion_mosaic", "tokenize", "pack", "unpack", "image_ids"]

MOSAIC_WEIGHTS = Path(__file__).with_name("weights") / "fashion_mosaic.safetensors"
SIZE = 64  # pixels: 2 x 2 cells of 32
PATCH = 2  # pixels per token side: 32 x 32 = 1024 image tokens
TEXT_TOKENS, TEXT_DIM, POOLED_DIM = 32, 64, 64
PAD, UNK = 0, 1
VOCAB = ("<pad>", "<unk>", *MOSAIC_WORDS)

MOSAIC_CONFIG = dict(
    patch_size=1, in_channels=PATCH * PATCH, num_layers=2, num_single_layers=4, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM, guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)



def build_mosaic():
    return transformer_class("FluxTransformer2DModel", "0.30")(**MOSAIC_CONFIG)


def tokenize(prompts: list[str], length: int = TEXT_TOKENS) -> torch.Tensor:
    """Word-level token ids ``(B, length)``: lower case, commas apart, unknown words ``<unk>``, padded with
    ``<pad>`` (0) or truncated to ``length``; ``""`` is all padding (the unconditional prompt)."""
    index = {w: i for i, w in enumerate(VOCAB)}
    out = torch.full((len(prompts), length), PAD, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}")
        words = re.sub(r"\s*,\s*", " , ", prompt.lower()).split()[:length]
        out[row, :len(words)] = torch.tensor([index.get(w, UNK) for w in words], dtype=torch.long)
    return out


class SentenceEncoder(ModelMixin, ConfigMixin):
    """The text encoder: token ids ``(B, 32)`` -> (tokens ``(B, 32, 64)``, pooled ``(B, 64)``): an embedding with
    learned positions, pre-norm transformer layers (no mask: padding is attended to, as T5's padding in Flux), a
    final norm; pooled: the mean of the output tokens, projected."""

    @register_to_config
    def __init__(self, vocab_size: int = len(VOCAB), length: int = TEXT_TOKENS, dim: int = TEXT_DIM,
                 num_layers: int = 2, heads: int = 4, pooled_dim: int = POOLED_DIM):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.pool = nn.Linear(dim, pooled_dim)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for layer in self.blocks:
            x = layer(x)
        x = self.norm(x)
        return x, self.pool(x.mean(1))


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, 1, 64, 64) pixels -> (B, 1024, 4) tokens of 2 x 2 pixels, row-major over the 32 x 32 grid."""
    return dit.pack(x)


def unpack(tokens: torch.Tensor, size: int = SIZE) -> torch.Tensor:
    return dit.unpack(tokens, size)


def image_ids(size: int = SIZE, device=None) -> torch.Tensor:
    """Flux's (N, 3) position ids of the image tokens: (0, row, column)."""
    return dit.image_ids(size, device)


class FashionMosaic(dit.FashionDiT):
    """Sentence -> 64 x 64 mosaic: ``FashionMosaic(...)(["a bag at the top left"], num_inference_steps=20)``.

    Example:
        >>> pipe = load_fashion_mosaic()  # doctest: +SKIP
        >>> pipe("a sneaker at the top right and a dress at the bottom left", output_type="pt").images.shape
        torch.Size([1, 1, 64, 64])
    """

    size = SIZE
    grid = ("euler", FLUX_SHIFT)  # Flux.1-dev at 1024 px: flow-matching Euler, shift e^1.15 (schedulers.py)
    layout = "mosaic"  # what ``tokenmerge quality`` reads to score each 32 px cell against the sentence

    @staticmethod
    def prompts(count: int = 32, seed: int = 0) -> list[str]:
        """The quality prompts: ``count`` random sentences, the same for a ``seed`` everywhere."""
        return mosaic_prompts(count, seed)

    def encode(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = tokenize(prompts).to(device)
        return (*self.text(ids), *self.text(torch.full_like(ids, PAD)))

    def __call__(self, prompt: str | list[str], num_inference_steps: int = 20, guidance_scale: float = 3.0,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 output_type: str = "pil"):
        """Images ``(B, 1, 64, 64)`` in [0, 1] (``output_type="pt"``), PIL or numpy, in ``.images``."""
        return super().__call__(prompt, num_inference_steps, guidance_scale, generator, latents, output_type)


def load_fashion_mosaic(weights: str | Path | None = None) -> FashionMosaic:
    """The embedded mosaic DiT with its shipped weights (or ``weights``, from ``scripts/train_fashion_mosaic.py``).

    Example:
        >>> pipe = load_fashion_mosaic()  # doctest: +SKIP
    """
    path = Path(weights) if weights is not None else MOSAIC_WEIGHTS
    return FashionMosaic(*load_parts(path, build_mosaic(), SentenceEncoder(), "mosaic DiT",
                                     "train_fashion_mosaic.py"))
