"""What an adapter tells the patcher: which denoisers, which transformer blocks, at which resolution level."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

__all__ = ["ArgSpec", "BASIC_TARGETS", "BlockSite", "DenoiserSite", "is_transformer_block", "transformer_blocks_in"]


@dataclass(frozen=True)
class ArgSpec:
    """Where an argument of a ``forward`` is found: by keyword ``name``, else at position ``index``."""

    name: str
    index: int | None

    @classmethod
    def of(cls, module: nn.Module, candidates: tuple[str, ...], default_index: int | None = None) -> "ArgSpec | None":
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for name in candidates:
            if name in positional:
                return cls(name, positional.index(name))
            if any(p.name == name for p in params):
                return cls(name, None)
        if default_index is not None and len(positional) > default_index:
            return cls(positional[default_index], default_index)
        return None

    def read(self, args: tuple, kwargs: dict):
        if self.name in kwargs:
            return kwargs[self.name]
        if self.index is not None and self.index < len(args):
            return args[self.index]
        return None


# What a block's sub-modules are, as (attribute, kind). Kinds: "self" (self-attention over the image tokens),
# "cross" (cross-attention: its queries are image tokens), "mlp" (feed-forward), "joint" (attention over image
# and text tokens together, as in SD3 and Flux: the image tokens are merged, the text tokens pass untouched).
BASIC_TARGETS = (("attn1", "self"), ("attn2", "cross"), ("ff", "mlp"))


@dataclass
class BlockSite:
    """A transformer block to patch. ``level`` counts the 2x downsamplings above its resolution (0 = full)."""

    path: str
    module: nn.Module
    level: int
    targets: tuple[tuple[str, str], ...] = BASIC_TARGETS

    @property
    def downsample(self) -> int:
        return 2**self.level


@dataclass
class DenoiserSite:
    """A denoiser (UNet, ControlNet, ...) whose input gives the latent size its blocks' grids derive from."""

    path: str
    module: nn.Module
    family: str
    sample: ArgSpec
    timestep: ArgSpec | None
    blocks: list[BlockSite] = field(default_factory=list)
    patch: int = 1  # latent pixels per token side at level 0 (a DiT's patch size)
    grid_from_ids: bool = False  # ``sample`` is Flux's ``img_ids`` (token, 3) rather than a latent
    timestep_scale: float = 1.0  # the denoiser's timestep times this is on the 0..num_train_timesteps scale
    shared_plan: bool = False  # one merge pattern for the whole batch (tokens carry rotary positions)


def is_transformer_block(module: nn.Module) -> bool:
    """Structure shared by diffusers' ``BasicTransformerBlock`` and LDM's: ``attn1`` + ``ff`` + ``norm1``."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in ("attn1", "ff", "norm1"))


def transformer_blocks_in(container: nn.Module, prefix: str, level: int) -> list[BlockSite]:
    """The spatial transformer blocks below ``container``: those held in a ``transformer_blocks`` list.

    Temporal blocks of video models live elsewhere (``temp_attentions``, ``time_stack``, ``motion_modules``)
    and are not picked up: merging across their frame axis would not be spatial.
    """
    found = []
    for name, module in container.named_modules():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "transformer_blocks" and is_transformer_block(module):
            if any(p in ("time_stack", "temp_attentions", "motion_modules", "temporal_transformer") for p in parts):
                continue
            found.append(BlockSite(f"{prefix}.{name}" if prefix else name, module, level))
    return found
