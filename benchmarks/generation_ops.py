"""Operators dispatched by whole generations, vanilla against each method: what an eager GPU launches over a
generation (views and allocations left out; ``tokenmerge.bench.kernels``), the step cache's skipped calls included.

A generation is the bench's own denoising loop (``bench.generation.generate``: the preset's scheduler, guidance as
the pipeline runs it), its VAE decode left out (the same for every method). Each method's generation is counted
after a first one (tables built), and its calls are counted apart by kind: the mean operators of a call where the
stack's blocks ran and of one where none did (the step cache's skipped calls), beside vanilla's call and the part
of it outside the blocks (a call with every block made the identity, counted the same way). The model is a bench
preset (``--preset``: every block of the real model with ``flux1-dev``, ``wan2.1-1.3b``...) with NARROWED widths
and RANDOM weights: the operators and their order are those of the real widths (``kernels_per_call.py --narrow``).

    .venv/bin/python benchmarks/generation_ops.py --preset flux1-dev --resolution 1024 --steps 20 \\
        --methods auto,speed=faithful auto,speed=balanced auto,speed=fast

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import torch
from kernels_per_call import _NARROW, _resolution

import tokenmerge
from tokenmerge.bench.cell import set_attention
from tokenmerge.bench.generation import Loop, generate, scheduler_for
from tokenmerge.bench.presets import resolve
from tokenmerge.tools.methods import parse_spec


class _Calls:
    """Per denoiser call: the operators it dispatched and whether its blocks ran (forward hooks)."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode

        from tokenmerge.bench.kernels import NO_KERNEL

        calls = self.calls = []  # [operators, blocks ran, inside the call]

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if calls and calls[-1][2] and not getattr(func, "is_view", False) \
                        and func.overloadpacket.__name__ not in NO_KERNEL:
                    calls[-1][0] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Count()
        blocks = _deep(model)
        # (registered before the patch's own denoiser hooks run: prepended, so its ops are counted too)
        self.handles = [model.register_forward_pre_hook(lambda m, a: calls.append([0, False, True]), prepend=True),
                        model.register_forward_hook(lambda m, a, o: calls[-1].__setitem__(2, False))]
        self.handles += [sub.register_forward_pre_hook(lambda m, a: calls[-1].__setitem__(1, True))
                         for b in blocks for sub in (b.children() if not hasattr(b, "conv1") else [b])]

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for h in self.handles:
            h.remove()


def _deep(model) -> list:
    """What tells a call whose blocks ran from a skipped or cached one: a transformer's blocks (their children); a
    UNet's mid block's first resnet (the UNet cache's cached calls run only the shallow path)."""
    out = []
    for site in tokenmerge.engine.find_denoisers(model):
        if site.family.kind == "unet":
            out.append(site.module.mid_block.resnets[0])  # (its own hooks fire even when its forward is bypassed)
        else:
            out += [b.module for b in site.blocks]
    return out


def _outside(model, inputs) -> int:
    """The operators of a vanilla call outside its blocks (those dispatched while no block of the stack runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tokenmerge.bench.cell import step
    from tokenmerge.bench.kernels import NO_KERNEL

    depth, count = [0], [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not depth[0] and not getattr(func, "is_view", False) and func.overloadpacket.__name__ not in NO_KERNEL:
                count[0] += 1
            return func(*args, **(kwargs or {}))

    # (a UNet: its attentions)
    blocks = [b.module for site in tokenmerge.engine.find_denoisers(model) for b in site.blocks]
    handles = [h for b in blocks for h in (b.register_forward_pre_hook(lambda m, a: depth.__setitem__(0, depth[0] + 1)),
                                           b.register_forward_hook(lambda m, a, o: depth.__setitem__(0, depth[0] - 1)))]
    calls = inputs if isinstance(inputs, list) else [inputs]  # one call's (guidance as two calls: the first)
    try:
        with torch.no_grad(), Count():
            step(model, calls[0])
    finally:
        for h in handles:
            h.remove()
    return count[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True)
    p.add_argument("--resolution", type=_resolution, default=1024)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--methods", nargs="+", default=["auto,speed=fast"])
    args = p.parse_args()
    torch.manual_seed(0)
    preset = resolve(args.preset)
    if preset.family not in _NARROW:
        raise SystemExit(f"no narrow widths for the {preset.family!r} family (one of {sorted(_NARROW)})")
    preset = dataclasses.replace(preset, unet=dict(preset.unet, **_NARROW[preset.family]),
                                 text_dim=None if preset.text_dim is None else 16)
    model = preset.build(torch.float32, "cpu")
    set_attention(model, "sdpa", preset.family)
    inputs = preset.inputs(1, args.resolution, torch.float32, torch.device("cpu"), frames=args.frames)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=tokenmerge.__path__[0]).stdout.strip()
    print(f"`{' '.join(sys.argv)}`\n\ntokenmerge {commit}, torch {torch.__version__}, {preset.name} "
          f"({preset.description}, NARROWED widths, same operators), {args.resolution}, RANDOM weights, a "
          f"{args.steps}-step generation as the bench runs it (its scheduler, guidance: {preset.guidance_text}; "
          "no VAE decode)\n")
    outside = _outside(model, inputs)
    loop = Loop(model, scheduler_for(preset, inputs), preset)  # the patch tells the steps from its scheduler
    print("| method | operators per generation | vs vanilla | calls: blocks ran / skipped | per call, blocks ran | "
          "per call, skipped | outside the blocks (vanilla) |\n|---|---|---|---|---|---|---|")
    base = None
    for text in ["vanilla"] + args.methods:
        spec = parse_spec(text)
        with spec.applied(loop), torch.no_grad():
            generate(loop, None, preset, inputs, args.steps)  # a first generation: tables built, ids read
            with _Calls(model) as counted:
                generate(loop, None, preset, inputs, args.steps)
        calls = counted.calls
        total = sum(c[0] for c in calls)
        ran = [c[0] for c in calls if c[1]]
        skipped = [c[0] for c in calls if not c[1]]
        base = total if base is None else base
        mean = (lambda xs: f"{sum(xs) / len(xs):.0f}" if xs else "-")
        print(f"| {text} | {total:,} | {total / base:.2f}x | {len(ran)} / {len(skipped)} | {mean(ran)} | "
              f"{mean(skipped)} | {outside} |", flush=True)


if __name__ == "__main__":
    main()
