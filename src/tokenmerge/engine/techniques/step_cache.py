"""The step cache (``tokenmerge.apply_step_cache``): some steps of a generation are computed, the others run no block
of the transformer's stack; its output is the stack's input plus the residual the stack added at the last computed
step, moved along its slope, per stream and run of blocks. What a skipped step keeps and does, step by step:
docs/design.md ("The caches across steps, inside")"""

from __future__ import annotations

import dataclasses

import torch

from ...families.predicates import params
from ...families.spec import Arg
from ..discover import bind
from .across import Across, BranchState, Bypass, moved
from .presets import SCHEDULES
from .schedule import Scheduled

__all__ = ["StepCacheConfig", "StepCache", "StepBranch", "StepCall"]

_HIDDEN = Arg("hidden_states", also=("x",), fallback_index=0)


@dataclasses.dataclass(frozen=True)
class StepCacheConfig(Scheduled):
    """Settings of ``apply_step_cache``, validated when made: the schedule's fields (``Scheduled``'s, documented
    there: ``gap`` by default, ``skip`` rounds or a ``mask``), the slope's factor, the shortest generation that skips.

    Example:
        >>> "".join("1" if c else "0" for c in StepCacheConfig(warmup=3, skip=1, skip_growth=1).schedule(20))
        '11101001000100001000'
    """

    DEFAULT = SCHEDULES["image"]["balanced"]


@dataclasses.dataclass(slots=True)
class KeptResidual:
    """A kept residual: of ``stream``, added at block ``end``'s output at a skipped step (``slope``: its change per
    unit of progress, zeros until two computed steps measured it; ``None`` without ``extrapolate``)."""

    stream: str
    end: int
    residual: torch.Tensor
    slope: torch.Tensor | None = None


