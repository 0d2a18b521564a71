"""Where a patched block's time goes: similarity, merge, attention, unmerge (``tokenmerge bench --breakdown``).

A ``PhaseTimer`` is attached to the installed patches (``attach``); their hooks call ``begin`` and ``end``
around each phase. Every boundary synchronises the device, so the phases add up to what the device spent, and
the step is slower than an untimed one: read the phases as shares, not as step times.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import asdict

import torch

from ..tools.methods import MethodSpec
from ..tools.timing import sync
from .cell import OWN_METHODS, Cell, record_fields, set_attention, step

__all__ = ["PhaseTimer", "attach", "breakdown_cell", "PHASES"]

# phase -> what it is; "self"/"cross"/"mlp"/"joint" are the wrapped sub-modules' own time
PHASES = {
    "block": "the patched transformer blocks, whole",
    "similarity": "building merge plans (metric, similarities, matching)",
    "merge": "merging inputs (and ToDo's pooling of keys/values)",
    "self": "self-attention",
    "joint": "joint attention (SD3/Flux)",
    "cross": "cross-attention",
    "mlp": "feed-forward",
    "unmerge": "unmerging outputs",
}


class PhaseTimer:
    """Seconds per phase, summed over the calls of ``begin(phase)`` / ``end(phase)``."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self._open: dict[str, float] = {}
        self._total: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def begin(self, phase: str) -> None:
        self._open[phase] = self._now()

    def end(self, phase: str) -> None:
        start = self._open.pop(phase, None)
        if start is not None:
            self._total[phase] += self._now() - start

    def totals(self) -> dict[str, float]:
        return dict(self._total)


def attach(model, timer: PhaseTimer | None) -> None:
    """Give every tokenmerge patch installed on ``model`` this timer (``None`` detaches), through the core's
    documented observer hook (``tokenmerge.observe``)."""
    import tokenmerge

    tokenmerge.observe(model, timer)


def breakdown_cell(unet, preset, cell: Cell, modes: list[MethodSpec], repeats: int, device, dtype,
                   warmup: int = 1) -> list[dict]:
    """Time the phases inside the patched blocks (similarity, merge, attention, unmerge) for this library's
    methods, with the device synchronised at every phase boundary (so the total is slower than a normal step).
    ``tome:0`` runs the same blocks unmerged, as the reference. One record per method: medians per step."""
    own = [MethodSpec("tome", 0.0)] + [m for m in modes if m.name in OWN_METHODS]
    set_attention(unet, cell.attention, preset.family)
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device)
    runs: dict[str, list[dict]] = {m.text: [] for m in own}
    for rep in range(warmup + repeats):
        for mode in own:
            timer = PhaseTimer(device)
            with mode.applied(unet):
                attach(unet, timer)
                step(unet, inputs)
            if rep >= warmup:
                runs[mode.text].append(timer.totals())
    records = []
    for mode in own:
        phases = sorted({k for run in runs[mode.text] for k in run})
        medians = {k: statistics.median(run.get(k, 0.0) for run in runs[mode.text]) for k in phases}
        records.append(dict(asdict(cell), **record_fields(mode), phases_s=medians, runs=len(runs[mode.text])))
    return records
