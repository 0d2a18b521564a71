"""Choosing the step cache's settings on the trained testbeds: each setting's PSNR to the unpatched model (the same
noise) on the selection seeds, with its computed steps; one JSON line per setting on stdout. The settings chosen
here are reported on other seeds by scripts/frontier_testbeds.sh (tokenmerge quality, held-out seeds 2-5).

    python scripts/select_step_cache.py mosaic 20 0,1 warmup=3,skip=1,skip_growth=1,extrapolate=0.7 ... > out.jsonl

Testbeds: ``mosaic`` (fashion-mosaic: 2 sentences a seed, the quality prompts of that seed) and ``video``
(fashion-video-long: two class names a seed). Each setting is ``StepCacheConfig``'s keyword arguments.
"""

import json
import sys

import torch

import tokenmerge
from tokenmerge.fashion.mosaic import load_fashion_mosaic
from tokenmerge.fashion.video_long import load_fashion_video_long
from tokenmerge.quality.metrics import psnr

CLASSES = [["a sneaker", "a bag"], ["a dress", "a shirt"], ["an ankle boot", "a coat"], ["a sandal", "a pullover"],
           ["a trouser", "a bag"], ["a sneaker", "a coat"]]


def sweep(pipe, denoiser, config_class, prompts, steps: int, seeds: list[int], settings: list[dict], extra=None):
    """Each setting's PSNR to the unpatched ``denoiser`` of ``pipe`` (the same noise; ``prompts(seed)``: a seed's
    prompts), one JSON line each on stdout with its computed steps and ``extra(config, computed)``'s fields."""
    def generate(seed):
        with torch.no_grad():
            return pipe(prompts(seed), num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                        output_type="pt").images

    refs = {s: generate(s) for s in seeds}
    for kw in settings:
        cfg = config_class(**{k: (v if k == "mask" else float(v) if "." in v else int(v)) for k, v in kw.items()})
        tokenmerge.apply_config(denoiser, cfg)
        try:
            values = torch.cat([psnr(generate(s), refs[s]) for s in seeds])
        finally:
            tokenmerge.remove_patch(denoiser)
        computed = sum(cfg.schedule(steps))
        row = {"setting": kw, "steps": steps, "seeds": seeds, "computed": computed,
               **(extra(cfg, computed) if extra else {}), "psnr": round(values.mean().item(), 2)}
        print(json.dumps(row), flush=True)


def main(argv) -> int:
    which, steps, seeds = argv[0], int(argv[1]), [int(x) for x in argv[2].split(",")]
    settings = [dict(kv.split("=", 1) for kv in s.split(",")) for s in argv[3:]]
    pipe = load_fashion_mosaic() if which == "mosaic" else load_fashion_video_long()

    def prompts(seed):
        return pipe.prompts(2, seed=seed) if which == "mosaic" else CLASSES[seed]

    sweep(pipe, pipe.transformer, tokenmerge.StepCacheConfig, prompts, steps, seeds, settings,
          lambda cfg, computed: {"counted_speedup": round(steps / computed, 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
