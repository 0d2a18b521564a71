"""Where a patched block's time goes: similarity, merge, attention, unmerge (``tokenmerge bench --breakdown``).

A ``PhaseTimer`` is attached to the installed patches (``DenoiserPatch.timer``); their hooks call ``begin`` and
``end`` around each phase. Every boundary synchronises the device, so the phases add up to what the device
spent, and the step is slower than an untimed one: read the phases as shares, not as step times.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

__all__ = ["PhaseTimer", "attach", "PHASES"]

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
    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self._open: dict[str, float] = {}
        self._total: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        from .runner import _sync

        _sync(self.device)
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
    """Give every tokenmerge patch installed on ``model`` this timer (``None`` detaches)."""
    from ..patch import _patches

    for patch in _patches(model):
        patch.timer = timer
