"""Fashion-MNIST and what the larger embedded testbeds make of it: 2 x 2 mosaics described by a sentence, moving
clips. Torch only (no diffusers): the training scripts, the testbeds' pipelines and the quality metric share it.

The data is Debian's ``dataset-fashion-mnist`` package (``apt-get install dataset-fashion-mnist``), read from
``/usr/share/datasets/fashion-mnist``; it is needed to train, not to generate.

Mosaic sentences: each non-empty cell is said as ``"a <class> at the <top|bottom> <left|right>"``, in a random
order, joined by ", " and a final " and "; empty cells are not said (a mosaic with no item is ``"nothing"``), e.g.
``"a sneaker at the bottom right, a bag at the top left and a dress at the bottom left"``.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from .model import CLASS_NAMES, NULL_CLASS

__all__ = ["DATA", "EMPTY", "CELLS", "CELL_NAMES", "MOSAIC_WORDS", "load_split", "mosaic", "mosaic_sentence",
           "parse_mosaic", "random_layouts", "random_sentences", "mosaic_prompts", "cells_of", "bounce", "moving_clips"]

DATA = Path("/usr/share/datasets/fashion-mnist")
EMPTY = NULL_CLASS  # the label of an empty mosaic cell (and the classifier's "no item" class)
CELLS = 4  # 2 x 2, row-major: top left, top right, bottom left, bottom right
CELL_NAMES = ("top left", "top right", "bottom left", "bottom right")
# how each class is said in a sentence (one noun phrase, lower case)
_PHRASES = ("a t-shirt", "a trouser", "a pullover", "a dress", "a coat", "a sandal", "a shirt", "a sneaker", "a bag",
            "an ankle boot")
MOSAIC_WORDS = sorted({w for p in _PHRASES for w in p.split()} | {"at", "the", "top", "bottom", "left", "right",
                                                                   "and", ",", "nothing"})


def load_split(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST's ``split`` ("train" or "test"): images ``(N, 1, 32, 32)`` in [-1, 1] (28 x 28 padded with
    background), labels ``(N,)``. ``FileNotFoundError`` naming the Debian package when the files are missing."""
    import numpy as np

    prefix = "train" if split == "train" else "t10k"
    images_file, labels_file = DATA / f"{prefix}-images-idx3-ubyte.gz", DATA / f"{prefix}-labels-idx1-ubyte.gz"
    if not images_file.exists():
        raise FileNotFoundError(f"{images_file} is missing: install it with `apt-get install dataset-fashion-mnist`")
    with gzip.open(images_file) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(labels_file) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = torch.from_numpy(images.copy()).float() / 127.5 - 1.0
    return F.pad(x, (2, 2, 2, 2), value=-1.0), torch.from_numpy(labels.astype("int64"))


def mosaic(cells: torch.Tensor) -> torch.Tensor:
    """``(n, 4, 1, 32, 32)`` cell images (row-major) -> ``(n, 1, 64, 64)`` mosaics."""
    n, _, c, h, w = cells.shape
    return cells.reshape(n, 2, 2, c, h, w).permute(0, 3, 1, 4, 2, 5).reshape(n, c, 2 * h, 2 * w)


