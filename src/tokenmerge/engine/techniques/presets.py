"""``accelerate``'s presets, the one place their numbers live: per kind of denoiser and speed, the caches' schedule
the frontiers chose (``benchmarks/results/frontier/select/README.md``: chosen on seeds 0-1 of the trained testbeds on
the time grids of the pipelines they stand for; the held-out seeds' figures in docs/guides/step-cache.md and
unet-cache.md). The caches' configs take their defaults from the balanced points (``StepCacheConfig()`` is
``accelerate``'s balanced image setting, ``UNetCacheConfig()`` its UNet one).

The gap schedule (``schedule.py``): a step computed once the denoising progress since the last computed one passes
``gap + gap_growth x`` its progress; ``by_steps``: a generation of at most N steps takes that point instead (the image
transformer's balanced point at Flux.1-dev's 28 steps is not its best at 50)."""

from __future__ import annotations

__all__ = ["SPEEDS", "SCHEDULES", "COMMON", "UNET_CUT", "TOME_RATIOS"]

SPEEDS = ("faithful", "balanced", "fast")
SCHEDULES = {
    "image": {"faithful": dict(gap=0.02, gap_growth=0.1),
              "balanced": dict(gap=0.02, gap_growth=0.2, by_steps=((27, 0.02, 0.2), (30, 0.02, 0.3))),
              "fast": dict(gap=0.02, gap_growth=0.4)},
    "video": {"faithful": dict(gap=0.02, gap_growth=0.1), "balanced": dict(gap=0.02, gap_growth=0.3),
              "fast": dict(gap=0.02, gap_growth=0.5)},
    # UNets: rounds at the fast point (a UNet's solvers step uniformly in the timestep, so rounds carry across them)
    "unet": {"faithful": dict(gap=0.02, gap_growth=0.1), "balanced": dict(gap=0.04, gap_growth=0.1),
             "fast": dict(skip=1, skip_growth=1)},
}
COMMON = dict(warmup=3, extrapolate=0.7, min_steps=9)  # a generation of fewer than 9 steps (distilled) caches none
UNET_CUT = dict(depth=1, layers=0)  # a cached step runs conv_in, the last up block's last layer and conv_out
TOME_RATIOS = {"faithful": 0.3, "balanced": 0.5, "fast": 0.6}  # ToMe on a UNet the UNet cache cannot cut
