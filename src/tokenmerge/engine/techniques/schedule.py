"""Which steps of a generation the caches across steps (the step cache, the UNet cache) compute.

Three schedules, one per config (``Scheduled``): after ``warmup`` computed steps,

- ``gap`` (the default): a step is computed once the denoising progress (0 at pure noise, 1 at the end: the
  scheduler's timestep, ``1 - t / 1000``) since the last computed step exceeds ``gap + gap_growth x`` that step's
  progress: skipped runs span more of the denoising as it settles, whatever the time grid (a flow shift packs steps
  near the noise and stretches the late ones; steps count for what they travel, not one each);
- ``skip`` rounds: ``skip`` skipped steps then a computed one, each round ``skip_growth`` longer (counted in steps:
  right on the grid it was chosen on, wrong on another);
- ``mask``: a string of ``1`` (computed) and ``0`` (skipped) per step (static: what a calibration gives).
"""

from __future__ import annotations

import dataclasses
import numbers

__all__ = ["rounds", "check_schedule", "Scheduled"]


def rounds(step: int, warmup: int, skip: int, growth: int) -> bool:
    """Whether step ``step`` (0: the generation's first) is computed under ``skip`` rounds after ``warmup``.

    Example:
        >>> "".join("1" if rounds(k, 3, 1, 1) else "0" for k in range(12))
        '111010010001'
    """
    at = step - warmup + 1  # 1: the first step after the warm-up
    if at <= 0:
        return True
    length = end = skip + 1  # the rounds' computed steps fall at end = skip + 1, then each round longer
    while end < at:
        length += growth
        end += length
    return end == at


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """The fields a cache's config shares (its schedule, the slope's factor, the shortest generation that caches),
    validated when made, and what they say about a generation's steps. ``GAPS``: ``gap`` and ``gap_growth`` where
    none is given (the config's class sets them: ``accelerate``'s balanced point for its kind of denoiser);
    ``KEPT``: what the slope moves (the step cache's residual, the UNet cache's feature), in messages."""

    GAPS = (0.02, 0.2)
    KEPT = "residual"

    warmup: int = 3
    gap: float | None = None
    gap_growth: float | None = None
    skip: int | None = None
    skip_growth: int = 0
    mask: str | None = None
    extrapolate: float = 0.7
    min_steps: int = 9

    def __post_init__(self):
        check_schedule(self)

    @property
    def kind(self) -> str:
        """``"mask"``, ``"rounds"`` or ``"gap"``: the schedule in use."""
        return "mask" if self.mask is not None else "rounds" if self.skip is not None else "gap"

    def computes(self, step: int, progress: float | None = None, last: float | None = None) -> bool:
        """Whether step ``step`` (0: the generation's first) at ``progress`` is computed, the last computed step
        at ``last`` (``None``: none yet, or not told: computed)."""
        if self.mask is not None:
            return step >= len(self.mask) or self.mask[step] == "1"
        if step < self.warmup:
            return True
        if self.skip is not None:
            return rounds(step, self.warmup, self.skip, self.skip_growth)
        return progress is None or last is None or progress - last > self.gap + self.gap_growth * last

    def schedule(self, steps: int, shift: float = 1.0) -> list[bool]:
        """Whether each of ``steps`` steps is computed on Flux's time grid bent by ``shift`` (1: the linear grid)."""
        out, last = [], None
        for k in range(steps):
            sigma = 1.0 - k / steps
            progress = 1.0 - shift * sigma / (1.0 + (shift - 1.0) * sigma)
            computed = self.computes(k, progress, last)
            out.append(computed)
            last = progress if computed else last
        return out

    def words(self) -> str:
        """The settings as ``describe_patch`` gives them (``warmup=3 gap=0.02 gap_growth=0.2 extrapolate=0.7``), with
        the steps computed of 28 on the linear grid and on Flux's at shift 3 (of 28 and 50)."""
        words = f"warmup={self.warmup} " + (
            f"mask={self.mask}" if self.kind == "mask" else f"skip={self.skip} skip_growth={self.skip_growth}"
            if self.kind == "rounds" else f"gap={self.gap:g} gap_growth={self.gap_growth:g}")
        words += f" extrapolate={self.extrapolate:g}" + (f" min_steps={self.min_steps}" if self.min_steps else "")
        counts = [sum(self.schedule(n, s)) for n, s in ((28, 1.0), (28, 3.0), (50, 3.0))]
        return words + " (steps computed of 28 on a linear time grid: {}, shifted by 3: {}; of 50 shifted by 3: {})" \
            .format(*counts)

    def too_short(self, steps: int | None) -> bool:
        """Whether a generation of ``steps`` steps (``None``: not told) is below ``min_steps``: it caches none."""
        return bool(self.min_steps) and steps is not None and steps < self.min_steps


def _integer(config, name: str, low: int, what: str, optional: bool = False) -> None:
    value = getattr(config, name)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an integer >= {low} ({what}); got "
                         f"{value!r}")
    object.__setattr__(config, name, int(value))


def _fraction(config, name: str, what: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1] ({what}); got {value!r}")
    object.__setattr__(config, name, float(value))


def check_schedule(config) -> None:
    """Validate ``config``'s schedule and ``extrapolate`` (``ValueError`` naming the field; its ``KEPT``: what the
    slope moves, in the message), making the integers ``int`` and the numbers ``float``; with neither ``skip`` nor
    ``mask``, ``gap`` and ``gap_growth`` get their defaults (``GAPS``) where ``None``."""
    _fraction(config, "extrapolate", f"0: the kept {config.KEPT} held; 1: moved along its slope, first order")
    _integer(config, "min_steps", 0, "a generation of fewer steps, as a patched pipeline's scheduler tells, "
                                     "computes every step")
    _integer(config, "warmup", 1, "the computed steps that start each generation; the first fills the cache")
    _integer(config, "skip", 1, "the steps skipped in the first round after the warm-up", optional=True)
    _integer(config, "skip_growth", 0, "how many more steps each round skips than the one before")
    mask = config.mask
    if mask is not None and (not isinstance(mask, str) or not mask or mask[0] != "1" or set(mask) - {"0", "1"}):
        raise ValueError(f"mask must be None or a string of 1 (a computed step) and 0 (a skipped one) per step, "
                         f"starting with 1 (the first step fills the cache), e.g. '1111010010001'; got {mask!r}")
    given = {name for name, on in (("mask=", mask is not None), ("skip=", config.skip is not None),
                                   ("gap=", config.gap is not None or config.gap_growth is not None)) if on}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(sorted(given))}: give one schedule: mask= (static), skip= (rounds counted "
                         "in steps) or gap= / gap_growth= (the denoising progress a skipped run spans; the default)")
    if mask is None and config.skip is None:
        for name, default in zip(("gap", "gap_growth"), type(config).GAPS):
            if getattr(config, name) is None:
                object.__setattr__(config, name, default)
            _fraction(config, name, "the denoising progress (0 at pure noise, 1 at the end) a skipped step may lie "
                                    "past the last computed one is gap + gap_growth x that step's progress")
