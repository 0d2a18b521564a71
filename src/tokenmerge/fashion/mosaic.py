"""The embedded mosaic testbed: a Flux.1-style DiT at real token counts, prompted by sentences.

A diffusers ``FluxTransformer2DModel`` of the same layout as ``dit.py`` (2 double-stream and 4 single-stream blocks,
128 wide, 4 heads, 3-axis rotary positions, joint text + image attention) on 64 x 64 pixel mosaics of 2 x 2
Fashion-MNIST cells of 32 px (each cell an item or empty), packed into 32 x 32 tokens of 2 x 2 pixels: **1,024 image
tokens** per call. The prompt is a sentence saying which item is in which cell ("a bag at the top left and a sneaker
at the bottom right"; empty cells are not said, see ``data.py``), turned into **32 text tokens** (and a pooled
vector) by a small text encoder trained with the model: a word-level vocabulary, an embedding with learned
positions and two transformer layers. Trained with rectified flow by ``scripts/train_fashion_mosaic.py`` (the loop
of ``scripts/flow_training.py``); sampled with Euler steps and classifier-free guidance (the unconditional prompt:
all padding). Weights: ``weights/fashion_mosaic.safetensors`` (fp16).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from .data import MOSAIC_WORDS, mosaic_prompts
from .flow import TimestepMixin, check_call, euler, load_parts, transformer_class
from .model import CLASS_NAMES

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


class FashionMosaic(TimestepMixin, DiffusionPipeline):
    """Sentence -> 64 x 64 mosaic: ``FashionMosaic(...)(["a bag at the top left"], num_inference_steps=20)``.

    Example:
        >>> pipe = load_fashion_mosaic()  # doctest: +SKIP
        >>> pipe("a sneaker at the top right and a dress at the bottom left", output_type="pt").images.shape
        torch.Size([1, 1, 64, 64])
    """

    class_names = CLASS_NAMES
    layout = "mosaic"  # what ``tokenmerge quality`` reads to score each 32 px cell against the sentence

    def __init__(self, transformer, text: SentenceEncoder):
        super().__init__()
        self.register_modules(transformer=transformer, text=text)

    @staticmethod
    def prompts(count: int = 32, seed: int = 0) -> list[str]:
        """The quality prompts: ``count`` random sentences, the same for a ``seed`` everywhere."""
        return mosaic_prompts(count, seed)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor, pooled: torch.Tensor):
        ids = image_ids(SIZE, x.device)
        txt_ids = torch.zeros(tokens.shape[1], 3, device=x.device)
        out = self.transformer(hidden_states=pack(x), encoder_hidden_states=tokens, pooled_projections=pooled,
                               timestep=t, img_ids=ids, txt_ids=txt_ids, return_dict=False)[0]
        return unpack(out)

    @torch.no_grad()
    def __call__(self, prompt: str | list[str], num_inference_steps: int = 20, guidance_scale: float = 3.0,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 output_type: str = "pil"):
        """Images ``(B, 1, 64, 64)`` in [0, 1] (``output_type="pt"``), PIL or numpy, in ``.images``."""
        from .pipeline import as_output

        check_call(num_inference_steps, output_type)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        param = next(self.transformer.parameters())
        device, dtype = param.device, param.dtype
        ids = tokenize(prompts).to(device)
        tokens, pooled = self.text(ids)
        if guidance_scale != 1.0:
            null_tokens, null_pooled = self.text(torch.full_like(ids, PAD))
            tokens, pooled = torch.cat([null_tokens, tokens]), torch.cat([null_pooled, pooled])
        tokens, pooled = tokens.to(dtype), pooled.to(dtype)
        shape = (len(prompts), 1, SIZE, SIZE)
        x = latents.to(device, dtype) if latents is not None else \
            torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)
        x = euler(lambda inp, t: self.velocity(inp, t, tokens, pooled), x, num_inference_steps, guidance_scale, self)
        return as_output((x.float().clamp(-1, 1) + 1) / 2, output_type)


def load_fashion_mosaic(weights: str | Path | None = None) -> FashionMosaic:
    """The embedded mosaic DiT with its shipped weights (or ``weights``, from ``scripts/train_fashion_mosaic.py``).

    Example:
        >>> pipe = load_fashion_mosaic()  # doctest: +SKIP
    """
    path = Path(weights) if weights is not None else MOSAIC_WEIGHTS
    return FashionMosaic(*load_parts(path, build_mosaic(), SentenceEncoder(), "mosaic DiT",
                                     "train_fashion_mosaic.py"))
