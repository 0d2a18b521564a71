"""Merging under diffusers' context parallelism (``model.enable_parallelism(config=ContextParallelConfig(...))``).

diffusers splits the token sequence of a model with a context-parallel plan (``_cp_plan``) over ``world`` ranks,
at one place: the denoiser's input (Flux.1, Flux.2, LTX-Video, LTX-2) or the first block's (Wan, ChronoEdit,
Qwen-Image). Each rank gets one of ``world`` equal, contiguous slices of the row-major token sequence, and the
rotary tables are split the same way (the plan splits their outputs), so a block sees its rank's slice and the
slice's rotary rows. Ulysses attention turns the sequence split into a head split with an all-to-all: every rank
must pass the same number of tokens.

So each rank merges its own slice as the grid it is: whole frames, or whole rows, of the call's grid, or whole rows
that run over a frame's end as one tall grid (``shard_grid``), with the same merged count on every rank (the slices
have one shape, and a plan's merged count depends on its grid and ratio only). The random destination choice is
the single-process one restricted to the slice (``Shard.shift``). A call whose slice holds no whole row, or whose
split sequence holds other tokens than the image's (reference images, conditioning frames), runs unmerged with the
patch's one warning; every rank decides alike, from the same grid. A combination that cannot be right (ToDo under
ring attention, a split that falls inside the patched blocks) is refused at ``apply_patch`` when parallelism is
already on, and runs unmerged with the warning when it is enabled after the patch.

Where the engine reads this (the call sites): ``Patch.install`` (``check_install``), ``CallHook.pre`` (``shard_of``:
the call's grid becomes its rank's), ``Planner.block_call`` and ``ToMeWholeBlock.block_pre`` (the block whose input
diffusers splits: ``Split.local`` / ``Split.hand_over``), ``Planner._made`` (``Shard.shift``: the random draws) and
ToDo's key pooling (``PoolInAttention``: under Ulysses its attention call gets every rank's keys, ``Split.ulysses``
segments of them). docs/design-parallel.md says what the engine must do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..families.spec import Arg
from ..merge.match import _GOLDEN, _MASK32
from ..merge.windows import num_windows
from .call import PARALLEL_ATTR, NoGrid
from .discover import bind
from .registries import REGISTRY_ATTR

__all__ = ["PARALLEL_ATTR", "Shard", "Split", "check_block_input", "check_install", "shard_grid", "shard_of",
           "split_of"]

SPLIT_HOOK = "cp_input---"  # diffusers' name prefix of a ContextParallelSplitHook (hooks/context_parallel.py)
_HIDDEN = "hidden_states"  # the argument diffusers' plans split the image stream by


@dataclass(frozen=True)
class Split:
    """How diffusers' context parallelism splits one denoiser's token sequence.

    Args:
        world: ranks the sequence is split over (``ring_degree * ulysses_degree``).
        rank: this rank's slice.
        ulysses: the Ulysses degree (segments of the keys an attention call gets); ring: the ring degree.
        block: index in the patch's blocks of the block whose input diffusers splits (its torch pre-hook sees
            the whole sequence, its sub-modules the slice); ``None``: split before every patched block.
        where: the split module's path ("" is the denoiser), for messages.
        refused: why merging cannot be right under this split (``None``: it can).
        hidden: the denoiser's ``hidden_states`` argument, bound (read when the denoiser's input is split).
    """

    world: int
    rank: int
    ulysses: int
    ring: int
    block: int | None
    where: str
    refused: str | None = None
    hidden: object = field(default=None, compare=False, repr=False)

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of ``x``, as diffusers cuts it (``tensor_split``: ``chunk`` for equal slices)."""
        return x.tensor_split(self.world, dim)[self.rank]

    def hand_over(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A tensor whose slice at every rank is ``x``: what the split block's pre-hook passes on when it has
        merged its rank's slice already (diffusers' split, inside the block's forward, then gives ``x`` back)."""
        reps = [1] * x.dim()
        reps[dim] = self.world
        return x.repeat(*reps)


@dataclass(frozen=True)
class Shard:
    """One call's slice: ``grid`` (the rank's sub-grid) and ``shift``, the key offset that makes the random
    destination choice of the slice's windows the single-process one of the same windows."""

    split: Split
    grid: tuple[int, ...]
    shift: int


def _config(module: nn.Module):
    """The model's ContextParallelConfig (diffusers' ``ParallelConfig.context_parallel_config``), or ``None``."""
    config = getattr(module, PARALLEL_ATTR, None)
    return getattr(config, "context_parallel_config", None) if config is not None else None


def split_of(patch) -> Split | None:
    """The split of ``patch``'s denoiser under context parallelism, or ``None`` (no parallelism, or tensor
    parallelism only). Read from the model's parallel config and the split hooks diffusers installed; kept on
    the patch until the config changes (``enable_parallelism`` records a new one)."""
    config = _config(patch.site.module)
    if config is None:
        return None
    cached = patch.parallel
    if cached is not None and cached[0] is config:
        return cached[1]
    split = _read(patch, config)
    patch.parallel = (config, split)
    return split


def _read(patch, config) -> Split:
    mesh = getattr(config, "_flattened_mesh", None)
    if mesh is None:  # not set up (enable_parallelism sets it up): refused, never an error in a call
        return Split(1, 0, 1, 1, None, "", "the model's context-parallel config has no device mesh (it was not set "
                     "up by model.enable_parallelism(config=...))")
    world = mesh.size()
    rank = torch.distributed.get_rank(mesh.get_group())
    ulysses, ring = int(config.ulysses_degree), int(config.ring_degree)
    denoiser = patch.site.module
    where, block, refused = _split_point(patch, denoiser)
    inside = patch.technique.inside
    if refused is None and ring > 1 and inside is not None:
        refused = (f"{inside} inside PyTorch's scaled_dot_product_attention, which ring attention does not call "
                   f"(ring_degree={ring} needs a backend that returns the log-sum-exp); use ToMe (apply_patch) or "
                   "Ulysses attention (ulysses_degree) alone")
    hidden = bind(Arg(_HIDDEN, fallback_index=0), denoiser) if block is None else None
    return Split(world, rank, ulysses, ring, block, where, refused, hidden)


def _split_point(patch, denoiser: nn.Module) -> tuple[str, int | None, str | None]:
    """``(path, block, refused)``: where diffusers splits the image stream (``hidden_states``), the index of
    that block in the patch (``None``: before every patched block), and why that cannot be merged."""
    order = {id(m): i for i, (_, m) in enumerate(denoiser.named_modules())}
    found = None
    for path, module in denoiser.named_modules():
        hooks = getattr(module.__dict__.get(REGISTRY_ATTR), "hooks", None)
        if not isinstance(hooks, dict):
            continue
        for name, hook in hooks.items():
            plan = getattr(hook, "metadata", None)
            if name.startswith(SPLIT_HOOK) and isinstance(plan, dict) and _HIDDEN in plan \
                    and not getattr(plan[_HIDDEN], "split_output", True):
                found = (path, module)
                break
        if found is not None:
            break
    if found is None:
        return "", None, ("diffusers' context-parallel plan of this model splits no 'hidden_states', so where its "
                          "token sequence is split is unknown")
    path, module = found
    blocks = [site.module for site in patch.blocks]
    if module is denoiser:
        return path, None, None
    at = next((i for i, b in enumerate(blocks) if b is module), None)
    before = [site.path for site in patch.blocks if order.get(id(site.module), -1) < order[id(module)]]
    if at is not None and not before:
        return path, at, None
    if at is None and not before:  # a module before every patched block (an unpatched first block)
        inside = [site.path for site in patch.blocks if any(m is module for m in site.module.modules())]
        if not inside:
            return path, None, None
    return path, at, (f"diffusers splits the token sequence at {path!r}, after or inside the patched block(s) "
                      f"{', '.join(before[:3]) or path}, which would see the whole sequence and the others a slice "
                      "of it; patch only the blocks after the split (blocks=...)")


def check_install(patch) -> None:
    """At ``apply_patch``: refuse, with the reason, a patch that cannot be right under the model's context
    parallelism (when it is enabled before the patch)."""
    split = split_of(patch)
    if split is not None and split.refused is not None:
        raise ValueError(f"tokenmerge: {split.refused} (context parallelism is enabled on "
                         f"{type(patch.site.module).__name__})")


def shard_grid(grid: tuple[int, ...], world: int) -> tuple[int, ...]:
    """The grid each of ``world`` equal contiguous slices of ``grid``'s row-major tokens is merged as.

    A sub-grid where there is one: ``c`` whole rows of one axis (with all of the axes inside it), at the outermost
    axis where ``c`` divides that axis (8 frames on 2 ranks: 4 frames each). Else, where a slice holds whole rows
    of an axis but runs over the end of the axis outside it (Wan's 21 latent frames on 2 ranks: 10.5 frames each),
    those rows as one tall grid: ``(1, 315, 52)`` for 315 rows of 52 tokens (the windows at a frame edge inside the
    slice may then hold rows of two frames). Raises ``NoGrid`` when a slice holds no whole row (of the last axis).

    Example:
        >>> shard_grid((8, 16, 16), 2), shard_grid((1, 16, 16), 2), shard_grid((21, 30, 52), 2)
        ((4, 16, 16), (1, 8, 16), (1, 315, 52))
    """
    total = math.prod(grid)
    if total % world:
        raise NoGrid(f"its {total} tokens do not split evenly over the {world} ranks of the context-parallel split")
    chunk = total // world
    for axis in range(len(grid)):  # a sub-grid
        inner = math.prod(grid[axis + 1:])
        if chunk % inner == 0 and grid[axis] % (chunk // inner) == 0:
            return (1,) * axis + (chunk // inner,) + tuple(grid[axis + 1:])
    for axis in range(len(grid) - 1):  # whole rows of an axis, as one tall grid
        inner = math.prod(grid[axis + 1:])
        if chunk % inner == 0:
            return (1,) * axis + (chunk // inner,) + tuple(grid[axis + 1:])
    shape = "x".join(map(str, grid))
    raise NoGrid(f"a 1/{world} slice of its {shape} token grid ({chunk} tokens) holds no whole rows, so it cannot be "
                 "merged as a grid on its rank")


def shard_of(patch, grid: tuple[int, ...], trailing: int, args: tuple, kwargs: dict) -> Shard | None:
    """This rank's part of a call with token ``grid`` under context parallelism (``None`` without it). Raises
    ``NoGrid`` when the call cannot be merged per slice (then it runs unmerged, on every rank alike)."""
    split = split_of(patch)
    if split is None:
        return None
    if split.refused is not None:
        raise NoGrid(f"under context parallelism, {split.refused}")
    if trailing:
        raise NoGrid(f"under context parallelism, the call's {trailing} reference tokens after the image's are "
                     "split with it, so a rank's slice is not a part of the image grid")
    if split.block is None:  # the denoiser's own input is split: it must be the image's tokens only
        _check_tokens(split.hidden.read(args, kwargs) if split.hidden is not None else None, math.prod(grid))
    local = shard_grid(grid, split.world)
    if patch.planner is None:  # no random draws to shift (token reuse, the step cache)
        return Shard(split, local, 0)
    shift = (split.rank * num_windows(local, patch.planner.windows) * _GOLDEN) & _MASK32
    return Shard(split, local, shift)


def check_block_input(x: torch.Tensor, tokens: int) -> None:
    """At the block whose input diffusers splits (its pre-hook sees the whole sequence): the sequence must be
    the image's ``tokens`` only. Raises ``NoGrid`` otherwise."""
    _check_tokens(x, tokens)


def _check_tokens(x, tokens: int) -> None:
    """A split token sequence ``(B, S, C)`` must hold the grid's tokens only (a latent ``(B, C, ...)`` does)."""
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] != tokens:
        raise NoGrid(f"under context parallelism, the split sequence holds {x.shape[1]} tokens where the image grid "
                     f"has {tokens} (conditioning or reference tokens beside the image's), so a rank's slice is not "
                     "a part of the image grid")
