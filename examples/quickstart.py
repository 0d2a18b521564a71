"""Quick start on a tiny random-weight UNet (no download): patch, check, time, remove.

    .venv/bin/python examples/quickstart.py

Random weights give real timings, not images; `tokenmerge demo` (a trained model) is where images come from.
"""

import statistics
import time

import torch
from diffusers import UNet2DConditionModel

import tokenmerge

torch.manual_seed(0)
# SD 1.x layout (attention from the first level) at a small width: a 64x64 latent (a 512x512 image).
unet = UNet2DConditionModel(
    block_out_channels=(64, 128), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1, cross_attention_dim=64,
    attention_head_dim=8, sample_size=64,
).eval()
inputs = dict(sample=torch.randn(2, 4, 64, 64), timestep=torch.tensor(500),
              encoder_hidden_states=torch.randn(2, 77, 64))


@torch.no_grad()
def step():
    return unet(**inputs).sample


vanilla = step()
tokenmerge.apply_patch(unet, ratio=0.5)
print(tokenmerge.describe_patch(unet))
merged = step()
print(f"max |patched - vanilla| = {(merged - vanilla).abs().max():.4f} (the patch acts)")

times = {"vanilla": [], "tokenmerge 0.5": []}
for i in range(4):  # interleaved A, B, A, B; the first round is a warm-up
    for name in times:
        (tokenmerge.remove_patch if name == "vanilla" else lambda m: tokenmerge.apply_patch(m, ratio=0.5))(unet)
        start = time.perf_counter()
        step()
        if i:
            times[name].append(time.perf_counter() - start)
base = statistics.median(times["vanilla"])
for name, ts in times.items():
    print(f"{name:>15}: {statistics.median(ts) * 1000:7.1f} ms per UNet step  ({base / statistics.median(ts):.2f}x)")

tokenmerge.remove_patch(unet)
assert torch.equal(step(), vanilla)
print("removed: outputs are bit-identical to the unpatched UNet")
