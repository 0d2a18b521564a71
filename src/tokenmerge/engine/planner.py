"""The merge plans of one patch: for each block's call, whether it merges and with which plan (made from the block's
input, shared by the blocks of a level, kept across calls), with which random destinations; the index tables and
matchings those plans need, owned here and released with the patch.

A plan is made from a block's input (tomesd's metric) on the image tokens of its level's grid; with one plan per
level (``share_plans``; by default on transformers) the first merged block of a level makes it and the level's other
blocks of the call reuse it; with ``plan_steps=k`` a plan is kept for ``k`` steps of its call's branch (the
step clock: ``call.Clock``). The destination choice is a
pure function of (seed, block, timestep) (``merge.match``: every hash constant is there), drawn for every block at
once, once per call and grid. On CUDA, a call whose hidden states are below ``min_size`` runs unmerged
(``config.CUDA_MIN_SIZE``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import min_size_on
from ..families.spec import CROSS, JOINT, MLP, SELF, Arg, Rotary, grid_rank
from ..merge.kernels import missing
from ..merge.match import _MASK32, block_salts, matching, mix32, step_key, window_hashes
from ..merge.plan import IdentityPlan, Tables
from . import notes
from .call import NoGrid, coarsen, sides, take_mask, take_rotary
from .discover import bind, bind_refusals
from .parallel import check_block_input
from .technique import Technique

__all__ = ["Planner", "Planned", "PlanCall", "BlockCall", "BlockPlan", "Plans"]


@dataclass
class BlockCall:
    """One block's call in flight: its plan, its token grid, and what its targets set aside."""

    plan: object
    grid: tuple[int, ...]
    text: dict = field(default_factory=dict)  # target -> tokens before/after the image
    modes: dict = field(default_factory=dict)  # target -> its active SDPA mode (engine/attention.py)
    entry: tuple | None = None  # scope="block": (image input, merged input, tokens before, tokens after)

    def close(self) -> None:
        """Leave any SDPA mode still active (its target's call raised before its forward hook ran)."""
        while self.modes:
            self.modes.popitem()[1].close()


@dataclass(slots=True)
class PlanCall:
    """ToMe's and ToDo's state of one denoiser call: whether it merges (the schedule's verdict) and at which ratio,
    its random key, each block's call in flight, the plans its levels share, the random draws per grid, the rotary
    rows and masks taken at a plan's tokens, the feed-forward chunk sizes set aside."""

    patched: list  # the patch's blocks
    active: bool = True
    ratio: float = 0.0
    step_key: object = None
    blocks: dict = field(default_factory=dict)  # block index -> its BlockCall in flight
    level_plans: dict = field(default_factory=dict)  # share_plans: level -> the plan of this call
    draws: dict = field(default_factory=dict)  # grid -> (blocks, windows) random choices of this call
    taken: list = field(default_factory=list)  # (plan, value, spec, taken): rotary rows and masks at merged tokens
    unchunked: dict = field(default_factory=dict)  # block -> its feed-forward chunk size set aside during its call

    def close(self) -> None:
        """Give back the chunk sizes set aside and leave the SDPA modes still open (a call cut short)."""
        for index, chunk_size in self.unchunked.items():
            setattr(self.patched[index].module, self.patched[index].chunk_attr, chunk_size)
        self.unchunked.clear()
        for call in self.blocks.values():
            call.close()


