"""The embedded model: a small class-conditional pixel-space diffusion model trained on Fashion-MNIST.

It exists so that `tokenmerge demo` and `tokenmerge quality` show real images on a machine with no model hub.
The denoiser is a diffusers `UNet2DConditionModel` whose highest level (32 x 32 = 1024 tokens) has transformer
blocks, so token merging has something to work on; the "text encoder" is a learned table of a few tokens per
class, chosen from the prompt by the class name it contains ("a sneaker", "Ankle boot", ...).

Trained by `scripts/train_fashion.py`; weights ship in `weights/fashion.safetensors` (fp16).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CLASS_NAMES", "UNET_CONFIG", "build_unet", "class_ids", "WEIGHTS"]

WEIGHTS = Path(__file__).with_name("weights") / "fashion.safetensors"

# Fashion-MNIST's labels, in label order; index 10 is the "no class" slot used for classifier-free guidance.
CLASS_NAMES = ("T-shirt", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_SYNONYMS = {"t-shirt": 0, "tshirt": 0, "t shirt": 0, "top": 0, "trousers": 1, "trouser": 1, "pants": 1,
             "pullover": 2, "sweater": 2, "dress": 3, "coat": 4, "jacket": 4, "sandal": 5, "shirt": 6,
             "sneaker": 7, "shoe": 7, "bag": 8, "handbag": 8, "ankle boot": 9, "boot": 9}
NULL_CLASS = len(CLASS_NAMES)
CONTEXT_TOKENS = 4
CONTEXT_DIM = 64

UNET_CONFIG = dict(
    sample_size=32,
    in_channels=1,
    out_channels=1,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64, 128),
    layers_per_block=1,
    # diffusers reads this legacy name as the number of heads: one head of 32 channels per level.
    attention_head_dim=(1, 2, 4),
    cross_attention_dim=CONTEXT_DIM,
    norm_num_groups=16,
)


def build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**UNET_CONFIG)


def class_ids(prompts: list[str]) -> list[int]:
    """Map each prompt to the Fashion-MNIST class it names; "" means no class (unconditional)."""
    ids = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}")
        text = prompt.lower()
        if not text.strip():
            ids.append(NULL_CLASS)
            continue
        # The longest name found wins, so "ankle boot" beats "boot" and "t-shirt" beats "shirt".
        found = [(len(name), label) for name, label in _SYNONYMS.items()
                 if re.search(rf"\b{re.escape(name)}(e?s)?\b", text)]
        if not found:
            raise ValueError(
                f"prompt {prompt!r} names no class the embedded Fashion-MNIST model knows; "
                f"use one of: {', '.join(CLASS_NAMES)} (or '' for no class)"
            )
        ids.append(max(found)[1])
    return ids