def cells_of(images: torch.Tensor) -> torch.Tensor:
    """``(n, C, 2h, 2w)`` mosaics -> ``(n, 4, C, h, w)`` cells, row-major (the inverse of ``mosaic``)."""
    n, c, hh, ww = images.shape
    return images.reshape(n, c, 2, hh // 2, 2, ww // 2).permute(0, 2, 4, 1, 3, 5).reshape(n, 4, c, hh // 2, ww // 2)


def mosaic_sentence(layout, order=None) -> str:
    """The sentence of a layout (4 labels, ``EMPTY`` for an empty cell), cells said in ``order`` (default: row
    order)."""
    said = [i for i in (order if order is not None else range(CELLS)) if int(layout[i]) != EMPTY]
    parts = [f"{_PHRASES[int(layout[i])]} at the {CELL_NAMES[i]}" for i in said]
    if not parts:
        return "nothing"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


_PART = re.compile(r"^(?:a|an)\s+(.+?)\s+at\s+the\s+(top|bottom)\s+(left|right)$")


def parse_mosaic(sentence: str) -> list[int]:
    """The 4 cell labels a sentence says (``EMPTY`` for cells it does not name); ``ValueError`` saying what is wrong
    for a sentence that is not of ``mosaic_sentence``'s form (a class name from ``model.class_ids`` is accepted)."""
    from .model import class_ids

    if not isinstance(sentence, str):
        raise TypeError(f"prompt must be a string, got {type(sentence).__name__}")
    text = " ".join(sentence.lower().replace(",", " , ").split())
    layout = [EMPTY] * CELLS
    if text in ("", "nothing"):
        return layout
    for part in re.split(r"\s*,\s*|\s+and\s+", text):
        match = _PART.match(part.strip())
        if match is None:
            raise ValueError(f"{sentence[:200]!r}: {part.strip()[:80]!r} is not 'a <class> at the <top|bottom> "
                             "<left|right>' (the mosaic model's sentences: 'a bag at the top left and a sneaker at "
                             "the bottom right')")
        label = class_ids([match.group(1)])[0]
        cell = CELL_NAMES.index(f"{match.group(2)} {match.group(3)}")
        if layout[cell] != EMPTY:
            raise ValueError(f"{sentence[:200]!r} names the {CELL_NAMES[cell]} cell twice")
        layout[cell] = label
    return layout


def random_layouts(n: int, empty: float = 0.3, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(n, 4)`` labels: each cell empty with probability ``empty``, else a uniformly drawn class."""
    labels = torch.randint(0, len(CLASS_NAMES), (n, CELLS), generator=generator)
    return torch.where(torch.rand(n, CELLS, generator=generator) < empty, torch.full_like(labels, EMPTY), labels)


def random_sentences(layouts: torch.Tensor, generator: torch.Generator | None = None) -> list[str]:
    """A sentence per layout, its cells said in a random order."""
    return [mosaic_sentence(row.tolist(), torch.randperm(CELLS, generator=generator).tolist()) for row in layouts]


def mosaic_prompts(count: int = 32, seed: int = 0) -> list[str]:
    """The mosaic model's quality prompts: ``count`` random sentences (at most one empty cell each, so most cells
    hold an item), the same for a ``seed`` on every machine."""
    g = torch.Generator().manual_seed(seed)
    layouts = random_layouts(count, empty=0.0, generator=g)
    blank = torch.randint(0, CELLS + 1, (count,), generator=g)  # CELLS: no empty cell
    for row, cell in zip(layouts, blank.tolist()):
        if cell < CELLS:
            row[cell] = EMPTY
    return random_sentences(layouts, g)


def bounce(start: torch.Tensor, speed: torch.Tensor, span: int, frames: int) -> torch.Tensor:
    """Positions ``(n, frames)`` of a point moving from ``start`` at ``speed`` px/frame in [0, span], reflected."""
    p = start[:, None] + speed[:, None] * torch.arange(frames)
    p = torch.remainder(p, 2 * span)
    return torch.where(p > span, 2 * span - p, p)


def moving_clips(items: torch.Tensor, frames: int, size: int = 32, item: int = 24,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """``(n, 1, 32, 32)`` items in [-1, 1] -> ``(n, 1, frames, size, size)`` clips: each item shrunk to
    ``item`` px, moving in a straight line at 1-2 px a frame in a random direction, bouncing off the edges (the
    recipe of ``scripts/train_fashion_video.py``, any length)."""
    n, span = items.shape[0], size - item
    small = F.interpolate(items[:, :, 2:-2, 2:-2], size=(item, item), mode="area")  # the 28x28 item's content
    angle = torch.rand(n, generator=generator) * 2 * torch.pi
    speed = 1 + torch.rand(n, generator=generator)
    ys = bounce(torch.rand(n, generator=generator) * span, speed * torch.sin(angle), span, frames).round().long()
    xs = bounce(torch.rand(n, generator=generator) * span, speed * torch.cos(angle), span, frames).round().long()
    out = torch.full((n, 1, frames, size, size), -1.0)
    for i in range(n):
        for f in range(frames):
            y, x = int(ys[i, f]), int(xs[i, f])
            out[i, :, f, y: y + item, x: x + item] = small[i]
    return out
