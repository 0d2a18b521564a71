"""Before/after the engine rewrite: the same model, the same inputs, the old and the new tokenmerge interleaved in one
process (A, B, A, B...), step medians and their ratio, plus each one's time inside the patched blocks.

The old package is the tree at commit 2e38ce6 imported as ``tokenmerge_old`` (its imports are relative):

    mkdir -p /tmp/oldpkg && git archive 2e38ce6 src/tokenmerge | tar -x -C /tmp/oldpkg \
        && mv /tmp/oldpkg/src/tokenmerge /tmp/oldpkg/tokenmerge_old
    PYTHONPATH=/tmp/oldpkg .venv/bin/python benchmarks/engine_before_after.py --preset sd15 --resolution 768 --rounds 4

Random weights (bench presets), fp32, CPU; the timings say whether the engine costs anything, not what a GPU gets.
"""

from __future__ import annotations

import argparse
import statistics
import time

import tokenmerge_old
import torch

import tokenmerge
from tokenmerge.bench.presets import PRESETS


class Timer:
    """begin/end phase totals (the block phase only: what the patched blocks cost)."""

    def __init__(self):
        self.open, self.total = {}, {}

    def begin(self, phase):
        self.open[phase] = time.perf_counter()

    def end(self, phase):
        start = self.open.pop(phase, None)
        if start is not None:
            self.total[phase] = self.total.get(phase, 0.0) + time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="sd15")
    p.add_argument("--resolution", type=int, default=768)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.5)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    model = preset.build(torch.float32)
    inputs = preset.inputs(1, args.resolution, torch.float32, torch.device("cpu"))
    from tokenmerge.bench.cell import set_attention

    set_attention(model, "sdpa", preset.family)
    key = "sample" if "sample" in inputs else "hidden_states"

    @torch.no_grad()
    def step():
        rest = {k: v for k, v in inputs.items() if k != key}
        start = time.perf_counter()
        out = model(inputs[key], **rest) if key == "sample" else model(**inputs)
        return time.perf_counter() - start, out

    def old_apply():
        tokenmerge_old.apply_patch(model, ratio=args.ratio)

    def new_apply():
        tokenmerge.apply_patch(model, ratio=args.ratio)

    modes = {"vanilla": (lambda: None, lambda: None),
             "old": (old_apply, lambda: tokenmerge_old.remove_patch(model)),
             "new": (new_apply, lambda: tokenmerge.remove_patch(model))}
    times = {m: [] for m in modes}
    blocks = {m: [] for m in ("old", "new")}
    outs = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (apply, remove) in modes.items():
            apply()
            seconds, out = step()
            remove()
            if r:
                times[name].append(seconds)
            outs[name] = out[0] if isinstance(out, tuple) else out.sample
        for name, (apply, remove) in (("old", modes["old"]), ("new", modes["new"])):  # the blocks' own time
            apply()
            timer = Timer()
            patches = tokenmerge_old.patch._patches(model) if name == "old" else None
            if name == "old":
                for patch in patches:
                    patch.timer = timer
            else:
                tokenmerge.observe(model, timer)
            step()
            remove()
            if r:
                blocks[name].append(timer.total.get("block", 0.0))
    same = torch.equal(outs["old"], outs["new"])
    med = {k: statistics.median(v) for k, v in times.items()}
    bmed = {k: statistics.median(v) for k, v in blocks.items()}
    print(f"| {args.preset} {args.resolution}px batch 1 (CFG 2), ToMe {args.ratio}, {args.rounds} rounds | "
          f"vanilla {med['vanilla']:.2f} s | old {med['old']:.2f} s | new {med['new']:.2f} s | "
          f"new/old step {med['new'] / med['old']:.3f} | blocks old {bmed['old']:.2f} s new {bmed['new']:.2f} s "
          f"(new/old {bmed['new'] / bmed['old']:.3f}) | outputs identical: {same} |")
    print("per-round step seconds:", {k: [round(x, 2) for x in v] for k, v in times.items()})
    print("per-round block seconds:", {k: [round(x, 2) for x in v] for k, v in blocks.items()})


if __name__ == "__main__":
    main()
