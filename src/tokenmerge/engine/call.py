"""What one denoiser call tells its blocks.

- ``CallHook``: the denoiser's forward pre-hook and hook: the call's grid (``grids.GridReader``, read only when its
  arguments change), its timestep, the per-call checks; ``decide``, the one place a call is decided (the step clock
  moved, the ``CallInfo`` made, the technique's ``begin``), from the pre-hook or, before the call, from the
  denoiser's ``cache_context`` (``clock.decide_ahead``); the ``CallState`` the blocks read (per thread, and one for code
  torch.compile traces: dynamo follows a plain object, not a ``threading.local``). Where a call stands: ``clock.py``.
- ``CallState``: what one call tells its blocks; ``Clock``: which generation, step and place in the step a call is
  (what state kept across calls is keyed by), and what the technique keeps for the generation (its own state class
  per branch, ``technique.py``).
- ``BoundArg``: a ``forward`` argument resolved against a signature (``discover.bind``), read and replaced.
- ``Watch``: the per-call guards.
- Layout: a sequence is ``[before | image | after]``: text declared before the image (``TEXT_BEFORE``), the image's
  tokens, then text declared after it (``TEXT_AFTER``) or reference-image tokens (``trailing``: Flux Kontext).
  Everything but the image passes whole; rotary rows and mask entries follow the merged image tokens.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

import torch

from ..families.spec import TEXT_AFTER, TEXT_BEFORE, Mask, Rotary
from ..merge.plan import TABLES, Tables, join, sided_rows
from .clock import PARALLEL_ATTR, CallInfo, Where, host_where
from .compiled import holding, on_host, regional_message
from .registries import CHAIN_HOOK, REGISTRY_ATTR, bad_hook, cache_message

__all__ = ["BoundArg", "CallHook", "CallState", "Clock", "Watch", "NoGrid", "PARALLEL_ATTR", "sides", "image_part",
           "join", "take_rotary", "take_mask", "coarsen"]


class NoGrid(Exception):
    """A call whose arguments describe no token grid the engine can merge (position ids that form no grid,
    samples of different sizes): the call runs unmerged. The message says why."""


@dataclass(frozen=True)
class BoundArg:
    """An ``Arg`` resolved against one module's signature: read and replace it in a call's arguments."""

    name: str
    index: int | None
    scale: float = 1.0
    reverse: bool = False
    log_sigma: float = 0.0

    def progress(self, t, num_train_timesteps: int) -> float | None:
        """The denoising progress of timestep ``t`` (a number, or a tensor: its largest value, the step's noise level
        where it holds one per token: Wan 2.2 TI2V, LTX I2V), read on the host: 0 at the first (noisiest) step, 1 at
        the end; ``None`` for no timestep."""
        if t is None:
            return None
        t = float(t.max()) if isinstance(t, torch.Tensor) else float(t)
        if self.log_sigma:  # sigma / (1 + sigma) with sigma = exp(t / log_sigma): a logistic, computed stably
            z = t / self.log_sigma
            fraction = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
        else:
            fraction = t * self.scale / num_train_timesteps
        return fraction if self.reverse else 1.0 - fraction

    def read(self, args: tuple, kwargs: dict):
        if self.name in kwargs:
            return kwargs[self.name]
        if self.index is not None and self.index < len(args):
            return args[self.index]
        return None

    def replace(self, args: tuple, kwargs: dict, value) -> tuple[tuple, dict]:
        if self.name not in kwargs and self.index is not None and self.index < len(args):
            return args[: self.index] + (value,) + tuple(args[self.index + 1:]), kwargs
        return args, {**kwargs, self.name: value}


# ---- layout: a sequence is [before | image | after] --------------------------------------------------------
def sides(total: int, image: int, text: str, trailing: int = 0) -> tuple[int, int]:
    """``(before, after)``: the tokens before and after the ``image`` ones in a sequence of ``total``."""
    extra = total - image
    if extra < 0:
        raise ValueError(f"tokenmerge: a sequence of {total} tokens cannot hold the {image} image tokens of the "
                         "call's grid; the model was called with a token layout its family does not declare")
    # declared text first, with no test of extra against 0 (the same answer, and under torch.compile a key
    # sequence can hold a data-dependent number of text tokens: Mochi keeps each prompt's valid ones)
    if text == TEXT_BEFORE:
        after = min(trailing, extra) if trailing else 0
        return extra - after, after
    if text == TEXT_AFTER:
        return 0, extra
    if extra == 0:  # the image's tokens alone (an image-only stream of a call that has references elsewhere)
        return 0, 0
    if extra == trailing:
        return 0, extra
    raise ValueError(f"tokenmerge: {total} tokens where the image grid has {image}"
                     + (f" and {trailing} reference tokens follow it" if trailing else "")
                     + ", and this sequence is not declared to hold text beside the image; the model was called "
                       "with a token layout its family does not declare")


def image_part(x: torch.Tensor, image: int, before: int) -> torch.Tensor:
    """The ``image`` tokens of ``x`` ``(B, S, C)`` that start at ``before``, as a view."""
    return x if x.shape[1] == image else x[:, before: before + image]


def take_rotary(spec: Rotary, value, image: int, reps: torch.Tensor, trailing: int = 0, tables: Tables = TABLES,
                text: torch.Tensor | None = None):
    """The rotary embedding ``value`` (``spec.layout``) at the rows of the merged tokens' positions: the text and
    reference rows, and for each merged image token the row of the image token whose position it keeps (``reps``
    ``(M,)``). ``text``: only these of the text rows before the image (token reuse's recomputed text tokens)."""
    if spec.layout == "tables_positions":  # (per-axis tables, per-token positions): only the positions follow
        axes, positions = value
        return type(value)((axes, take_rotary(Rotary(spec.kwarg, "tensor", spec.token_axis, spec.text), positions,
                                              image, reps, trailing, tables, text)))
    if spec.layout == "image_text_pair":  # (image table, text table): only the first has image rows
        img, txt = value
        return type(value)((take_rotary(Rotary(spec.kwarg, "tensor", spec.token_axis, spec.text), img, image, reps,
                                        trailing, tables, text), txt))
    if isinstance(value, (tuple, list)):  # (cos, sin), ...: each the same way
        taken = []
        for v in value:
            taken.append(take_rotary(spec, v, image, reps, trailing, tables, text))
        return type(value)(taken)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tokenmerge: rotary embedding {spec.kwarg!r} is a {type(value).__name__}, expected a "
                        "tensor or a tuple of tensors whose rows can follow the merged tokens")
    rows = value.shape[spec.token_axis]
    if rows == 1:  # one row broadcast over every token: the merged tokens' too
        return value
    before, after = sides(rows, image, spec.text, trailing)
    return value.index_select(spec.token_axis, sided_rows(reps.to(value.device), before, image, after, tables, text))


