"""Kernels launched per denoiser step, vanilla against each method: the cost that decides eager speed on a GPU.

Counts the backend operators a step dispatches (``tokenmerge.bench.kernels.count_kernels``: on CUDA nearly each is
one kernel launch; views and allocations left out), after a warm-up step (cached index tables built), on a bench
preset with RANDOM weights. By default the code paths a CUDA call takes are run on whatever device is used
(``apply_config(..., code_paths="cuda")``), so a CPU run counts what an H100 run launches; ``--cpu-paths``
counts the CPU's own paths. ``--blocks`` keeps that many blocks of each stack (REDUCED; the count per merged block
does not depend on it, the per-call part is then shared by fewer blocks). ``--narrow`` builds the preset with
2 or 3 heads of 16 channels and narrow text and feed-forward widths (the UNet: a tenth of its channels) at the same
token counts: the same operators in the same order, a small fraction of the arithmetic (the counts at real widths
and narrowed are compared in ``benchmarks/results/kernels/README.md``).

    .venv/bin/python benchmarks/kernels_per_call.py --preset pixart --resolution 1024 --blocks 7 \\
        --methods tome:0.5 tome:0.5,match_radius=None tome:0.5,scope=block tome:0.5,share_plans=true todo:2

Prints a Markdown table: kernels per step, the ratio to vanilla, the extra kernels per merged block, host syncs.
An older tokenmerge (e.g. a ``git worktree`` of an earlier commit on ``PYTHONPATH``) runs the same script: its
process-wide ``code_paths`` switch where it has one (9c0ff4f..38762b8), none before (one path for every device).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import subprocess
import sys

import torch

import tokenmerge
from tokenmerge.bench.cell import set_attention, step
from tokenmerge.bench.kernels import count_kernels
from tokenmerge.bench.presets import resolve
from tokenmerge.tools.methods import parse_spec


def _resolution(text: str):
    return int(text) if text.isdigit() else text


def _applied(spec, model, cpu: bool):
    """``spec`` applied to ``model`` on the CUDA code paths (or the CPU's); an older tokenmerge's own way."""
    try:
        return spec.applied(model, code_paths="cpu" if cpu else "cuda")
    except TypeError:  # an older tokenmerge: a process-wide switch, or one path for every device
        try:
            from tokenmerge.merge.local import code_paths
        except ImportError:
            return spec.applied(model)
        stack = contextlib.ExitStack()
        stack.enter_context(spec.applied(model))
        if not cpu:
            stack.enter_context(code_paths("cuda"))
        return stack


def _paths(cpu: bool) -> str:
    return "CPU paths" if cpu else "CUDA paths"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True)
    p.add_argument("--resolution", type=_resolution, default=1024)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None, help="keep this many blocks of each stack (REDUCED)")
    p.add_argument("--methods", nargs="+", default=["tome:0.5"])
    p.add_argument("--narrow", action="store_true", help="narrow widths, same token counts (see above)")
    p.add_argument("--cpu-paths", action="store_true", help="count the CPU's code paths instead of CUDA's")
    args = p.parse_args()
    torch.manual_seed(0)
    preset = resolve(args.preset)
    if args.blocks is not None:
        config = dict(preset.unet)
        for key in ("num_layers", "num_single_layers", "num_refiner_layers", "n_layers"):
            if key in config:
                config[key] = min(config[key], args.blocks)
        preset = dataclasses.replace(preset, unet=config)
    if args.narrow:
        preset = _narrow(preset)
    model = preset.build(torch.float32, "cpu")
    set_attention(model, "sdpa", preset.family)
    inputs = preset.inputs(1, args.resolution, torch.float32, torch.device("cpu"), frames=args.frames)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=tokenmerge.__path__[0]).stdout.strip()
    paths = _paths(args.cpu_paths)
    reduced = f", REDUCED to {args.blocks} blocks per stack" if args.blocks is not None else ""
    reduced += ", NARROWED widths (same token counts)" if args.narrow else ""
    print(f"`{' '.join(sys.argv)}`\n\ntokenmerge {commit}, torch {torch.__version__}, {preset.name} "
          f"({preset.description}{reduced}), {args.resolution}, RANDOM weights, {paths}, one step as the pipeline "
          "runs it\n")
    print("| method | kernels per step | vs vanilla | extra per merged block | host syncs |\n|---|---|---|---|---|")
    base = None
    for text in ["vanilla"] + args.methods:
        spec = parse_spec(text, bench=True)
        with _applied(spec, model, args.cpu_paths), torch.no_grad():
            step(model, inputs)  # warm-up: tables built, ids read
            info = tokenmerge.describe_patch(model)
            blocks = sum(len(d.blocks) for d in info.denoisers) if info is not None else 0
            counted = count_kernels(step, "cpu", model, inputs)
        kernels = counted["kernels"]
        base = kernels if base is None else base
        extra = f"{(kernels - base) / blocks:.1f} ({blocks} blocks)" if blocks else ""
        print(f"| {text} | {kernels} | {kernels / base:.2f}x | {extra} | {counted['syncs']} |", flush=True)


# per family: the config keys of the widths, narrowed (heads x head channels, text, feed-forward); the token
# counts (patch size, latent channels, text tokens) are kept
_NARROW = {
    "unet": dict(block_out_channels=(32, 64, 128, 128), cross_attention_dim=16, norm_num_groups=32),
    "pixart": dict(num_attention_heads=3, attention_head_dim=16, cross_attention_dim=48, caption_channels=16),
    "flux": dict(num_attention_heads=2, attention_head_dim=16, joint_attention_dim=16, pooled_projection_dim=16,
                 axes_dims_rope=(4, 6, 6)),
    "wan": dict(num_attention_heads=2, attention_head_dim=16, text_dim=16, ffn_dim=32),
}


def _narrow(preset):
    if preset.family not in _NARROW:
        raise SystemExit(f"--narrow: no narrow widths for the {preset.family!r} family (one of {sorted(_NARROW)})")
    config = dict(preset.unet, **_NARROW[preset.family])
    return dataclasses.replace(preset, unet=config, text_dim=None if preset.text_dim is None else 16)


if __name__ == "__main__":
    main()
