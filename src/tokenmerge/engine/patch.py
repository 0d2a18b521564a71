"""The installed patch of one denoiser: hooks that merge and unmerge at the boundaries of its blocks'
sub-modules, driven by the denoiser's family spec, and their exact removal.

- a forward pre-hook on the denoiser reads the token grid and the timestep (by argument name);
- a forward pre-hook on each selected block builds its merge plan from the block's input (tomesd's metric), and
  a forward hook (always called) drops it;
- forward pre-hooks / hooks on the block's targets merge their input and unmerge their output, each by its kind.

No ``forward`` is copied, so every norm type, chunked feed-forward and future block code keeps working: adaptive
norms modulate per channel and gates multiply per channel, which commutes with averaging tokens. Run-time state
is thread-local, so one patched model may serve several threads. Nothing here knows a family by name.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import nn

from ..config import ToDoConfig, ToMeConfig
from ..families.spec import CROSS, JOINT, MLP, SELF, Arg, BlockSite, grid_rank
from ..merge import bipartite_soft_matching, downsample, num_windows, random_offsets
from ..merge.bipartite import _MASK32, _mix32
from ..merge.windows import table
from .discover import DenoiserSite
from .grids import GridReader, NoGrid
from .guards import forget_compiled, on_call, unmerged
from .layout import image_part, sides
from .parallel import PARALLEL_ATTR, check_block_input, check_install, shard_of
from .state import BlockCall, CallState, KeptPlan, SharedPlan, host_timestep, step_key
from .targets import Bound, TargetHooks
from .whole import WholeBlocks

__all__ = ["DenoiserPatch", "PATCH_ATTR"]

# The attribute a patched denoiser carries; its presence is what "patched" means.
PATCH_ATTR = "_tokenmerge_patch"


class _Hook:
    """A hook that calls ``patch.<method>(block, target, module, *hook_args)``.

    An object rather than a closure, so that ``copy.deepcopy`` of a patched model gives a copy whose hooks
    all point at the copied patch (and so at the copied modules), and so that a patched model pickles.
    """

    __slots__ = ("patch", "method", "block", "target")

    def __init__(self, patch: "DenoiserPatch", method: str, block: int = -1, target: int = -1):
        self.patch, self.method, self.block, self.target = patch, method, block, target

    def __call__(self, module, *hook_args):
        return getattr(self.patch, self.method)(self.block, self.target, module, *hook_args)


_HIDDEN = Arg("hidden_states", also=("x",), fallback_index=0)
_CONTEXT = Arg("encoder_hidden_states", also=("context",))


class DenoiserPatch(TargetHooks, WholeBlocks):
    """The installed patch of one denoiser: its config, the selected blocks, and the hook handles.

    Args:
        site: the denoiser and its family.
        config: a ``ToMeConfig`` or ``ToDoConfig``.
        blocks: the blocks to patch.
        matcher: ``matcher(metric, shape, windows, r, offsets, radius) -> plan`` replaces ToMe's matching.
        downsampler: ``downsampler(x, shape, factors, mode)`` replaces ToDo's pooling.
        observer: an object with ``begin(phase)`` / ``end(phase)``, called around each phase ("block",
            "similarity", "merge", the target kinds, "unmerge"); ``None`` in normal use (the bench's breakdown
            sets one).
    """

    def __init__(self, site: DenoiserSite, config: ToMeConfig | ToDoConfig, blocks: list[BlockSite], matcher=None,
                 downsampler=None, observer=None):
        self.site, self.config, self.blocks = site, config, blocks
        self.family = site.family
        self.matcher = matcher or bipartite_soft_matching
        self.downsampler = downsampler or downsample
        self.observer = observer
        self.todo = isinstance(config, ToDoConfig) and config.pools
        self.whole = getattr(config, "scope", "attention") == "block"
        self.shared_plan = site.family.shared_plan
        self.rank = grid_rank(site.family.grid)
        self.windows = config.windows(self.rank)
        self.radius = config.radius(self.rank)
        self.factors = config.factors(self.rank) if isinstance(config, ToDoConfig) else None
        self._local, self._traced = threading.local(), CallState()
        self._handles: list = []
        self._targets: list[list[Bound]] = []
        self._wholes: list = []  # scope="block": per block, its bound (rotary, mask, per-token) arguments
        self._inputs: list = []  # where each block's forward takes its tokens
        self._refusals: list = []  # per block, its (bound argument, reason) pairs that refuse a call (Blocks.refuse_if)
        self._target_handles: dict = {}  # (block, target) -> its torch hooks' handles (caches.route removes them)
        self._grid_reader = GridReader(site.family.grid, site.module)
        self._seed_key = _mix32((config.effective_seed * 0x85EBCA6B) & _MASK32)

    def __getstate__(self):  # run-time state is per thread and per call: never copied
        return {k: v for k, v in self.__dict__.items() if k not in ("_local", "_traced")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local, self._traced = threading.local(), CallState()

    @property
    def state(self) -> CallState:
        """This thread's call state (or, while torch.compile traces, the traced code's)."""
        if torch.compiler.is_compiling():
            return self._traced
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = CallState()
        return state

    # ---- installation -------------------------------------------------------------------------------------
    def install(self) -> None:
        try:
            check_install(self)  # context parallelism enabled already: refuse what cannot be right under it
            denoiser = self.site.module
            self._handles.append(denoiser.register_forward_pre_hook(_Hook(self, "_denoiser_pre"), with_kwargs=True))
            self._handles.append(denoiser.register_forward_hook(_Hook(self, "_denoiser_post"), always_call=True))
            for index, block in enumerate(self.blocks):
                self._install_block(index, block)
            setattr(denoiser, PATCH_ATTR, self)
        except BaseException:
            self.remove()
            raise
        forget_compiled(denoiser, _Hook.__call__.__code__)  # compiled code does not see hooks added after it

    def _wanted(self, kind: str) -> bool:
        cfg = self.config
        return {SELF: cfg.merge_attn, JOINT: cfg.merge_attn, CROSS: cfg.merge_crossattn, MLP: cfg.merge_mlp}[kind]

    def _install_block(self, index: int, site: BlockSite) -> None:
        block = site.module
        targets = []
        if self.whole:
            whole = site.whole
            if whole is None:
                raise ValueError(f"tokenmerge: scope='block' is not declared for {site.path} (family "
                                 f"{self.family.name}): how its output and per-token arguments are laid out is not "
                                 "known; use scope='attention'")
            self._wholes.append((
                Arg(whole.rotary.kwarg, also=whole.rotary.also).bind(block) if whole.rotary is not None else None,
                Arg(whole.mask.kwarg).bind(block) if whole.mask is not None else None,
                tuple(b for b in (Arg(n).bind(block) for n in whole.per_token) if b is not None),
                tuple(b for b in (Arg(n).bind(block) for n in whole.refuse_if) if b is not None)))
        for spec in () if self.whole else site.targets:
            sub = getattr(block, spec.attr, None)
            if not (self._wanted(spec.kind) and isinstance(sub, nn.Module)):
                continue
            if spec.refuse is not None:
                raise ValueError(f"tokenmerge: {site.path}.{spec.attr} cannot take merged tokens: {spec.refuse}")
            inside = self.todo and spec.keys is not None and spec.kind in (SELF, JOINT)
            context = _CONTEXT.bind(sub) if spec.kind == SELF and not inside else None
            if self.todo and not inside:
                if spec.kind == JOINT:
                    raise ValueError(f"tokenmerge: ToDo cannot pool the keys of {site.path}.{spec.attr}: joint "
                                     f"attention whose key layout the {self.family.name} family does not declare")
                if spec.kind == SELF and context is None:
                    raise TypeError(f"tokenmerge: {site.path}.{spec.attr} takes no encoder_hidden_states/context "
                                    "argument to pass downsampled keys and values through (ToDo)")
            if inside and (self.config.ratio > 0 or (self.config.ratio_end or 0) > 0):
                raise ValueError(f"tokenmerge: ToDo with ratio={self.config.ratio:g} on {self.family.name}: its keys "
                                 "are pooled inside the attention call from the tokens that call gets, so the queries "
                                 "cannot be merged as well; use ratio=0 (or ToMe alone)")
            rotary = Arg(spec.rotary.kwarg, also=spec.rotary.also).bind(sub) if spec.rotary is not None else None
            mask = Arg(spec.mask.kwarg if spec.mask is not None else "attention_mask").bind(sub)
            same = tuple(b for b in (Arg(n).bind(sub) for n in spec.same) if b is not None)
            twins = tuple(b for b in (Arg(n).bind(sub) for n in (spec.rotary.same if spec.rotary else ()))
                          if b is not None)
            masks = tuple(b for b in (Arg(n).bind(sub) for n in (spec.mask.same if spec.mask else ())) if b is not None)
            targets.append(Bound(spec, _HIDDEN.bind(sub), context, rotary, mask, inside, same, twins, masks))
        self._targets.append(targets)
        self._refusals.append(tuple((b, reason) for b, reason in ((Arg(n).bind(block), r) for n, r in site.refuse_if)
                                    if b is not None))
        self._inputs.append(_HIDDEN.bind(block))
        self._handles.append(block.register_forward_pre_hook(_Hook(self, "_block_pre", index), with_kwargs=True))
        self._handles.append(block.register_forward_hook(_Hook(self, "_block_post", index), always_call=True))
        for t, target in enumerate(targets):
            sub = getattr(block, target.spec.attr)
            self._target_handles[(index, t)] = (
                sub.register_forward_pre_hook(_Hook(self, "_merge_input", index, t), with_kwargs=True),
                sub.register_forward_hook(_Hook(self, "_unmerge_output", index, t)))
            self._handles.extend(self._target_handles[(index, t)])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._target_handles.clear()
        self._targets.clear()
        self._wholes.clear()
        self._inputs.clear()
        self._refusals.clear()
        self.state.reset(self.blocks)
        if getattr(self.site.module, PATCH_ATTR, None) is self:
            delattr(self.site.module, PATCH_ATTR)
        forget_compiled(self.site.module, _Hook.__call__.__code__)

    # ---- denoiser -----------------------------------------------------------------------------------------
    def _denoiser_pre(self, _b, _t, module, args, kwargs):
        site, cfg, state = self.site, self.config, self.state
        state.reset(self.blocks)  # a call cut short by a KeyboardInterrupt skips the always-called hooks
        try:
            state.grid, device, state.trailing = self._grid_reader.read(args, kwargs)
            # context parallelism (parallel.py): the blocks see this rank's slice of the grid
            if getattr(module, PARALLEL_ATTR, None) is not None:
                state.shard = shard_of(self, state.grid, state.trailing, args, kwargs)
        except NoGrid as reason:  # e.g. position ids that describe no grid: this call runs unmerged
            return self._unmerged(f"a call ran unmerged: {reason}")
        if state.shard is not None:
            state.grid = state.shard.grid
        unfit = on_call(self, state.grid)  # caches added since the patch, windows larger than the grid (guards.py)
        if unfit is not None and not self.todo:
            return self._unmerged(unfit)
        if unfit is not None:  # ToDo still pools the keys of a small grid; its query merging finds no window
            unmerged(self, f"{unfit} (only ToDo's pooling applied)")
        timestep = site.timestep.read(args, kwargs) if site.timestep is not None else None
        state.step_key = step_key(timestep, device)
        state.ratio = cfg.ratio
        if not (cfg.scheduled or cfg.reuse_steps > 1):
            return None
        state.calls += 1  # counted for reuse_steps only, with the host-side timestep reads
        # one host read per denoiser call (not per block): schedules and reuse are host-side control flow
        t = host_timestep(timestep)
        progress = None if t is None else site.timestep.progress(t, cfg.num_train_timesteps)
        if cfg.reuse_steps > 1:
            if progress is not None and state.last_t is not None and progress < state.last_t:
                state.kept.clear()  # the progress went back: a new generation, nothing to reuse
            state.last_t = progress
        if cfg.scheduled:
            if progress is None:
                raise TypeError(f"tokenmerge: a start/stop/ratio_end schedule needs the timestep, and "
                                f"{type(module).__name__}.forward got none")
            state.active = cfg.start <= progress <= cfg.stop
            state.ratio = cfg.ratio_at(progress)
        return None

    def _unmerged(self, reason: str) -> None:
        """This call runs unmerged (its grid cannot be merged): no block merges, one warning per patch."""
        state = self.state
        state.grid = state.grid or ()  # known to the blocks (they are inside the denoiser's call), empty
        state.active = False
        unmerged(self, reason)
        return None

    def _denoiser_post(self, _b, _t, module, args, output):
        self.state.reset(self.blocks)
        return None

    # ---- blocks -------------------------------------------------------------------------------------------
    def _block_pre(self, index: int, _t, block, args, kwargs):
        if self.observer is not None:
            self.observer.begin("block")
        cfg, site, state = self.config, self.blocks[index], self.state
        if state.grid is None:
            raise ValueError(
                f"tokenmerge: block {site.path} was called outside its denoiser's forward, so the image size "
                "is unknown; call the denoiser (or remove the patch first)")
        if not state.active:
            return None
        for bound, reason in self._refusals[index]:
            if bound.read(args, kwargs) is not None:
                raise ValueError(f"tokenmerge: {site.path} got {bound.name!r}: {reason}")
        grid = coarsen(state.grid, site.level)
        image = math.prod(grid)
        x = self._inputs[index].read(args, kwargs)
        if state.shard is not None and state.shard.split.block == index:  # diffusers splits this block's input
            try:  # inside its forward, after this hook: the plan is made from this rank's slice
                check_block_input(x, image * state.shard.split.world)
            except NoGrid as reason:
                return self._unmerged(f"a call ran unmerged: {reason}")
            x = state.shard.split.local(x)
        if site.seq_first:  # (S, B, D) between the blocks (ERNIE-Image); its targets take (B, S, D)
            x = x.transpose(0, 1)
        if x.shape[1] > image:  # a block input that holds text or reference tokens too
            x = image_part(x, image, sides(x.shape[1], image, site.text, state.trailing)[0])
        if x.shape[1] != image:
            raise ValueError(
                f"tokenmerge: block {site.path} (level {site.level}) got {x.shape[1]} tokens, but a latent grid of "
                f"{_shape(state.grid)} gives {_shape(grid)} = {image} tokens at that level")
        batch = 1 if self.shared_plan else x.shape[0]  # shared: one pattern for the batch (a merged token has one
        plan = self._reused_plan(index, site, batch, image)  # position for all elements)
        if plan is None:
            plan = self._new_plan(index, x.mean(0, keepdim=True) if self.shared_plan else x, grid, batch, image)
        state.blocks[index] = call = BlockCall(plan, grid)
        if self.whole and plan.num_merged:
            return self._merge_block(index, site, call, args, kwargs)
        if cfg.merge_mlp and plan.num_merged and getattr(block, "_chunk_size", None) is not None:
            # diffusers' chunked feed-forward would hand ``ff`` slices of the tokens, which cannot be merged on
            # their own: run ``ff`` whole on the (smaller) merged tokens for this call instead.
            state.unchunked[index] = block._chunk_size
            block._chunk_size = None
        return None

    def _new_plan(self, index: int, x: torch.Tensor, grid: tuple[int, ...], batch: int, image: int):
        cfg, state = self.config, self.state
        r = int(image * state.ratio)
        offsets = None
        # odd batch: no cond/uncond pairs, tomesd turns rand off (a shared plan keeps it)
        if r > 0 and cfg.use_rand and (batch % 2 == 0 or self.shared_plan):
            offsets = self._offsets(index, grid, x.device)
        if self.observer is not None:
            self.observer.begin("similarity")
        plan = self.matcher(x, grid, self.windows, r, offsets, self.radius)
        if self.observer is not None:
            self.observer.end("similarity")
        if self.shared_plan and plan.num_merged:
            plan = SharedPlan(plan)
        self._keep_plan(index, self.blocks[index], plan, batch, image)
        return plan

    def _offsets(self, index: int, grid: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Block ``index``'s random destination choice on ``grid`` at this call: a row of one draw for every
        block, made at the first block that needs it (a few kernels per call and grid, none per block).

        Each row is ``random_offsets`` keyed by ``lowbias32(step_key ^ salt)``, the block's salt mixing the
        seed and the block index: the choice is a pure function of (seed, block, timestep)."""
        state = self.state
        draws = state.draws.get(grid)
        if draws is None:
            keys = _mix32(state.step_key ^ _salts(self._seed_key, len(self.blocks), device))  # (blocks, 1)
            if state.shard is not None:  # a rank's slice: the single-process draw of the slice's windows
                keys = keys + state.shard.shift
            draws = state.draws[grid] = random_offsets(num_windows(grid, self.windows), math.prod(self.windows),
                                                       keys, device)
        return draws[index]

    def _reuse_key(self, index: int, site: BlockSite) -> int:
        return -1 - site.level if self.config.share_plans else index

    def _reused_plan(self, index: int, site: BlockSite, batch: int, tokens: int):
        cfg, state = self.config, self.state
        key = self._reuse_key(index, site)
        entry = state.shared.get(key)
        if entry is not None and entry.batch == batch and entry.tokens == tokens:
            return entry.plan
        entry = state.kept.get(key)
        if entry is not None and entry.batch == batch and entry.tokens == tokens and \
                state.calls - entry.call < cfg.reuse_steps and entry.ratio == state.ratio:
            return entry.plan
        return None

    def _keep_plan(self, index: int, site: BlockSite, plan, batch: int, tokens: int) -> None:
        cfg, state = self.config, self.state
        key = self._reuse_key(index, site)
        if cfg.share_plans:
            state.shared[key] = KeptPlan(plan, batch, tokens)
        if cfg.reuse_steps > 1:
            state.kept[key] = KeptPlan(plan, batch, tokens, state.calls, state.ratio)

    def _block_post(self, index: int, _t, block, args, output):
        if self.observer is not None:
            self.observer.end("block")
        state = self.state
        call = state.blocks.pop(index, None)
        if call is not None:
            call.close()  # a target's call that raised leaves its ToDo mode active
        if index in state.unchunked:
            block._chunk_size = state.unchunked.pop(index)
        if call is not None and call.entry is not None and output is not None:
            return self._unmerge_block(call, self.blocks[index], output)
        return None

@table
def _salts(seed_key: int, blocks: int, device: torch.device) -> torch.Tensor:
    """``(blocks, 1)`` int64: each block's salt of the random choice, ``seed_key ^ (index * 0xC2B2AE35)``."""
    return torch.tensor([[seed_key ^ ((index * 0xC2B2AE35) & _MASK32)] for index in range(blocks)],
                        dtype=torch.int64).to(device)


def coarsen(grid: tuple[int, ...], level: int) -> tuple[int, ...]:
    """The grid ``level`` 2x downsamplings below ``grid`` (its last two axes; ``ceil``, as the UNets pad)."""
    for _ in range(level):
        grid = grid[:-2] + tuple(math.ceil(n / 2) for n in grid[-2:])
    return grid


def _shape(grid) -> str:
    return "x".join(map(str, grid))