def take_mask(spec: Mask, mask: torch.Tensor, image: int, reps: torch.Tensor, trailing: int = 0,
              tables: Tables = TABLES) -> torch.Tensor:
    """An attention mask at the rows/columns of the merged tokens: each of its last two axes that spans the
    tokens keeps the text (and reference) entries and the merged tokens' first tokens'."""
    if not spec.image:
        return mask
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"tokenmerge: attention mask {spec.kwarg!r} is a {type(mask).__name__}, not a tensor "
                        "whose rows and columns can follow the merged tokens (a flex attention BlockMask: use an "
                        "attention processor or backend that takes a tensor mask)")
    for axis in (-2, -1):  # a (B, S) key mask's axis -2 is the batch, never tokens
        if axis == -2 and mask.dim() == 2 and mask.shape[0] != mask.shape[1]:
            continue
        rows = mask.shape[axis] if mask.dim() >= -axis else 0
        if rows >= image and rows > 1:
            before, after = sides(rows, image, spec.text, trailing)
            mask = mask.index_select(axis, sided_rows(reps.to(mask.device), before, image, after, tables))
    return mask


def coarsen(grid: tuple[int, ...], level: int) -> tuple[int, ...]:
    """The grid ``level`` 2x downsamplings below ``grid`` (its last two axes; ``ceil``, as the UNets pad)."""
    for _ in range(level):
        grid = grid[:-2] + tuple(math.ceil(n / 2) for n in grid[-2:])
    return grid


