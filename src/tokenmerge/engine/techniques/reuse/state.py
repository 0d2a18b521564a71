"""Token reuse's state (``reuse.TokenReuse``): what a branch keeps across steps, the generation's round-robin, one
call's recomputed tokens and one block's call in flight."""

from __future__ import annotations

import dataclasses

import torch

from ....merge.recompute import in_dtype

__all__ = ["TEXT", "Walk", "ReuseBranch", "Recompute", "BlockCall", "spans_of"]

TEXT = "text"  # extrapolate: (TEXT, length) names a text stream's spans, (TEXT, block) its slopes


@dataclasses.dataclass(slots=True)
class Walk:
    """The generation's round-robin: its first partial step's progress, each partial step's share, whether the
    last partial step ran every block (one a cache cut short leaves its tokens to the next)."""

    first: float | None = None
    fractions: list = dataclasses.field(default_factory=list)
    counted: int = -1
    ran: bool = True

    def reset(self) -> None:
        self.first, self.counted, self.ran = None, -1, True
        self.fractions.clear()


@dataclasses.dataclass(slots=True)
class ReuseBranch:
    """One branch's kept tensors: per block its residuals (image, text), per attention its keys and values."""

    residual: dict = dataclasses.field(default_factory=dict)  # block -> (B, N, C)
    text: dict = dataclasses.field(default_factory=dict)  # block -> (B, T, C)
    kv: dict = dataclasses.field(default_factory=dict)  # (block, target) -> [[keys, values] per SDPA call]
    slope: dict = dataclasses.field(default_factory=dict)  # extrapolate: block -> (B, N, C) change per progress
    when: dict = dataclasses.field(default_factory=dict)  # extrapolate: level -> (N,) progress last computed at

    def reset(self) -> None:
        for kept in (self.residual, self.text, self.kv, self.slope, self.when):
            kept.clear()


@dataclasses.dataclass(slots=True)
class Recompute:
    """One call: its branch's kept tensors, per level ``(tokens, recomputed, grid)``, text rows, shared rotary rows,
    each block's call in flight."""

    kept: ReuseBranch
    partial: bool
    segments: int
    device: object
    levels: dict = dataclasses.field(default_factory=dict)
    text: dict = dataclasses.field(default_factory=dict)
    taken: list = dataclasses.field(default_factory=list)
    spans: dict = dataclasses.field(default_factory=dict)  # extrapolate: level -> since's spans (and made from them)
    walk: Walk | None = None
    moves: list = dataclasses.field(default_factory=list)  # extrapolate: since's moves, settled once every block ran
    ran: int = 0  # the blocks whose forward ran
    blocks: dict = dataclasses.field(default_factory=dict)  # block index -> its BlockCall in flight

    def close(self) -> None:
        """Leave the SDPA modes of blocks still in flight (a call cut short)."""
        for entry in self.blocks.values():
            entry.close()


@dataclasses.dataclass(slots=True)
class BlockCall:
    """One block's call in flight: its inputs, its level's recomputed tokens, its targets' modes and layouts."""

    x: torch.Tensor
    partial: bool
    image: int
    index: torch.Tensor | None
    grid: tuple
    text: torch.Tensor | None = None
    ran: bool = False
    text_index: torch.Tensor | None = None
    picked: torch.Tensor | None = None
    modes: dict = dataclasses.field(default_factory=dict)
    rows: dict = dataclasses.field(default_factory=dict)

    def close(self) -> None:
        while self.modes:
            self.modes.popitem()[1].close()


def spans_of(call: Recompute, entry: BlockCall, level: int) -> tuple:
    """``extrapolate=``: the spans (``merge.recompute.since``) of the block's image tokens and text stream, each
    ``None`` where there are none or they do not fit how the block runs (a block of a partial call run whole)."""
    image = in_dtype(call.spans, level, entry.x.dtype)
    text = in_dtype(call.spans, (TEXT, entry.text.shape[1]), entry.x.dtype) if entry.text is not None else None
    return (image if image is not None and (image[1] is None) != entry.partial else None,
            text if text is not None and (text[1] is None) == (entry.text_index is None) else None)