@dataclass
class Plans:
    """The plans a branch keeps across calls (``plan_steps``): key (block, or level) -> (plan, batch, tokens, step,
    ratio)."""

    plans: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.plans.clear()

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
        work = self.patch.calls.state.work
        work.blocks[index] = call
        site = self.patch.blocks[index]
        if self.config.merge_mlp and call.plan is not None and call.plan.num_merged and site.chunk_attr is not None \
                and getattr(block, site.chunk_attr, None) is not None:
            # a chunked feed-forward (diffusers' BasicTransformerBlock) hands ``ff`` slices of the tokens, which
            # cannot be merged on their own: ``ff`` runs whole on the (fewer) merged tokens for this call instead
            work.unchunked[index] = getattr(block, site.chunk_attr)
            setattr(block, site.chunk_attr, None)
        return None

    def block_post(self, index: int, block, args, output):
        """The hook of a block merged around: its call forgotten."""
        observer = self.patch.observer
        if observer is not None:
            observer.end("block")
        work = self.patch.calls.state.work
        if work is None:
            return None
        call = work.blocks.pop(index, None)
        if call is not None and call.modes:
            call.close()  # a target's call that raised leaves its ToDo mode active
        if index in work.unchunked:
            setattr(block, self.patch.blocks[index].chunk_attr, work.unchunked.pop(index))
        return None

    def block_call(self, index: int, args, kwargs) -> BlockCall | None:
        """Block ``index``'s call: the plan of its image tokens and their grid, or None when it runs unmerged (the
        schedule's verdict, a call below ``min_size``). The plan: the one this call's level made already
        (``share_plans``), one kept from an earlier call (``plan_steps``), or one made now from the block's input."""
        state, site = self.patch.calls.state, self.blocks[index]
        if state.grid is None:
            raise ValueError(
                f"tokenmerge: block {site.path} was called outside its denoiser's forward, so the image size "
                "is unknown; call the denoiser (or remove the patch first)")
        work = state.work
        if work is None or not work.active:
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
                work.active = False
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
        entry = work.level_plans.get(key)
        if entry is None or entry[1] != batch or entry[2] != image:
            kept = state.clock.kept.get(state.branch)
            entry = kept.plans.get(key) if kept is not None else None
            if entry is None or entry[1] != batch or entry[2] != image or entry[4] != work.ratio \
                    or state.clock.step - entry[3] >= self.config.plan_steps:
                entry = self._made(state, index, key, x.mean(0, keepdim=True) if self.batch_pattern else x, grid,
                                   batch, image)
        observer = self.patch.observer
        if observer is not None and hasattr(observer, "plan"):
            observer.plan(BlockPlan(site.path, entry[0], grid, state.grid, state.trailing))
        return BlockCall(entry[0], grid)

    def _made(self, state, index: int, key: int, x: torch.Tensor, grid: tuple[int, ...], batch: int, image: int):
        """A new plan for block ``index`` (``(plan, batch, tokens)``), kept for the level's other blocks and later
        calls as configured."""
        cfg, observer, work = self.config, self.patch.observer, state.work
        r = int(image * work.ratio)
        matched = self.matchings.get((grid, x.device)) if self.matcher is None else None
        if matched is None and self.matcher is None:
            matched = self.matchings[(grid, x.device)] = matching(grid, self.windows, self.radius, x.device,
                                                                  self.paths, self.tables)
        offsets = None
        # odd batch: no cond/uncond pairs, tomesd turns rand off (one pattern for the batch keeps it)
        if r > 0 and cfg.use_rand and (batch % 2 == 0 or self.batch_pattern):
            offsets = work.draws.get(grid)
            if offsets is None:  # every block's choice on this grid, at once: a few kernels per call and grid;
                windows = 1  # lowbias32(window * 0x9E3779B1 + key(seed, block, step)) % choices (merge.match)
                for n, s in zip(grid, self.windows):
                    windows *= n // s
                keys = mix32(work.step_key ^ self.tables.get(block_salts, self.seed, len(self.blocks), x.device))
                if state.shard is not None:  # a rank's slice: the single-process draw of the slice's windows
                    keys = keys + state.shard.shift
                hashes = self.tables.get(window_hashes, windows, x.device)
                offsets = work.draws[grid] = mix32((hashes + keys) & _MASK32) % self.choices
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
        entry = (plan, batch, image, state.clock.step, work.ratio)
        if self.shared:
            work.level_plans[key] = entry
        if cfg.plan_steps > 1:
            kept = state.clock.kept.get(state.branch)
            if kept is None:
                kept = state.clock.kept[state.branch] = Plans()
            kept.plans[key] = entry
        return entry


def _shape(grid) -> str:
    return "x".join(map(str, grid))


def follow(state, plan, spec, value):
    """A per-token table ``value`` at the merged tokens of ``plan``: rotary rows (``spec`` a ``Rotary``) or a mask
    (a ``Mask``), once per call for the blocks that share the plan and table (kept in the call's ``state.work``;
    compiled: the graph's CSE does it)."""
    if plan.batch != 1:
        raise ValueError("tokenmerge: per-token positions or masks need one merge pattern for the batch: the "
                         "family must set batch_pattern=True")
    compiling, seen = torch.compiler.is_compiling(), state.work.taken
    if not compiling:
        for p, v, s, taken in seen:
            if p is plan and v is value and s is spec:
                return taken
    take = take_rotary if isinstance(spec, Rotary) else take_mask
    taken = take(spec, value, plan.num_tokens, plan.representatives()[0], state.trailing, plan.tables)
    if not compiling:
        seen.append((plan, value, spec, taken))
    return taken