# ---- a call's state ----------------------------------------------------------------------------------------
class Clock:
    """A thread's step clock: the generation, its step, each call's place in the step (``tick``), and what the
    technique keeps for the generation: per branch (``kept``: one object of its own state class per branch) and for the
    whole generation (``whole``). A new generation starts when the mark changes (the patched pipeline's scheduler has
    new ``timesteps``; ``tokenmerge.new_generation``) or the progress goes back; a call at the last call's progress is
    another call of its step. A branch is ``(signature, place)``: the call's grid, batch, dtype... and how many calls
    of that signature the step made before it (guidance run as two calls: two branches; docs/life-of-a-call.md)."""

    def __init__(self) -> None:
        self.mark: tuple = (None, None)  # (new_generation() count, the pipeline scheduler's timesteps tensor)
        self.steps: int | None = None  # the generation's step count, where a patched pipeline's scheduler tells it
        self.generation = 0
        self.step = -1
        self.index: int | None = None  # the scheduler's step index of the current step, where it tells it
        self.progress: float | None = None
        self.levels: tuple = (None, None)  # (a scheduler's timesteps tensor, the progress of its steps: host_where)
        self.same = 0  # calls in a row at one scheduler step index (STALE_CALLS of them: it is not moving)
        self.hostless = False  # the scheduler's step index was seen not to move: the timestep is read instead
        self.places: dict = {}  # signature -> calls of the current step made with it so far
        self.kept: dict = {}  # branch -> the technique's state for it
        self.spare: dict = {}  # branch -> its state in the generation before, reset (its tensors reused: clear)
        self.whole = None  # the technique's state for the whole generation (token reuse's round-robin)

    def tick(self, where: Where, signature, marks: int) -> tuple:
        """Move to a call at ``where`` with ``signature``; returns the call's branch. The generation's step count is
        ``where.steps`` where told, else the length of its time grid (``where.grid``)."""
        progress, index, timesteps = where.progress, where.index, where.grid
        hosted = index is not None and self.index is not None
        if marks != self.mark[0] or timesteps is not self.mark[1] or self.progress is None or (
                index < self.index if hosted else progress is not None and progress < self.progress):
            self.mark = (marks, timesteps)
            self.steps = where.steps if where.steps is not None else len(timesteps) if timesteps is not None and \
                hasattr(timesteps, "__len__") else None
            self.generation += 1
            self.step = 0
            self.places.clear()
            self.clear()
        elif index > self.index if hosted else progress is None or progress > self.progress:
            self.step += 1
            self.places.clear()
        self.index = index
        self.progress = progress if progress is not None else -1.0
        place = self.places.get(signature, 0)
        self.places[signature] = place + 1
        return signature, place

    def kept_for(self, branch, make):
        """The technique's state kept for ``branch`` (``make()`` where it has none yet)."""
        kept = self.kept.get(branch)
        if kept is None:
            kept = self.kept[branch] = self.spare.pop(branch, None) or make()
        return kept

    def clear(self) -> None:
        """Forget what the technique kept (each state's ``reset()``), set aside for the branches' next calls
        (``kept_for``: a cache's keeps its tensors, which compiled code sees unchanged; ``release`` drops them)."""
        for state in self.kept.values():
            state.reset()
        self.spare, self.kept = self.kept, {}
        if self.whole is not None:
            self.whole.reset()
        self.whole = None


class CallState:
    """What one denoiser call tells its blocks; ``reset()`` forgets the call (its end, or an error). ``clock``
    survives it. ``work``: the technique's own state of the call (``None``: the call runs untouched)."""

    def __init__(self) -> None:
        self.work = None
        self.reset()
        self.clock = Clock()

    def reset(self) -> None:
        """Forget the call (the technique's call state closed: modes left, chunk sizes given back)."""
        work, self.work = self.work, None
        if work is not None:
            work.close()
        self.grid: tuple[int, ...] | None = None
        self.trailing = 0  # reference tokens the call carries after the image's (Flux Kontext, Flux.2 edits)
        self.shard = None  # context parallelism: this rank's slice of the call's grid (parallel.Shard)
        self.branch = None  # the call's place in its step (Clock.tick), where state is kept across calls
        self.decided = False  # the call was decided before it, on the host (its cache_context: clock.decide_ahead)
        self.info = None  # the CallInfo the call was decided with


