"""The merge alone: a plan's merge, unmerge and whole-block update with the torch kernels against the Triton ones
(``kernels="triton"``), at the token counts, widths and dtypes of the GPU table's image rows.

Per operation and shape, interleaved (torch, Triton, torch, Triton...) after a warm-up (Triton's compile, the
plan's index tables): the device time of one call (CUDA events around ``--calls`` calls in a row, median of
``--rounds``), and the host time to issue one (the same calls timed on the host before the synchronisation). A
random plan like ToMe 0.5's (half the tokens kept as slots, each slot at least one token). The GPU lane runs it in
its smoke (``scripts/gpu_lane.sh``); ``--device cpu`` runs the torch kernels alone, a check of the script.

    python benchmarks/merge_kernels.py --out benchmarks/results/gpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tokenmerge.merge import kernels_failed  # noqa: E402
from tokenmerge.merge.plan import MergePlan  # noqa: E402

# (name, batch, tokens, channels, dtype, text tokens before the image): the image rows' merged calls
SHAPES = (("Flux.1 1024 (whole-block)", 1, 4096, 3072, torch.bfloat16, 0),
          ("Flux.1 1024 (single-stream attention)", 1, 4096, 3072, torch.bfloat16, 512),
          ("PixArt-alpha 1024", 2, 4096, 1152, torch.float16, 0),
          ("Wan 2.1 480p x 81", 1, 32760, 1536, torch.bfloat16, 0))


def plan_for(tokens: int, device, kernels: str) -> MergePlan:
    slots = tokens // 2
    g = torch.Generator().manual_seed(0)
    dest = torch.cat([torch.arange(slots), torch.randint(0, slots, (tokens - slots,), generator=g)])
    plan = MergePlan(dest[torch.randperm(tokens, generator=g)].unsqueeze(0).to(device), slots)
    plan.kernels = kernels
    return plan


def timed(fn, calls: int, device) -> tuple[float, float]:
    """(device seconds, host seconds) per call of ``fn``."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        each = (time.perf_counter() - start) / calls
        return each, each
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1000 / calls, host


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="a folder for merge-kernels.md (printed as well)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here (--device cpu checks the script with the torch kernels alone)")
    names = ("torch", "triton") if device.type == "cuda" else ("torch",)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"## Merge kernels alone: torch against Triton ({where}, torch {torch.__version__})", "",
             f"`python benchmarks/merge_kernels.py --calls {args.calls} --rounds {args.rounds}`: per call, device "
             "time (CUDA events) / host time to issue it, in microseconds; median of the rounds. Random ToMe 0.5 "
             "plans, random data.", "",
             "| shape | operation | " + " | ".join(f"{n} device / host" for n in names) + " | device speed-up |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for label, batch, tokens, channels, dtype, before in SHAPES:
        dtype = dtype if device.type == "cuda" else torch.float32
        plans = {n: plan_for(tokens, device, n) for n in names}
        x = torch.randn(batch, before + tokens, channels, device=device, dtype=dtype)
        y = torch.randn(batch, before + tokens // 2, channels, device=device, dtype=dtype)
        merged = y[:, before:]
        ops = {"merge": lambda p: p.merge(x, before, 0), "unmerge": lambda p: p.unmerge(y, before, 0)}
        if not before:
            ops["x + unmerge(y - m)"] = lambda p: p.unmerge_update(y, merged, x)
        for op, fn in ops.items():
            runs = {n: [] for n in names}
            for n in names:  # warm-up: compile, tables
                fn(plans[n])
            for _ in range(args.rounds):
                for n in names:
                    runs[n].append(timed(lambda: fn(plans[n]), args.calls, device))
            medians = {n: (statistics.median(d for d, _ in runs[n]), statistics.median(h for _, h in runs[n]))
                       for n in names}
            cells = [f"{medians[n][0] * 1e6:.1f} / {medians[n][1] * 1e6:.1f}" for n in names]
            speed = f"{medians['torch'][0] / medians['triton'][0]:.2f}x" if "triton" in medians else "-"
            lines.append(f"| {label}, {batch} x {before + tokens} x {channels} {str(dtype)[6:]} | {op} | "
                         + " | ".join(cells) + f" | {speed} |")
    if kernels_failed():
        lines += ["", f"The Triton kernels failed ({kernels_failed()}): their columns are the torch fallback's."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "merge-kernels.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
