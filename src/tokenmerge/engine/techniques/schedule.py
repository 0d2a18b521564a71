"""Which steps of a generation the caches across steps (the step cache, the UNet cache) compute.

Three schedules, one per config (``Scheduled``): after ``warmup`` computed steps,

- ``gap`` (the default): a step is computed once the denoising progress (0 at pure noise, 1 at the end: the
  scheduler's timestep, ``1 - t / 1000``) since the last computed step exceeds ``gap + gap_growth x`` that step's
  progress: skipped runs span more of the denoising as it settles, whatever the time grid (a flow shift packs steps
  near the noise and stretches the late ones; steps count for what they travel, not one each);
- ``skip`` rounds: ``skip`` skipped steps then a computed one, each round ``skip_growth`` longer (counted in steps:
  right on the grid it was chosen on, wrong on another);
- ``mask``: a string of ``1`` (computed) and ``0`` (skipped) per step (static: what a calibration gives).

The gap schedule's point may follow the generation's step count (``by_steps``: ``accelerate``'s presets): its best
``gap_growth`` at 28 steps is not its best at 50.
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
    validated when made, and what they say about a generation's steps. ``DEFAULT``: the schedule where none is given
    (the config's class sets it: ``accelerate``'s balanced point for its kind of denoiser, ``presets.py``); ``KEPT``:
    what the slope moves (the step cache's residual, the UNet cache's feature), in messages.

    Fields:
        warmup: computed steps at the start of each generation (at least 1: the first fills the cache).
        gap, gap_growth: the gap schedule (the default): a step is computed once the denoising progress (0 at pure
            noise, 1 at the end) since the last computed one exceeds ``gap + gap_growth x`` that one's progress.
        skip, skip_growth: rounds counted in steps instead: ``skip`` skipped steps and a computed one, each round
            ``skip_growth`` longer (right on the time grid they were chosen on only).
        mask: a static schedule instead: ``1`` (computed) and ``0`` (skipped) per step, starting with 1.
        extrapolate: the slope's factor in [0, 1] (0.7; 1: first order, as TaylorSeer; 0: the kept value held).
        min_steps: a generation of fewer steps (a distilled model's, as a pipeline tells) computes every step.
        by_steps: ``((N, gap, gap_growth), ...)``: a generation of at most N steps takes that gap point (``None``:
            the class's default where the schedule is its default, else none).
    """

    DEFAULT = {"gap": 0.02, "gap_growth": 0.2}
    KEPT = "residual"

    warmup: int = 3
    gap: float | None = None
    gap_growth: float | None = None
    skip: int | None = None
    skip_growth: int = 0
    mask: str | None = None
    extrapolate: float = 0.7
    min_steps: int = 9
    by_steps: tuple | None = None

    def __post_init__(self):
        check_schedule(self)

    @property
    def kind(self) -> str:
        """``"mask"``, ``"rounds"`` or ``"gap"``: the schedule in use."""
        return "mask" if self.mask is not None else "rounds" if self.skip is not None else "gap"

    def gaps(self, steps: int | None = None) -> tuple[float, float]:
        """``(gap, gap_growth)`` for a generation of ``steps`` steps (``None``: not told): the first ``by_steps``
        point that covers it, else the config's own."""
        for most, gap, growth in self.by_steps:
            if steps is not None and steps <= most:
                return gap, growth
        return self.gap, self.gap_growth

    def bands(self) -> list[tuple[str, float, float]]:
        """``by_steps`` as ``(span, gap, gap_growth)`` where it differs from the config's own point (``"28-30"``)."""
        out, low = [], 1
        for most, gap, growth in self.by_steps:
            if (gap, growth) != (self.gap, self.gap_growth):
                out.append((f"{low}-{most}" if low < most else f"{most}", gap, growth))
            low = most + 1
        return out

    def computes(self, step: int, progress: float | None = None, last: float | None = None,
                 steps: int | None = None) -> bool:
        """Whether step ``step`` (0: the generation's first) at ``progress`` is computed, the last computed step
        at ``last`` (``None``: none yet, or not told: computed), in a generation of ``steps`` steps."""
        if self.mask is not None:
            return step >= len(self.mask) or self.mask[step] == "1"
        if step < self.warmup:
            return True
        if self.skip is not None:
            return rounds(step, self.warmup, self.skip, self.skip_growth)
        if progress is None or last is None:
            return True
        gap, growth = self.gaps(steps)
        return progress - last > gap + growth * last

    def on_grid(self, progress) -> list[bool]:
        """Whether each step of a generation whose steps stand at ``progress`` (0 at pure noise, one per step, as
        ``steps.host_progress`` reads a scheduler's) is computed: known on the host before the generation."""
        out, last = [], None
        for k, at in enumerate(progress):
            computed = self.computes(k, at, last, len(progress))
            out.append(computed)
            last = at if computed else last
        return out

    def schedule(self, steps: int, shift: float = 1.0) -> list[bool]:
        """Whether each of ``steps`` steps is computed on Flux's time grid bent by ``shift`` (1: the linear grid)."""
        sigmas = [1.0 - k / steps for k in range(steps)]
        return self.on_grid([1.0 - shift * s / (1.0 + (shift - 1.0) * s) for s in sigmas])

    def setting_words(self) -> str:
        """The settings in words: ``warmup=3 gap=0.02 gap_growth=0.2 extrapolate=0.7``."""
        words = f"warmup={self.warmup} " + (
            f"mask={self.mask}" if self.kind == "mask" else f"skip={self.skip} skip_growth={self.skip_growth}"
            if self.kind == "rounds" else f"gap={self.gap:g} gap_growth={self.gap_growth:g}" + "".join(
                f" ({span} steps: gap={g:g} gap_growth={r:g})" for span, g, r in self.bands()))
        return words + f" extrapolate={self.extrapolate:g}" + (f" min_steps={self.min_steps}" if self.min_steps else "")

    def words(self) -> str:
        """The settings as ``describe_patch`` gives them (``setting_words``), with the steps computed of 28 on the
        linear grid and on Flux's at shift 3 (of 28 and 50)."""
        counts = [sum(self.schedule(n, s)) for n, s in ((28, 1.0), (28, 3.0), (50, 3.0))]
        return self.setting_words() + " (steps computed of 28 on a linear time grid: {}, shifted by 3: {}; of 50 " \
            "shifted by 3: {})".format(*counts)

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
    ``mask``, ``gap`` and ``gap_growth`` get their defaults (``DEFAULT``) where ``None``, and ``by_steps`` too where the
    whole schedule is the default."""
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
    default = type(config).DEFAULT
    if config.by_steps is None:  # the class's points by step count go with its default schedule only
        untold = mask is None and config.skip is None and config.gap is None and config.gap_growth is None
        object.__setattr__(config, "by_steps", default.get("by_steps", ()) if untold else ())
    _points(config)
    if mask is None and config.skip is None:
        for name in ("gap", "gap_growth"):
            if getattr(config, name) is None:
                object.__setattr__(config, name, default[name])
            _fraction(config, name, "the denoising progress (0 at pure noise, 1 at the end) a skipped step may lie "
                                    "past the last computed one is gap + gap_growth x that step's progress")


def _points(config) -> None:
    """Validate ``by_steps`` (a tuple of ``(N, gap, gap_growth)`` by rising ``N``, with the gap schedule only),
    made a tuple of tuples (a JSON file's lists are taken)."""
    points = config.by_steps
    what = ("by_steps must be a sequence of (N, gap, gap_growth) points by rising N (an integer >= 1; gap and "
            "gap_growth numbers in [0, 1]): a generation of at most N steps takes that point, e.g. ((36, 0.02, 0.3),)")
    if not isinstance(points, (tuple, list)):
        raise ValueError(f"{what}; got {points!r}")
    out = []
    for point in points:
        if not isinstance(point, (tuple, list)) or len(point) != 3 or isinstance(point[0], bool) or \
                not isinstance(point[0], numbers.Integral) or point[0] < 1 or (out and point[0] <= out[-1][0]) or \
                not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 <= v <= 1.0
                        for v in point[1:]):
            raise ValueError(f"{what}; got {points!r}")
        out.append((int(point[0]), float(point[1]), float(point[2])))
    if out and (config.mask is not None or config.skip is not None):
        raise ValueError(f"by_steps applies to the gap schedule; got it with {'mask=' if config.mask else 'skip='}")
    object.__setattr__(config, "by_steps", tuple(out))