class Planned(Technique):
    """What the techniques that merge by plans share (ToMe around the attention, whole-block ToMe, ToDo): the
    planner, each call's set-up (does its grid fit a window, the schedule's verdict and ratio, the random key), the
    refusal of a cache that would hold merged tokens, and ``describe_patch``'s words."""

    def __init__(self, patch):
        super().__init__(patch)
        cfg = self.config
        self.planner = Planner(patch, patch.matcher, patch.code_paths)
        self.clocked = cfg.plan_steps > 1  # plans kept across calls: the step clock moves
        self.scheduled = cfg.scheduled
        self.timed = self.clocked or self.scheduled

    def begin(self, state, call) -> None:
        planner, cfg = self.planner, self.config
        unfit = planner.last_unfit[1] if planner.last_unfit[0] == state.grid else planner.unfit(state.grid)
        if unfit is not None and not self.pools:  # a grid smaller than the merge window
            self.calls.untouched(unfit)
            return
        if unfit is not None:  # ToDo still pools the keys of a small grid; its query merging finds no window
            self.calls.unmerged(f"{unfit} (only ToDo's pooling applied)")
        work = state.work = PlanCall(self.blocks)
        if planner.merges:  # the random choice of this step (ToDo without query merging makes none)
            work.step_key = step_key(call.timestep, call.device)
        work.ratio = cfg.ratio
        if self.scheduled:
            if call.where.progress is None:
                raise TypeError(f"tokenmerge: a start/stop/ratio_end schedule needs the timestep, and "
                                f"{type(self.patch.site.module).__name__}.forward got none")
            work.active = cfg.start <= call.where.progress <= cfg.stop
            work.ratio = cfg.ratio_at(call.where.progress)

    @classmethod
    def check(cls, site, blocks, config) -> None:
        if config.kernels == "triton" and missing() is not None:
            raise ValueError(f"tokenmerge: kernels='triton' cannot run here: {missing()}; use kernels='torch'")

    def release(self) -> None:
        self.planner.release()

    @classmethod
    def changes(cls, config) -> bool:
        return config.ratio > 0 or (config.ratio_end or 0) > 0

    @staticmethod
    def wanted(config, kind: str) -> bool:
        """Whether targets of ``kind`` are merged (the ``merge_*`` flags)."""
        return {SELF: config.merge_attn, JOINT: config.merge_attn, CROSS: config.merge_crossattn,
                MLP: config.merge_mlp}[kind]

    def hook_codes(self) -> list:
        return super().hook_codes() + [Planner.block_pre.__code__, Planner.block_post.__code__]

    merger = "ToMe"  # what merges, in the refusal of a cache that would hold merged tokens

    @classmethod
    def refuses_cache(cls, config, is_target: bool) -> str | None:
        return None if is_target else "it sits inside a merged target, whose tokens are merged whichever way"

    def summary(self) -> str:
        c = self.config
        return (f"tokenmerge {c.head()}max_downsample={c.max_downsample} (None = auto) sx={c.sx} sy={c.sy}"
                + (f" st={c.st}" if c.st != 1 else "") + f" use_rand={c.use_rand} seed={c.effective_seed} merge: "
                + ", ".join(n for n, on in (("attn", c.merge_attn), ("crossattn", c.merge_crossattn),
                                            ("mlp", c.merge_mlp)) if on)
                + (f" schedule: {c.start:g}..{c.stop:g}" + (f" ratio -> {c.ratio_end:g}" if c.ratio_end is not None
                                                              else "") if c.scheduled else "")
                + (f" kernels={c.kernels}" if c.kernels != "torch" else ""))

    def notes(self) -> list[str]:
        """Calls left unmerged for their size, and settings known not to pay on a GPU (docs/gpu.md)."""
        return notes.planned(self)

    @classmethod
    def cache_message(cls, path: str, what: str, when: str, why: str) -> str:
        return (f"tokenmerge: {what} {when} on {path}, whose tokens {cls.merger} merges ({why}): a cached output would "
                "hold the tokens of an earlier step's merge plan, and unmerging it with this step's plan would give "
                "tokens other tokens' outputs. Put the cache on the attention modules the patch merges around "
                "(diffusers' defaults do), use the patch's default scope='attention' with block-level caches, or "
                "disable one of them (e.g. model.disable_cache())")
