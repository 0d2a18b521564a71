"""The merge plans of one patch: for each block's call, whether it merges and with which plan (made from the block's
input, shared by the blocks of a level, kept across calls), with which random destinations; the index tables and
matchings those plans need, owned here and released with the patch.

A plan is made from a block's input (tomesd's metric) on the image tokens of its level's grid; with one plan per
level (``share_plans``; by default on transformers) the first merged block of a level makes it and the level's other
blocks of the call reuse it; with ``reuse_steps=k`` a plan is kept for ``k`` steps of its call's slot (the
step clock: ``call.Clock``). The destination choice is a
pure function of (seed, block, timestep) (``merge.match``: every hash constant is there), drawn for every block at
once, once per call and grid. On CUDA, a call whose hidden states are below ``min_size`` runs unmerged
(``config.CUDA_MIN_SIZE``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import min_size_on
from ..families.spec import Arg, grid_rank
from ..merge.match import _MASK32, block_salts, matching, mix32, window_hashes
from ..merge.plan import IdentityPlan, Tables
from .call import BlockCall, NoGrid, coarsen, sides
from .discover import bind, bind_refusals
from .parallel import check_block_input

__all__ = ["Planner", "BlockPlan"]

_HIDDEN = ("hidden_states", ("x",), 0)  # where a block takes its tokens: by name, other names, position


@dataclass(frozen=True)
class BlockPlan:
    """What a patched block merges at one call: the event ``observer.plan`` gets (``tokenmerge.observe``).

    Args:
        path: the block's path in the model.
        plan: its merge plan: ``num_tokens`` (the image tokens), ``num_slots`` (after merging), ``num_merged``; a
            ``MergePlan``'s ``dest`` ``(B, N)``: each token's slot (``B`` 1: one pattern for the batch).
        grid: the block's token grid; call_grid: the call's (its finest level's); trailing: the reference tokens
            the call carries after the image's.
    """

    path: str
    plan: object
    grid: tuple[int, ...]
    call_grid: tuple[int, ...]
    trailing: int = 0


class Planner:
    """Every merge plan of one patch.

    Args:
        patch: the installed patch (config, family, blocks, its ``CallHook``, observer).
        matcher: ``matcher(metric, shape, windows, r, offsets, radius) -> plan`` instead of ToMe's matching (the
            bench's zero-overhead limit), or None.
        code_paths: "cpu" or "cuda": run the matching the way that device does whatever the tensors' device (the
            kernel counts of a CUDA call, taken on a CPU), or None (the device's).
    """

    def __init__(self, patch, matcher=None, code_paths: str | None = None):
        cfg, family = patch.config, patch.site.family
        self.patch, self.config, self.blocks = patch, cfg, patch.blocks
        self.batch_pattern = family.batch_pattern
        self.shared = cfg.plans_shared(family.kind)  # one plan per level and call (share_plans)
        self.rank = rank = grid_rank(family.grid)
        self.windows, self.radius = cfg.windows(rank), cfg.radius(rank)
        self.choices = math.prod(self.windows)
        self.matcher, self.paths = matcher, code_paths
        self.seed = cfg.effective_seed
        self.tables = Tables()
        self.matchings: dict = {}  # (grid, device) -> its Matching
        self.inputs = [bind(Arg(_HIDDEN[0], also=_HIDDEN[1], fallback_index=_HIDDEN[2]), b.module) for b in self.blocks]
        self.refusals = [bind_refusals(b) for b in self.blocks]
        self.levels = sorted({b.level for b in self.blocks})
        self.small: dict[int, tuple] = {}  # level -> (grid, channels, min size) of a call too small to merge
        self._smallest: dict = {}  # device type -> the min_size in force there
        self.last_unfit: tuple = (None, None)  # (grid, why no level of it fits a window): ``unfit`` of the last grid
        self.merges = cfg.ratio > 0 or (cfg.ratio_end or 0) > 0

    def release(self) -> None:
        """Drop the tables and matchings (their device memory)."""
        self.tables.clear()
        self.matchings.clear()

    def unfit(self, grid: tuple[int, ...]) -> str | None:
        """Why no patched level of ``grid`` fits a merge window (the call then runs unmerged), or None; a level
        that does not fit while others do is left unmerged, with the patch's one warning."""
        whole = None
        unfit = [(level, coarsen(grid, level)) for level in self.levels]
        unfit = [(level, g) for level, g in unfit if math.prod([n // s for n, s in zip(g, self.windows)]) == 0]
        if self.merges and unfit:
            cfg = self.config
            sizes = f"sx={cfg.sx}, sy={cfg.sy}" + (f", st={cfg.st}" if cfg.st != 1 else "")
            where = ", ".join(f"{_shape(g)} at downsample {2 ** level}" for level, g in unfit)
            if len(unfit) == len(self.levels):
                whole = (f"a call with a {_shape(grid)} token grid ran unmerged: the merge window ({sizes}) is larger "
                         "than the grid" + ("" if self.levels == [0] else f" at each patched level ({where})") +
                         ", so no window fits")
            else:
                self.patch.calls.unmerged(f"a call with a {_shape(grid)} token grid ran unmerged in some levels: the "
                                          f"merge window ({sizes}) is larger than their grids ({where}); the other "
                                          "levels merged")
        if not torch.compiler.is_compiling():
            self.last_unfit = (grid, whole)
        return whole

    def block_pre(self, index: int, block, args, kwargs):
        """The pre-hook of a block merged around (ToMe, ToDo): its call's plan, kept in the call's state."""
        observer = self.patch.observer
        if observer is not None:
            observer.begin("block")
        call = self.block_call(index, args, kwargs)
        if call is None:
            return None
        state = self.patch.calls.state
        state.blocks[index] = call
        site = self.patch.blocks[index]
        if self.config.merge_mlp and call.plan is not None and call.plan.num_merged and site.chunk_attr is not None \
                and getattr(block, site.chunk_attr, None) is not None:
            # a chunked feed-forward (diffusers' BasicTransformerBlock) hands ``ff`` slices of the tokens, which
            # cannot be merged on their own: ``ff`` runs whole on the (fewer) merged tokens for this call instead
            state.unchunked[index] = getattr(block, site.chunk_attr)
            setattr(block, site.chunk_attr, None)
        return None

    def block_post(self, index: int, block, args, output):
        """The hook of a block merged around: its call forgotten."""
        observer = self.patch.observer
        if observer is not None:
            observer.end("block")
        state = self.patch.calls.state
        call = state.blocks.pop(index, None)
        if call is not None and call.modes:
            call.close()  # a target's call that raised leaves its ToDo mode active
        if index in state.unchunked:
            setattr(block, self.patch.blocks[index].chunk_attr, state.unchunked.pop(index))
        return None

    def block_call(self, index: int, args, kwargs) -> BlockCall | None:
        """Block ``index``'s call: the plan of its image tokens and their grid, or None when it runs unmerged (the
        schedule's verdict, a call below ``min_size``). The plan: the one this call's level made already
        (``share_plans``), one kept from an earlier call (``reuse_steps``), or one made now from the block's input."""
        state, site = self.patch.calls.state, self.blocks[index]
        if state.grid is None:
            raise ValueError(
                f"tokenmerge: block {site.path} was called outside its denoiser's forward, so the image size "
                "is unknown; call the denoiser (or remove the patch first)")
        if not state.active:
            return None
        for bound, reason in self.refusals[index]:
            if bound.read(args, kwargs) is not None:
                raise ValueError(f"tokenmerge: {site.path} got {bound.name!r}: {reason}")
        grid = state.grid if site.level == 0 else coarsen(state.grid, site.level)
        image = 1
        for n in grid:
            image *= n
        x = self.inputs[index].read(args, kwargs)
        if state.shard is not None and state.shard.split.block == index:  # diffusers splits this block's input
            try:  # inside its forward, after this hook: the plan is made from this rank's slice (parallel.py)
                check_block_input(x, image * state.shard.split.world)
            except NoGrid as reason:
                self.patch.calls.unmerged(f"a call ran unmerged: {reason}")
                state.active = False
                return None
            x = state.shard.split.local(x)
        if site.seq_first:  # (S, B, D) between the blocks (ERNIE-Image); its targets take (B, S, D)
            x = x.transpose(0, 1)
        if x.shape[1] > image:  # a block input that holds text or reference tokens too
            before = sides(x.shape[1], image, site.text, state.trailing)[0]
            x = x[:, before: before + image]
        if x.shape[1] != image:
            raise ValueError(
                f"tokenmerge: block {site.path} (level {site.level}) got {x.shape[1]} tokens, but a latent grid of "
                f"{_shape(state.grid)} gives {_shape(grid)} = {image} tokens at that level")
        smallest = self._smallest.get(x.device.type)
        if smallest is None:
            smallest = self._smallest[x.device.type] = min_size_on(self.config.min_size, x.device)
        if image * x.shape[-1] < smallest:  # too small to pay on this device (config.CUDA_MIN_SIZE): unmerged
            if not torch.compiler.is_compiling():
                self.small[site.level] = (grid, x.shape[-1], smallest)
            return None
        if not self.merges:  # ToDo without query merging: the block's grid, no plan (an observer sees an identity)
            observer = self.patch.observer
            if observer is not None and hasattr(observer, "plan"):
                observer.plan(BlockPlan(site.path, IdentityPlan(image), grid, state.grid, state.trailing))
            return BlockCall(None, grid)
        batch = 1 if self.batch_pattern else x.shape[0]  # one pattern for the batch: a merged token has one position
        key = -1 - site.level if self.shared else index
        entry = state.level_plans.get(key)
        if entry is None or entry[1] != batch or entry[2] != image:
            entry = state.clock.kept.get((state.slot, key))
            if entry is None or entry[1] != batch or entry[2] != image or entry[4] != state.ratio \
                    or state.clock.step - entry[3] >= self.config.reuse_steps:
                entry = self._made(state, index, key, x.mean(0, keepdim=True) if self.batch_pattern else x, grid,
                                   batch, image)
        observer = self.patch.observer
        if observer is not None and hasattr(observer, "plan"):
            observer.plan(BlockPlan(site.path, entry[0], grid, state.grid, state.trailing))
        return BlockCall(entry[0], grid)

    def _made(self, state, index: int, key: int, x: torch.Tensor, grid: tuple[int, ...], batch: int, image: int):
        """A new plan for block ``index`` (``(plan, batch, tokens)``), kept for the level's other blocks and later
        calls as configured."""
        cfg, observer = self.config, self.patch.observer
        r = int(image * state.ratio)
        matched = self.matchings.get((grid, x.device)) if self.matcher is None else None
        if matched is None and self.matcher is None:
            matched = self.matchings[(grid, x.device)] = matching(grid, self.windows, self.radius, x.device,
                                                                  self.paths, self.tables)
        offsets = None
        # odd batch: no cond/uncond pairs, tomesd turns rand off (one pattern for the batch keeps it)
        if r > 0 and cfg.use_rand and (batch % 2 == 0 or self.batch_pattern):
            offsets = state.draws.get(grid)
            if offsets is None:  # every block's choice on this grid, at once: a few kernels per call and grid;
                windows = 1  # lowbias32(window * 0x9E3779B1 + key(seed, block, step)) % choices (merge.match)
                for n, s in zip(grid, self.windows):
                    windows *= n // s
                keys = mix32(state.step_key ^ self.tables.get(block_salts, self.seed, len(self.blocks), x.device))
                if state.shard is not None:  # a rank's slice: the single-process draw of the slice's windows
                    keys = keys + state.shard.shift
                hashes = self.tables.get(window_hashes, windows, x.device)
                offsets = state.draws[grid] = mix32((hashes + keys) & _MASK32) % self.choices
            offsets = offsets[index]
        if observer is not None:
            observer.begin("similarity")
        if not x.is_contiguous() and (self.paths or x.device.type) == "cpu":  # a strided view (PixArt's patch
            x = x.contiguous()  # embedding: transposed): the CPU's matching gathers rows of it many times, each a
            # slow strided copy; on CUDA a strided gather costs no more, and a copy is one more kernel
        if self.matcher is not None:
            plan = self.matcher(x, grid, self.windows, r, offsets, self.radius)
        elif r <= 0 or matched.empty:
            plan = IdentityPlan(image)
        else:
            with torch.no_grad():
                plan = matched.run(x, r, offsets)
            plan.kernels = cfg.kernels  # "triton": its merge and unmerge by merge.kernels where they can run
        if observer is not None:
            observer.end("similarity")
        entry = (plan, batch, image, state.clock.step, state.ratio)
        if self.shared:
            state.level_plans[key] = entry
        if cfg.reuse_steps > 1:
            state.clock.kept[(state.slot, key)] = entry
        return entry


def _shape(grid) -> str:
    return "x".join(map(str, grid))
