"""Choosing the caches' schedules on the time grids real pipelines run: each schedule's PSNR to the unpatched model
(the same noise) on the selection seeds, with its computed steps; one JSON line per schedule on stdout.

    python scripts/select_grids.py mosaic 28 euler 3.16 0,1 gap=0.02,gap_growth=0.2 rule=uniform,every=3 ...
    python scripts/select_grids.py unet 25 dpm++2m - 0,1 gap=0.04,gap_growth=0.1 ...

Testbeds: ``mosaic`` (fashion-mosaic, 4 of its quality sentences a seed), ``video`` (fashion-video-long, two class
names a seed), ``unet`` (fashion-unet, ten class names). The scheduler and shift are ``fashion.schedulers``' (``-``:
none). A schedule is the config's keyword arguments (``gap=``, ``gap_growth=``, ``skip=``, ``warmup=``,
``extrapolate=``...: the cache's own schedules, counted as they ran), or one of the rules measured beside the gap
schedule, made into a static mask on the grid's sigmas: ``rule=uniform,every=N`` (a computed step every N after the
warm-up), ``rule=logsnr,gap=G`` (computed once log((1 - sigma) / sigma) moved G since the last computed step),
``rule=error,gap=G`` (computed once the sum over the skipped steps of their log-SNR distance times their length passes
G). Extrapolation 0.7 and warm-up 3 unless given.
"""

from __future__ import annotations

import json
import math
import sys

import torch

import tokenmerge
from tokenmerge.fashion import schedulers
from tokenmerge.quality.metrics import psnr
from tokenmerge.tools.peers import computed_share

CLASSES = [["a sneaker", "a bag"], ["a dress", "a shirt"], ["an ankle boot", "a coat"], ["a sandal", "a pullover"]]
UNET_PROMPTS = ["a sneaker", "a bag", "a dress", "a coat", "an ankle boot", "a shirt", "a sandal", "a pullover",
                "a trouser", "a t-shirt"]


def log_snr(sigma: float) -> float:
    sigma = min(max(sigma, 1e-6), 1 - 1e-6)
    return math.log((1 - sigma) / sigma)


def rule_mask(sigmas: list[float], rule: str, warmup: int, value: float) -> str:
    """A static mask on ``sigmas`` (the grid's, its end included) from one of the rules measured beside gap."""
    computed, last = [True] * warmup, warmup - 1
    for k in range(warmup, len(sigmas) - 1):
        if rule == "uniform":
            now = k - last >= value
        elif rule == "logsnr":
            now = log_snr(sigmas[k]) - log_snr(sigmas[last]) > value
        elif rule == "error":
            now = sum((log_snr(sigmas[j]) - log_snr(sigmas[last])) * (sigmas[j] - sigmas[j + 1])
                      for j in range(last + 1, k + 1)) > value
        else:
            raise ValueError(f"rule must be uniform, logsnr or error; got {rule!r}")
        computed.append(now)
        last = k if now else last
    return "".join("1" if c else "0" for c in computed)


def main(argv) -> int:
    which, steps, name, shift, seeds = argv[0], int(argv[1]), argv[2], argv[3], [int(x) for x in argv[4].split(",")]
    if which == "unet":
        from tokenmerge.fashion.pipeline import load_fashion_pipeline as load
    elif which == "mosaic":
        from tokenmerge.fashion.mosaic import load_fashion_mosaic as load
    else:
        from tokenmerge.fashion.video_long import load_fashion_video_long as load
    pipe = load()
    pipe.set_progress_bar_config(disable=True)
    schedulers.swap(pipe, name, None if shift == "-" else float(shift))
    prompts = {"unet": lambda s: UNET_PROMPTS, "mosaic": lambda s: pipe.prompts(4, seed=s),
               "video": lambda s: CLASSES[s]}[which]
    config_class = tokenmerge.UNetCacheConfig if which == "unet" else tokenmerge.StepCacheConfig
    extra = dict(depth=1, layers=0) if which == "unet" else {}

    def generate(seed):
        with torch.no_grad():
            return pipe(prompts(seed), num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                        output_type="pt").images

    refs = {s: generate(s) for s in seeds}
    scheduler = pipe.scheduler
    if type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler":  # the grid as the testbed samples it
        scheduler.set_timesteps(sigmas=[1.0 - k / steps for k in range(steps)])
    else:
        scheduler.set_timesteps(steps)
    sigmas = [float(t) / 1000 for t in scheduler.timesteps] + [0.0]
    for setting in argv[5:]:
        kw = {k: v for k, v in (kv.split("=", 1) for kv in setting.split(","))}
        rule = kw.pop("rule", None)
        kw = {k: (v if k == "mask" else float(v) if "." in v else int(v)) for k, v in kw.items()}
        kw.setdefault("extrapolate", 0.7)
        kw.setdefault("warmup", 3)
        if rule is not None:
            value = kw.pop("every", None) or kw.pop("gap")
            kw["mask"] = rule_mask(sigmas, rule, kw["warmup"], value)
        cfg = config_class(**kw, **extra, min_steps=0)
        tokenmerge.apply_config(pipe, cfg)
        try:
            values = torch.cat([psnr(generate(s), refs[s]) for s in seeds])
            computed = computed_share(pipe)["computed"] * steps
        finally:
            tokenmerge.remove_patch(pipe)
        print(json.dumps({"testbed": which, "steps": steps, "scheduler": schedulers.describe(pipe.scheduler),
                          "setting": setting, "seeds": seeds, "computed": round(computed, 1),
                          "psnr": round(values.mean().item(), 2), "min": round(values.min().item(), 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
