"""Choosing the UNet cache's settings on the trained fashion-unet: each setting's PSNR to the unpatched model (the same
noise) on the selection seeds, with its computed steps and, given the bench's measured cost of a cached step per
depth (a share of a computed step's time), its speed-up over the generation; one JSON line per setting on stdout. The
settings chosen here are reported on other seeds by ``tokenmerge quality`` (held-out seeds 2-5: docs/guides/
unet-cache.md).

    python scripts/select_unet_cache.py 20 0,1 --cost 1=0.45,2=0.8 depth=1,warmup=3,skip=2 ... > out.jsonl

The ten class names are the prompts of each seed (one batch, guidance as one batch of 2 x 10, as the pipeline runs
it). Each setting is ``UNetCacheConfig``'s keyword arguments.
"""

import json
import sys

import torch

import tokenmerge
from tokenmerge.fashion.model import CLASS_NAMES
from tokenmerge.fashion.pipeline import load_fashion_pipeline
from tokenmerge.quality.metrics import psnr


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

    def generate(seed):
        with torch.no_grad():
            return pipe(prompts, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                        output_type="pt").images

    refs = {s: generate(s) for s in seeds}
    for kw in settings:
        cfg = tokenmerge.UNetCacheConfig(**{k: (v if k == "mask" else float(v) if "." in v else int(v))
                                            for k, v in kw.items()})
        tokenmerge.apply_config(pipe.unet, cfg)
        try:
            values = torch.cat([psnr(generate(s), refs[s]) for s in seeds])
        finally:
            tokenmerge.remove_patch(pipe.unet)
        computed = sum(cfg.schedule(steps))
        row = {"setting": kw, "steps": steps, "seeds": seeds, "computed": computed,
               "psnr": round(values.mean().item(), 2)}
        if cfg.depth in cost:
            row["speedup"] = round(steps / (computed + (steps - computed) * cost[cfg.depth]), 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
