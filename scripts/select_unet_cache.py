"""Choosing the UNet cache's settings on the trained fashion-unet: each setting's PSNR to the unpatched model (the same
noise) on the selection seeds, with its computed steps and, given the bench's measured cost of a cached step per
depth (a share of a computed step's time), its speed-up over the generation; one JSON line per setting on stdout. The
settings chosen here are reported on other seeds by ``tokenmerge quality`` (held-out seeds 2-5: docs/guides/
unet-cache.md).

    python scripts/select_unet_cache.py 20 0,1 --cost 1=0.45,2=0.8 depth=1,warmup=3,skip=2 ... > out.jsonl

The ten class names are the prompts of each seed (one batch, guidance as one batch of 2 x 10, as the pipeline runs
it). Each setting is ``UNetCacheConfig``'s keyword arguments.
"""

import sys

from select_step_cache import sweep

import tokenmerge
from tokenmerge.fashion.model import CLASS_NAMES
from tokenmerge.fashion.pipeline import load_fashion_pipeline


def main(argv) -> int:
    steps, seeds = int(argv[0]), [int(x) for x in argv[1].split(",")]
    argv = argv[2:]
    cost = {}
    if argv and argv[0] == "--cost":
        cost = {int(k): float(v) for k, v in (kv.split("=") for kv in argv[1].split(","))}
        argv = argv[2:]
    settings = [dict(kv.split("=", 1) for kv in s.split(",")) for s in argv]
    pipe = load_fashion_pipeline()
    pipe.set_progress_bar_config(disable=True)
    prompts = [f"a {name.lower()}" for name in CLASS_NAMES]

    def speed(cfg, computed):
        if cfg.depth not in cost:
            return {}
        return {"speedup": round(steps / (computed + (steps - computed) * cost[cfg.depth]), 3)}

    sweep(pipe, pipe.unet, tokenmerge.UNetCacheConfig, lambda seed: prompts, steps, seeds, settings, speed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
