"""Where a patched block's time goes: similarity, merge, attention, unmerge (``tokenmerge bench --breakdown``).

A ``PhaseTimer`` is attached to the installed patches (``attach``); their hooks call ``begin`` and ``end``
around each phase. Every boundary synchronises the device, so the phases add up to what the device spent, and
the step is slower than an untimed one: read the phases as shares, not as step times.

A phase that begins inside another is timed on its own and left out of the outer one's time (``block`` aside,
which is everything in the patched blocks). That is how ToDo's pooling is seen where it happens inside the
attention call (joint and rotary attention: Flux, Qwen-Image, Wan, HunyuanVideo, LTX...): the bench hands the
core a downsampler that reports to the timer as "merge", and the attention phase keeps the rest.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import asdict

import torch

from ..measure import sync
from ..tools.methods import MethodSpec
from .cell import OWN_METHODS, Cell, record_fields, set_attention, step

__all__ = ["PhaseTimer", "attach", "breakdown_cell", "PHASES"]

# phase -> what it is; "self"/"cross"/"mlp"/"joint" are the wrapped sub-modules' own time
PHASES = {
    "block": "the patched transformer blocks, whole",
    "similarity": "building merge plans (metric, similarities, matching)",
    "merge": "merging inputs (and ToDo's pooling of keys/values, inside the attention call too)",
    "self": "self-attention",
    "joint": "joint attention (SD3, Flux, HunyuanVideo, Qwen-Image...; Flux.2's single blocks: with their MLP)",
    "cross": "cross-attention",
    "mlp": "feed-forward",
    "unmerge": "unmerging outputs",
}


class PhaseTimer:
    """Seconds per phase, summed over the calls of ``begin(phase)`` / ``end(phase)``; a phase that begins while
    another (not "block") is open pauses that one until it ends (exclusive times)."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self._block: float | None = None
        self._stack: list[list] = []  # [phase, start of its current stretch]
        self._total: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def begin(self, phase: str) -> None:
        now = self._now()
        if phase == "block":
            self._block = now
            return
        if self._stack:  # pause the enclosing phase
            outer = self._stack[-1]
            self._total[outer[0]] += now - outer[1]
        self._stack.append([phase, now])

    def end(self, phase: str) -> None:
        now = self._now()
        if phase == "block":
            if self._block is not None:
                self._total["block"] += now - self._block
                self._block = None
            return
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == phase:
                self._total[phase] += now - self._stack.pop(i)[1]
                break
        else:
            return  # never begun (a hook after an error): nothing to count
        if self._stack:  # resume the enclosing phase
            self._stack[-1][1] = now

    def totals(self) -> dict[str, float]:
        return dict(self._total)


def attach(model, timer: PhaseTimer | None) -> None:
    """Give every tokenmerge patch installed on ``model`` this timer (``None`` detaches), through the core's
    documented observer hook (``tokenmerge.observe``)."""
    import tokenmerge

    tokenmerge.observe(model, timer)


class _TimedPooling:
    """ToDo's pooling (or its zero-overhead slice) reporting to the timer as "merge": where the core pools the keys
    inside the attention call, the hooks' phases would count it as attention."""

    def __init__(self, pool, timer: PhaseTimer):
        self.pool, self.timer = pool, timer

    def __call__(self, *args, **kwargs):
        self.timer.begin("merge")
        try:
            return self.pool(*args, **kwargs)
        finally:
            self.timer.end("merge")


def _apply(mode: MethodSpec, model, timer: PhaseTimer) -> None:
    """``mode.apply(model)``, ToDo's through ``apply_config`` with a timed downsampler (the core's public API)."""
    if mode.name not in ("todo", "todo-limit"):
        mode.apply(model)
        return
    import tokenmerge
    from tokenmerge.config import ToDoConfig

    from ..merge.downsample import downsample
    from ..tools.limits import slice_downsample

    pool = slice_downsample if mode.name == "todo-limit" else downsample
    tokenmerge.apply_config(model, ToDoConfig(downsample=mode.value, **mode.kwargs()),
                            downsampler=_TimedPooling(pool, timer))


def breakdown_cell(unet, preset, cell: Cell, modes: list[MethodSpec], repeats: int, device, dtype,
                   warmup: int = 1) -> list[dict]:
    """Time the phases inside the patched blocks (similarity, merge, attention, unmerge) for this library's
    methods, with the device synchronised at every phase boundary (so the total is slower than a normal step).
    ``tome:0`` runs the same blocks unmerged, as the reference. One record per method: medians per step."""
    own = [MethodSpec("tome", 0.0)] + [m for m in modes if m.name in OWN_METHODS]
    set_attention(unet, cell.attention, preset.family)
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device, frames=cell.frames)
    runs: dict[str, list[dict]] = {m.text: [] for m in own}
    for rep in range(warmup + repeats):
        for mode in own:
            timer = PhaseTimer(device)
            _apply(mode, unet, timer)
            try:
                attach(unet, timer)
                step(unet, inputs)
            finally:
                mode.remove(unet)
            if rep >= warmup:
                runs[mode.text].append(timer.totals())
    records = []
    for mode in own:
        phases = sorted({k for run in runs[mode.text] for k in run})
        medians = {k: statistics.median(run.get(k, 0.0) for run in runs[mode.text]) for k in phases}
        records.append(dict(asdict(cell), **record_fields(mode), phases_s=medians, runs=len(runs[mode.text])))
    return records
