"""Quick start: `tokenmerge.accelerate` on a pipeline shipped inside tokenmerge (offline, no download).

    .venv/bin/python examples/quickstart.py

The model is the embedded mosaic DiT: a diffusers FluxTransformer2DModel (Flux.1's layout, small: 1,024 image and
32 text tokens per call; diffusers >= 0.30) trained on Fashion-MNIST mosaics, so its images are real ones, sampled as
Flux.1-dev samples at 1024 px (28 steps, flow-matching Euler shifted by e^1.15). On it `accelerate` takes the step
cache. Wall times of a small model on a CPU say little about a full-size one on a GPU.
"""

import sys
import time

import torch

import tokenmerge
from tokenmerge.fashion.mosaic import load_fashion_mosaic
from tokenmerge.quality.metrics import psnr

PROMPTS = ["a bag at the top left and a sneaker at the bottom right", "a dress at the top right"]


def generate(pipe, steps):
    """The prompts' images from fixed noise, and the wall time."""
    start = time.perf_counter()
    images = pipe(PROMPTS, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                  output_type="pt").images
    return images, time.perf_counter() - start


def main(steps: int = 28) -> dict:
    pipe = load_fashion_mosaic()
    generate(pipe, 2)  # a warm-up: the first call of a process pays one-time costs
    vanilla, t_vanilla = generate(pipe, steps)

    tokenmerge.accelerate(pipe)  # the setting for the model (speed="balanced"): on a transformer, the step cache
    print(tokenmerge.describe_patch(pipe))
    fast, t_fast = generate(pipe, steps)
    quality = psnr(fast, vanilla)
    print(f"PSNR to the unpatched images: {', '.join(f'{q:.1f}' for q in quality.tolist())} dB")
    print(f"wall time, {steps} steps x {len(PROMPTS)} prompts: unpatched {t_vanilla:.2f} s, "
          f"accelerate {t_fast:.2f} s ({t_vanilla / t_fast:.2f}x)")

    tokenmerge.remove_patch(pipe)
    restored = torch.equal(generate(pipe, steps)[0], vanilla)
    print(f"after remove_patch, outputs equal the unpatched ones: {restored}")
    return dict(psnr=quality, restored=restored, vanilla_s=t_vanilla, accelerate_s=t_fast)


if __name__ == "__main__":
    result = main(int(sys.argv[1]) if len(sys.argv) > 1 else 28)
    sys.exit(0 if result["restored"] else 1)
