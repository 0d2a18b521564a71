"""The schedules a tune searches, and the steps each computes on a given time grid (known on the host before any
generation): the gap schedule over a lattice of ``gap`` and ``gap_growth`` at warm-ups 3, 2 and 4, and rounds counted
in steps. Settings that compute the same steps (the same mask) are one candidate: the first in the order of what the
committed frontiers found best for the kind of denoiser (``Candidate.prior``)."""

from __future__ import annotations

import dataclasses

__all__ = ["Candidate", "candidates", "GROWTHS"]

GROWTHS = tuple(round(0.05 * k, 2) for k in range(17))  # gap_growth 0 to 0.8
_GAPS = {"transformer": (0.02, 0.03, 0.015, 0.025, 0.01, 0.04), "unet": (0.04, 0.02, 0.03, 0.015, 0.05, 0.01)}


@dataclasses.dataclass(eq=False)
class Candidate:
    """One schedule: its config fields (``setting``), the steps it computes on the tuned grid (``mask``: ``1``
    computed, ``0`` skipped), its rank among the settings (``prior``: lower first), and what was measured of it."""

    setting: dict
    mask: str
    prior: int
    calibration: list = dataclasses.field(default_factory=list)  # PSNR per calibration item
    held_out: list = dataclasses.field(default_factory=list)  # PSNR per held-out item
    seconds: list = dataclasses.field(default_factory=list)  # seconds per generation
    ran: int | None = None  # the steps the cache computed, by its own count (per call of a step)

    @property
    def computed(self) -> int:
        return self.mask.count("1")

    @property
    def score(self) -> float | None:
        """The mean calibration PSNR, ``None`` before it was measured."""
        return sum(self.calibration) / len(self.calibration) if self.calibration else None

    def words(self) -> str:
        """The setting as ``gap=0.02 gap_growth=0.3 warmup=3`` (what ``describe_patch`` and the report say)."""
        return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.setting.items())


def _settings(kind: str):
    """Every setting searched, best first by what the frontiers found for ``kind`` (``transformer`` or ``unet``)."""
    gaps = _GAPS[kind]
    rounds = [dict(warmup=w, skip=s, skip_growth=g) for w in (3, 2, 4) for s in (1, 2, 3) for g in (1, 0, 2)]
    tiers = [(3, gaps[:2]), (None, None), (3, gaps[2:]), (2, gaps), (4, gaps)]
    for warmup, tier in tiers:
        if warmup is None:  # rounds after the warm-up 3 gap settings the frontiers chose (UNets: among them)
            yield from rounds
            continue
        for gap in tier:
            for growth in GROWTHS:
                yield dict(warmup=warmup, gap=gap, gap_growth=growth)


def candidates(config_class, base: dict, progress, kind: str) -> list[Candidate]:
    """The distinct schedules of ``config_class`` (``base``: its other fields) on the grid whose steps stand at
    ``progress``, each with the steps it computes, sorted by computed steps and then by ``prior``. A schedule that
    computes every step (no faster than the unpatched model) is left out."""
    seen: dict[str, Candidate] = {}
    steps = len(progress)
    for prior, setting in enumerate(_settings(kind)):
        config = config_class(**{**base, **setting})
        mask = "".join("1" if c else "0" for c in config.on_grid(progress))
        if mask.count("1") < steps and mask not in seen:
            seen[mask] = Candidate(setting, mask, prior)
    return sorted(seen.values(), key=lambda c: (c.computed, c.prior))
