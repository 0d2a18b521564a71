"""What a tuned setting was measured on (``tokenmerge.tune``), checked at each generation's first call: a generation at
another step count, scheduler, shift or size runs, its schedule following its own time grid, with one warning per
cause (its fidelity was verified on the tuned generation only)."""

from __future__ import annotations

import dataclasses
import warnings

__all__ = ["TunedFor", "TunedSettingWarning", "scheduler_words", "SCHEDULER_KEYS"]

# the scheduler settings that move a time grid or the solver (what a tuned schedule's fidelity depends on)
SCHEDULER_KEYS = ("shift", "flow_shift", "use_dynamic_shifting", "use_flow_sigmas", "prediction_type",
                  "algorithm_type", "solver_order", "timestep_spacing", "use_karras_sigmas", "thresholding")


class TunedSettingWarning(UserWarning):
    """A generation runs at another step count, scheduler, shift or size than its tuned setting was verified on."""


def scheduler_words(scheduler) -> dict:
    """A scheduler's class and the settings of it that move the time grid (``SCHEDULER_KEYS``), JSON-ready."""
    config = getattr(scheduler, "config", None) or {}
    out = {"class": type(scheduler).__name__}
    for key in SCHEDULER_KEYS:
        value = config.get(key) if hasattr(config, "get") else None
        if isinstance(value, (bool, int, float, str)):
            out[key] = round(value, 6) if isinstance(value, float) else value
    return out


def _said(words: dict) -> str:
    """``FlowMatchEulerDiscreteScheduler (shift 3.16)``: the class and what of its grid is not the default."""
    flow = words.get("use_flow_sigmas") or "FlowMatch" in words.get("class", "")
    said = [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in words.items() if
            (k == "shift" and flow and not words.get("use_dynamic_shifting")) or (k == "flow_shift" and flow) or
            (k == "use_dynamic_shifting" and v is True) or (k == "algorithm_type")]
    return words.get("class", "?") + (f" ({', '.join(said)})" if said else "")


@dataclasses.dataclass
class TunedFor:
    """The generation a setting was tuned for: its ``steps``, its scheduler (``scheduler_words``), the denoiser's
    sample shape without the batch (the size, and the frames of a video), and ``words``: all of it for messages."""

    steps: int
    scheduler: dict
    sample: tuple | None
    words: str
    generation: int = -1
    warned: set = dataclasses.field(default_factory=set)

    def check_call(self, calls, state, args, kwargs) -> None:
        """``check`` for a call of ``calls`` (the patch's ``CallHook``) with its arguments."""
        pipe = calls.pipeline() if calls.pipeline is not None else None
        site = calls.patch.site
        x = calls.sample.read(args, kwargs) if calls.sample is not None else None
        self.check(state.clock, x, getattr(pipe, "scheduler", None), site.path or type(site.module).__name__)

    def check(self, clock, sample, scheduler, name: str) -> None:
        """At a generation's first call (``clock``), warn once per cause where it runs another step count
        (``clock.steps``), scheduler or size (``sample``: the denoiser's input) than tuned for."""
        if clock.generation == self.generation:
            return
        self.generation = clock.generation
        causes = []
        if clock.steps is not None and clock.steps != self.steps:
            causes.append(("steps", f"{clock.steps} steps"))
        if scheduler is not None:
            got = scheduler_words(scheduler)
            if got != self.scheduler:
                causes.append(("scheduler", f"the scheduler {_said(got)}"))
        shape = tuple(sample.shape[1:]) if hasattr(sample, "shape") else None
        if shape is not None and self.sample is not None and shape != tuple(self.sample):
            causes.append(("size", f"a sample of {' x '.join(map(str, shape))}"))
        for cause, text in causes:
            if cause in self.warned:
                continue
            self.warned.add(cause)
            warnings.warn(f"tokenmerge: {name}: this generation runs at {text}, not as its tuned setting was tuned "
                          f"and verified ({self.words}); it runs, its schedule following this generation's time "
                          "grid, but its fidelity was not measured here: tune it for this generation "
                          "(tokenmerge.tune or `tokenmerge tune`)", TunedSettingWarning, stacklevel=5)

    @staticmethod
    def describe(steps: int, scheduler: dict, sample) -> str:
        """``28 steps, FlowMatchEulerDiscreteScheduler (shift 3.16), sample 4 x 32 x 32``."""
        size = f", sample {' x '.join(map(str, sample))}" if sample else ""
        return f"{steps} steps, {_said(scheduler)}{size}"
