"""Which steps of a generation a cache across steps computes (the step cache, the UNet cache): a warm-up, then
rounds of skipped steps each ended by a computed one, the rounds growing; or a static mask. No model here."""

from __future__ import annotations

import numbers

__all__ = ["computed", "check_schedule", "Scheduled"]


def computed(step: int, warmup: int, skip: int, growth: int, mask: str | None = None) -> bool:
    """Whether step ``step`` of a generation (0: its first) is computed: the first ``warmup`` steps are, then rounds
    of skipped steps each ended by a computed one, the first round ``skip`` skipped steps and each round after it
    ``growth`` more; with a ``mask``, its ``step``-th character is ``"1"`` (steps past its end are computed).

    Example:
        >>> "".join("1" if computed(k, 3, 1, 1) else "0" for k in range(12))
        '111010010001'
    """
    if mask is not None:
        return step >= len(mask) or mask[step] == "1"
    at = step - warmup + 1  # 1: the first step after the warm-up
    if at <= 0:
        return True
    length = end = skip + 1  # the rounds' computed steps fall at end = skip + 1, then each round longer
    while end < at:
        length += growth
        end += length
    return end == at


class Scheduled:
    """What a cache's config (with ``warmup``, ``skip``, ``skip_growth``, ``mask``, ``min_steps``) says about a
    generation's steps."""

    __slots__ = ()

    def computed(self, step: int) -> bool:
        """Whether step ``step`` of a generation (0: its first) is computed (``computed`` above)."""
        return computed(step, self.warmup, self.skip, self.skip_growth, self.mask)

    def schedule(self, steps: int) -> list[bool]:
        """Whether each of ``steps`` steps is computed (``True``) or not."""
        return [self.computed(k) for k in range(steps)]

    def words(self) -> str:
        """The settings as ``describe_patch`` gives them: ``warmup=3 skip=1 skip_growth=1 extrapolate=0.7 (steps
        computed of 20: 7, of 50: 11)``, with ``mask=`` and ``min_steps=`` where set."""
        words = f"warmup={self.warmup} skip={self.skip} skip_growth={self.skip_growth}"
        words += f" extrapolate={self.extrapolate:g}"
        words += f" mask={self.mask}" if self.mask else ""
        words += f" min_steps={self.min_steps}" if self.min_steps else ""
        return words + f" (steps computed of 20: {sum(self.schedule(20))}, of 50: {sum(self.schedule(50))})"

    def too_short(self, steps: int | None) -> bool:
        """Whether a generation of ``steps`` steps (``None``: not told) is below ``min_steps``: it caches none."""
        return bool(self.min_steps) and steps is not None and steps < self.min_steps


def check_schedule(config, kept: str) -> None:
    """Validate ``config``'s ``warmup``, ``skip``, ``skip_growth``, ``mask``, ``min_steps`` and ``extrapolate``
    (``ValueError`` naming the field; ``kept``: what the slope moves, in its message), making the integers ``int``
    and ``extrapolate`` a ``float``."""
    ex = config.extrapolate
    if isinstance(ex, bool) or not isinstance(ex, numbers.Real) or not 0.0 <= float(ex) <= 1.0:
        raise ValueError(f"extrapolate must be a number in [0, 1] (0: the kept {kept} held; 1: moved along its "
                         f"slope, first order); got {ex!r}")
    object.__setattr__(config, "extrapolate", float(ex))
    m = config.min_steps
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
        raise ValueError(f"min_steps must be an integer >= 0 (a generation of fewer steps, as a patched pipeline's "
                         f"scheduler tells, computes every step); got {m!r}")
    object.__setattr__(config, "min_steps", int(m))
    for name, low, what in (("warmup", 1, "the computed steps that start each generation; the first fills the "
                             "cache"), ("skip", 1, "the steps skipped in the first round after the warm-up"),
                            ("skip_growth", 0, "how many more steps each round skips than the one before")):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{name} must be an integer >= {low} ({what}); got {value!r}")
        object.__setattr__(config, name, int(value))
    mask = config.mask
    if mask is not None and (not isinstance(mask, str) or not mask or mask[0] != "1" or set(mask) - {"0", "1"}):
        raise ValueError(f"mask must be None or a string of 1 (a computed step) and 0 (a skipped one) per step, "
                         f"starting with 1 (the first step fills the cache), e.g. '1111010010001'; got {mask!r}")