class Watch:
    """What each eager call checks, one dictionary lookup per module: a diffusers cache hook that reached a merged
    module without ``register_hook`` (which the patch watches: ``caches.py``), and a block or a merged module
    compiled in place since the patch (``compiled.py``): refused, or followed where the technique stands it.

    Args:
        technique: the patch's technique (for the messages).
        blocks: the patched blocks; region: ``(path, module)`` of every module that sees merged tokens.
    """

    def __init__(self, technique, blocks, region):
        self.technique, self.region = technique, region
        self.bypasses = list(technique.bypasses) if technique.regional else []  # followed
        self.hooked = [] if self.bypasses else holding(technique.patch.site.module, blocks) + region  # refused
        self.seen: dict[int, int] = {}  # id of a harmless HookRegistry -> its number of hooks when checked

    def check(self) -> None:
        for path, module in self.hooked:
            if module.__dict__.get("_compiled_call_impl") is not None:
                raise ValueError(regional_message(path, True, self.technique.name))
        for bypass in self.bypasses:
            if bypass.block.__dict__.get("_compiled_call_impl") is not bypass.compiled:
                self.technique.follow(bypass)
        for path, module in self.region:
            registry = module.__dict__.get(REGISTRY_ATTR)
            if registry is None:
                continue
            hooks = getattr(registry, "hooks", None)
            size = len(hooks) if isinstance(hooks, dict) else 0
            if self.seen.get(id(registry)) == size:
                continue
            what = bad_hook(registry)
            if what is not None and CHAIN_HOOK not in hooks:
                raise ValueError(cache_message(self.technique, path, what, later=True,
                                               why="its registry was changed without register_hook"))
            self.seen[id(registry)] = size