@dataclasses.dataclass(slots=True)
class StepBranch(BranchState):
    """One branch's kept state (``across.BranchState``): the runs' residuals and slopes (one per stream, more where a
    stream changes shape between blocks), updated in place at each computed step."""

    runs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class StepCall:
    """One call in flight: skipped (with the slope's weight and what the runs' last blocks add) or computed (with the
    runs of blocks measured so far: each stream's current run's first input and latest output, the runs closed)."""

    kept: StepBranch
    cached: bool
    progress: float
    adds: dict = dataclasses.field(default_factory=dict)  # skipped: block -> ((position, residual, slope), ...)
    weight: torch.Tensor | None = None  # skipped: the slope's weight (the kept 0-d tensor), None: no slope
    first: dict = dataclasses.field(default_factory=dict)  # computed: stream -> input of its current run of blocks
    last: dict = dataclasses.field(default_factory=dict)  # computed: stream -> (block, its latest output)
    closed: list = dataclasses.field(default_factory=list)  # computed: the runs closed so far: (stream, end, residual)
    ran: int = 0  # computed: blocks that ran
    odd: str | None = None  # computed: a run whose last output is not of its first input's shape

    def close(self) -> None:
        self.first.clear()
        self.last.clear()
        self.closed.clear()

    def shut(self, stream: str) -> None:
        """Close ``stream``'s current run: summed into the stream's last closed run where it has that run's shape
        (what came between them was added), kept apart otherwise."""
        end, y = self.last.pop(stream)
        first = self.first.pop(stream)
        if y.shape != first.shape:
            self.odd = f"block {end} of the stack returns its {stream} stream as {tuple(y.shape)}, not in the " \
                f"shape its run of blocks took it ({tuple(first.shape)})"
            return
        residual = y - first
        for k in range(len(self.closed) - 1, -1, -1):
            if self.closed[k][0] == stream:
                kept = self.closed[k][2]
                if kept.shape == residual.shape and kept.dtype == residual.dtype:
                    self.closed[k] = (stream, end, kept + residual)
                    return
                break
        self.closed.append((stream, end, residual))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A block's output laid out by its inputs: ``tensor`` (it returns one tensor, its ``hidden_states``' stream), or
    per element of the tuple it returns the stream passed through there (``None``: an element that is ``None``)."""

    tensor: bool
    kind: type
    streams: tuple  # per output element: the stream name or None
    inputs: tuple  # per output element: the BoundArg of its input or None


class StepCache(Across):
    """The step cache on a denoiser's stack of blocks.

    Args:
        patch: the installed patch (config, blocks, family, its ``CallHook``).
    """

    name = "step cache"
    Branch = StepBranch
    verb, word = "skip", "skipped"
    controlnet = ("controlnet_blocks",  # diffusers' ControlNets: an output read at every block
                  "a ControlNet's outputs are read after every block (its residuals), which a skipped step does not "
                  "compute: it runs every step, and the denoiser it feeds adds its residuals afresh at each step")
    keeps = "the step cache skips these blocks at some steps, and keeps its own residual from the computed ones"
    clash_message = ("tokenmerge: {what} {when} on {path}, a block the step cache skips ({why}): two caches across "
                     "steps on one denoiser would each reuse the other's stale outputs; use one of them")

    def __init__(self, patch):
        super().__init__(patch)
        self.bypassed = [site.module for site in self.blocks]
        self.hidden = [bind(_HIDDEN, site.module) for site in self.blocks]
        self.layouts: dict[int, Layout] = {}  # block -> its output's layout, learned at its first computed call

    # ---- the protocol's static parts ------------------------------------------------------------------------
    @classmethod
    def check(cls, site, blocks, config) -> None:
        name = f"{site.path or type(site.module).__name__} ({site.family.name})"
        if site.family.kind == "unet":
            raise ValueError(f"tokenmerge: the step cache skips a transformer's stack of blocks, and {name} is a "
                             "UNet, whose attention blocks sit between its resolution levels' convolutions: use "
                             "tokenmerge.apply_unet_cache (its deep path cached) or tokenmerge.accelerate on it")
        cls.needs_timestep(site, name)

    # ---- the denoiser's call (on the host) ----------------------------------------------------------------------
    def call(self, kept: StepBranch, computed: bool, info) -> StepCall:
        """The call's state: computed, or skipped with what each stream's last block adds."""
        work = StepCall(kept, not computed, info.where.progress)
        if computed:
            return work
        work.weight = self.weight(kept, info.where.progress)
        for run in kept.runs:
            position = self.layouts[run.end].streams.index(run.stream)
            slope = run.slope if work.weight is not None else None
            work.adds.setdefault(run.end, []).append((position, run.residual, slope))
        return work

    # ---- a block ------------------------------------------------------------------------------------------------
    def forward(self, bypass: Bypass, args: tuple, kwargs: dict):
        """The block's call: its inputs passed through at a skipped step, its own forward (measured) otherwise."""
        work = self.calls.state.work
        index = bypass.index
        if work is None:
            return bypass.inner(*args, **kwargs)
        if work.cached:
            layout = self.layouts[index]
            outs = [None if b is None else b.read(args, kwargs) for b in layout.inputs]
            if index == 0:
                outs = self._split(bypass, layout, outs)
            for position, residual, slope in work.adds.get(index, ()):  # x + R (+ w S)
                x = outs[position] + residual
                outs[position] = x if slope is None else x.addcmul_(slope, work.weight)
            return outs[0] if layout.tensor else layout.kind(outs)
        out = bypass.inner(*args, **kwargs)
        layout = self.layouts.get(index)
        if layout is None:
            layout = self._learn(bypass, args, kwargs, out)
            if layout is None:
                return out
        ins = [None if b is None else b.read(args, kwargs) for b in layout.inputs]
        if index == 0:
            ins = self._split(bypass, layout, ins)
        outs = (out,) if layout.tensor else out
        for stream, x, y in zip(layout.streams, ins, outs):
            if stream is None:
                continue
            seen = work.last.get(stream)
            if seen is None or seen[1] is not x:  # a new run of blocks (the model changed the stream in between)
                if seen is not None:
                    work.shut(stream)
                work.first[stream] = x
            work.last[stream] = (index, y)
        work.ran += 1
        return out

    def _split(self, bypass: Bypass, layout: Layout, values: list) -> list:
        """Under context parallelism split at this block by diffusers' hook, which runs inside this bypass when the
        hook was registered before the patch: the ``hidden_states`` this rank's slice, as the block sees it."""
        hidden = self.hidden[bypass.index]
        return [self._local(bypass, v) if b is not None and b.name == hidden.name else v
                for b, v in zip(layout.inputs, values)]

    def _local(self, bypass: Bypass, x):
        """``x``, the block's ``hidden_states``, as the block sees it (``_split``)."""
        shard = self.calls.state.shard
        if shard is None or shard.split.block != bypass.index or bypass.block.__dict__.get("forward") is not bypass:
            return x
        return shard.split.local(x)

    def _learn(self, bypass: Bypass, args: tuple, kwargs: dict, out) -> Layout | None:
        """A block's output layout, from its first computed call (``None``: it cannot be told, and no step is
        skipped from now on, with one warning)."""
        index = bypass.index
        site, hidden = self.blocks[index], self.hidden[index]
        x = self._local(bypass, hidden.read(args, kwargs)) if hidden is not None else None
        why = None
        if isinstance(out, torch.Tensor):
            layout = Layout(True, tuple, ("hidden",), (hidden,))
            if not isinstance(x, torch.Tensor) or x.shape != out.shape:
                why = f"{site.path} returns a tensor not of its hidden_states' shape"
        elif isinstance(out, (tuple, list)):
            inputs = self._inputs(site.module, args, kwargs)
            whole = site.whole
            declared = {}
            if whole is not None and whole.output is not None:
                declared[whole.output] = hidden
            if whole is not None and whole.text is not None and whole.text_output is not None:
                declared[whole.text_output] = bind(Arg(whole.text), site.module)
            streams, bound = [], []
            names = list(inputs)
            for position, y in enumerate(out):
                b = declared.get(position) if isinstance(y, torch.Tensor) else None
                if b is None and isinstance(y, torch.Tensor):
                    # the one input of its shape not taken by another output (of several, the one at the output's
                    # position among the arguments)
                    taken = {x.name for x in [*bound, *declared.values()] if x is not None}
                    same = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape == y.shape and
                            v.dtype == y.dtype and n not in taken]
                    if len(same) > 1 and position < len(names) and names[position] in same:
                        same = [names[position]]
                    b = (hidden if same[0] == hidden.name else bind(Arg(same[0]), site.module)) if len(same) == 1 \
                        else None
                    if b is None:
                        why = (f"{site.path} returns a {tuple(y.shape)} tensor at position {position} that matches "
                               f"{'no' if not same else 'more than one'} input of that shape")
                        break
                elif y is not None and not isinstance(y, torch.Tensor):
                    why = f"{site.path} returns a {type(y).__name__} at position {position}, not a tensor"
                    break
                streams.append(None if b is None else ("hidden" if b is hidden else b.name))
                bound.append(b)
            layout = Layout(False, type(out), tuple(streams), tuple(bound))
        else:
            why = f"{site.path} returns a {type(out).__name__}, not tensors the step cache can pass through"
        if why is not None:
            self.refuse(why)
            return None
        self.layouts[index] = layout
        return layout

    def forget(self) -> None:
        self.layouts.clear()  # learned again at the next computed call (another size may tell them apart)

    @staticmethod
    def _inputs(module, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name."""
        names = [p.name for p in params(module) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return {**dict(zip(names, args)), **kwargs}

    # ---- after the denoiser's call (on the host) ----------------------------------------------------------------
    def end(self, state) -> None:
        """A computed call that ran every block: its runs' residuals kept, in place (made at the branch's first computed
        call, or where the runs' shapes changed), their slopes measured against the residuals kept before it over
        the progress between them (``kept.span``, filled on the host: ``Across.begin``)."""
        work = state.work
        if work.cached or work.ran != len(self.blocks) or not work.last:
            return
        for stream in list(work.last):
            work.shut(stream)
        if work.odd is not None:
            return self.refuse(work.odd)
        kept, closed = work.kept, work.closed
        if len(kept.runs) != len(closed) or not all(
                r.stream == s and r.end == e and r.residual.shape == x.shape and r.residual.dtype == x.dtype
                for r, (s, e, x) in zip(kept.runs, closed)):
            extrapolate = self.config.extrapolate
            kept.runs = [KeptResidual(s, e, x, torch.zeros_like(x) if extrapolate else None) for s, e, x in closed]
            return kept.made(closed[0][2], work.progress)
        for run, (_, _, residual) in zip(kept.runs, closed):
            moved(run.residual, residual, run.slope, kept.span)

    # ---- describe_patch -------------------------------------------------------------------------------------------
    def scope(self) -> str:
        return f"a skipped step runs none of its {len(self.blocks)} transformer blocks"

    def summary(self) -> str:
        return f"tokenmerge step cache: {self.config.words()}"

    def notes(self) -> list[str]:
        return [NOTE_MEMORY + (NOTE_SLOPE if self.config.extrapolate else ""), self.report()]


NOTE_MEMORY = ("the step cache keeps, per call of a step (guidance run as two calls keeps two), the stack's residual "
               "of each stream the blocks return (the image's: batch x tokens x width; a text stream's)")
NOTE_SLOPE = ", and its slope beside it: two such tensors"