class CallHook:
    """The denoiser's forward pre-hook (``pre``) and hook (``post``): read a call's grid and timestep, move the step
    clock, hand the call to the technique (``begin`` / ``end``), keep the call's state.

    Args:
        patch: the installed patch (its site, blocks, technique and guards' watch).
        reader: the ``grids.GridReader`` of the denoiser's calls.
        decides_on_host: the technique decides each call on the host (under torch.compile its set-up is a graph break).
        ends: the technique has an ``end`` (called after the denoiser's forward).
        sample: the denoiser's bound ``hidden_states`` argument (a call's batch and dtype), or ``None``.
        pipeline: a weak reference to the pipeline the patch was applied through (its scheduler tells a new
            generation), or ``None``.
    """

    def __init__(self, patch, reader, decides_on_host: bool = False, ends: bool = False, sample=None, pipeline=None):
        self.patch, self.reader = patch, reader
        self._read: tuple = (None, None)  # (key, (grid, device, trailing) or the NoGrid it raised)
        self.timestep = patch.site.timestep
        self.decides_on_host, self.ends = decides_on_host, ends
        self.sample, self.pipeline = sample, pipeline
        self.marks = 0  # new_generation() calls
        self._on_host()
        self._local, self._traced = threading.local(), CallState()
        self.warned = False

    def __getstate__(self):  # run-time state is per thread and per call: never copied
        return {k: v for k, v in self.__dict__.items() if k not in ("_local", "_traced", "_read", "pipeline",
                                                                     "host_pre", "host_post")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local, self._traced, self._read, self.pipeline = threading.local(), CallState(), (None, None), None
        self._on_host()

    def _on_host(self) -> None:
        """A technique that decides each call on the host: under torch.compile its hooks run eagerly (a graph
        break)."""
        self.host_pre = on_host(CallHook.pre) if self.decides_on_host else None
        self.host_post = on_host(CallHook.post) if self.decides_on_host else None

    @property
    def state(self) -> CallState:
        """This thread's call state (or, while torch.compile traces, the traced code's)."""
        if torch.compiler.is_compiling():
            return self._traced
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = CallState()
        return state

    def pre(self, module, args, kwargs, compiled: bool = False):
        if self.host_pre is not None and torch.compiler.is_compiling() and not self._traced.decided:
            return self.host_pre(self, module, args, kwargs, True)  # decided on the host: a graph break
        patch, state = self.patch, self.state
        if state.decided:  # decided before the call (decide_ahead): its arguments; eagerly, the guards' checks
            state.info.args, state.info.kwargs = args, kwargs
            if torch.compiler.is_compiling():
                return None
            patch.watch.check()
            if patch.tuned_for is not None:  # a tuned setting: the generation it was tuned for (tuned_for.py)
                patch.tuned_for.check_call(self, state, args, kwargs)
            return None
        technique = patch.technique
        state.reset()  # a call cut short by a KeyboardInterrupt skips the always-called hooks
        compiling = torch.compiler.is_compiling()
        x = self.sample.read(args, kwargs) if self.sample is not None else None
        if not technique.gridded and getattr(module, PARALLEL_ATTR, None) is None:  # no grid to read
            read = ((), x.device if isinstance(x, torch.Tensor) else None, 0)
        elif compiling:
            try:
                read = self.reader.read(args, kwargs)
            except NoGrid as reason:
                read = reason
        else:  # read when its grid arguments change (once per generation for position ids, on a new latent shape)
            key = []
            for bound, shaped in self.reader.key_args:
                value = bound.read(args, kwargs)
                if isinstance(value, torch.Tensor):  # a latent: its shape; ids, coordinates: which tensor
                    key.append(value.shape if shaped else (value.data_ptr(), value.shape, value.device))
                else:  # a list of latents (Z-Image), integers, shapes
                    key.append(self.reader.identity(value, shaped))
            if self._read[0] != key:
                try:
                    self._read = (key, self.reader.read(args, kwargs))
                except NoGrid as reason:
                    self._read = (key, reason)
            read = self._read[1]
        if isinstance(read, NoGrid):  # e.g. position ids that describe no grid: this call runs untouched
            return self.untouched(f"a call ran unmerged: {read}")
        state.grid, device, state.trailing = read
        if getattr(module, PARALLEL_ATTR, None) is not None:  # context parallelism: the blocks see this rank's slice
            try:
                state.shard = patch.shard(state.grid, state.trailing, args, kwargs)
            except NoGrid as reason:
                return self.untouched(f"a call ran unmerged: {reason}")
            if state.shard is not None:
                state.grid = state.shard.grid
        if not compiling:
            patch.watch.check()  # caches added around the patch's modules, blocks compiled in place (guards)
        timestep = self.timestep.read(args, kwargs) if self.timestep is not None else None
        pipe = self.pipeline() if self.pipeline is not None else None
        scheduler = getattr(pipe, "scheduler", None)
        told = technique.reads_scheduler and scheduler is not None and self.timestep is not None
        where = host_where(state.clock, scheduler, timestep) if told else None
        if where is None:  # the call's timestep read on the host: once per denoiser call, not per block
            progress = self.timestep.progress(timestep, getattr(patch.config, "num_train_timesteps", 1000)) \
                if technique.timed and self.timestep is not None else None
            where = Where(None, progress, None, "timestep", getattr(scheduler, "timesteps", None))
        signature = (state.grid, state.trailing, device) if not isinstance(x, torch.Tensor) else (
            state.grid, state.trailing, device, x.dtype, *x.shape[:1 if technique.gridded else None])
        self.decide(state, where, signature, CallInfo(args, kwargs, device, timestep, where, compiled))
        if patch.tuned_for is not None and not compiling:
            patch.tuned_for.check_call(self, state, args, kwargs)
        return None

    def decide(self, state, where: Where, signature, info: CallInfo) -> None:
        """The one place a call is decided, on the host: the step clock moved to ``where`` (its branch: its
        ``signature`` and place in the step), the technique's ``begin`` with ``info``, the state compiled code reads
        set. Called by ``pre`` at the call, or by ``clock.decide_ahead`` before it (in the denoiser's
        ``cache_context``)."""
        technique = self.patch.technique
        if technique.clocked:
            state.branch = state.clock.tick(where, signature, self.marks)
        state.info = info
        technique.begin(state, info)
        if self.decides_on_host:
            self._traced = state  # the compiled blocks read the state this host-side decision set up

    def untouched(self, reason: str) -> None:
        """This call runs as if unpatched (its grid cannot be read): one warning per patch."""
        state = self.state
        state.grid = state.grid or ()  # known to the blocks (they are inside the denoiser's call), empty
        state.work = None
        self.unmerged(reason)

    def unmerged(self, reason: str) -> None:
        """Warn, once per patch, that a call (or a level of it) runs unmerged, and why."""
        if self.warned or torch.compiler.is_compiling():
            return
        self.warned = True
        site = self.patch.site
        name = site.path or type(site.module).__name__
        warnings.warn(f"tokenmerge: {name}: {reason}. The generation goes on; later calls that cannot be merged run "
                      "unmerged too, without another warning", RuntimeWarning, stacklevel=3)

    def post(self, module, args, output):
        if self.host_post is not None and torch.compiler.is_compiling() and not self._traced.decided:
            return self.host_post(self, module, args, output)
        state = self.state
        if output is not None and state.work is not None:  # a call that ran to its end leaves nothing open
            if self.ends:
                self.patch.technique.end(state)
            state.work = None
        state.reset()  # (one that raised: its technique's call closed)
        return None
