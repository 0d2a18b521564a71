"""``tokenmerge bench --gpu`` and ``--summarize``: the GPU table's rows, run one grid each, and the table of
earlier runs' records."""

from __future__ import annotations

import shlex
import sys

from ..tools.text import quote
from .common import check_outputs, pick_device

__all__ = ["command_line", "run_gpu", "summarize"]


def command_line() -> str:
    """The command line as typed (for the tables)."""
    if sys.argv[1:2] == ["bench"]:
        return "tokenmerge bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    return "tokenmerge bench ..."


def run_gpu(args, parser, grid_options) -> int:
    """``--gpu``: the rows of the GPU table, each its own grid (preset, size, frames, dtype, methods).

    Args:
        args: the parsed ``bench`` arguments.
        parser: for argument errors.
        grid_options: the options that describe a grid, which ``--gpu`` sets itself (refused when given).
    """
    import torch

    from ..bench import gpu, report, runner
    from ..bench.presets import resolve
    from ..tools.methods import parse_spec
    from ..tools.outputs import Outputs

    given = [f"--{name.replace('_', '-')}" for name in grid_options if getattr(args, name) not in (None, False, [], 0)]
    if given:
        parser.error(f"--gpu sets the presets, sizes, frames, dtypes and modes of its rows itself; leave out "
                     f"{', '.join(given)} (or run without --gpu)")
    names = list(dict.fromkeys(n for name in (args.gpu or list(gpu.ROWS))
                               for n in (gpu.QUICK if name == "quick" else (name,))))
    rows = {name: gpu.ROWS[name] for name in names}
    from ..bench.generation import GENERATION_FAMILIES

    for name, row in rows.items():
        problem = _row_problem(resolve(row.preset), args.methods)
        if problem:
            parser.error(f"--methods: row {name}: {problem}")
        if args.steps and resolve(row.preset).family not in GENERATION_FAMILIES:
            parser.error(f"--steps: row {name} ({resolve(row.preset).family}) times denoiser steps only; whole "
                         f"generations are timed for the {', '.join(GENERATION_FAMILIES)} rows")
    device = pick_device(args.device, parser)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__})")
    if device.type != "cuda" and any(row.full_size for row in rows.values()):
        parser.error(f"--gpu: its rows are full-size models (up to 14B parameters, minutes per step on a CPU): they "
                     f"need a CUDA device; got --device {device} (the CPU presets are the REDUCED ones)")
    wanted = [m.text for m in args.methods] or [spec for row in rows.values() for spec in row.methods]
    if any(spec.startswith("tomesd") for spec in wanted):
        try:
            import tomesd  # noqa: F401
        except ImportError:
            parser.error("--gpu: the UNet rows compare with tomesd: pip install tomesd==0.1.3 (or name only "
                         "transformer rows)")
    outputs = Outputs(args.out, report.output_names(args.stem))
    check_outputs(parser, outputs)
    records, metas = [], []
    for name, row in rows.items():
        preset = resolve(row.preset)
        dtype = getattr(torch, args.dtype or row.dtype)
        modes = [parse_spec(spec, bench=True) for spec in row.methods] if not args.methods else \
            list(dict.fromkeys([parse_spec("vanilla", bench=True)] + list(args.methods)))
        print(f"== {name}: {preset.name} {row.resolution}" + (f" x {row.frames} frames" if row.frames else "")
              + f", {dtype}", flush=True)
        rows_records, meta = runner.run_grid(
            [preset], ["sdpa"], [row.resolution], [1], modes, args.repeats or row.repeats, device, dtype,
            progress=not args.no_progress, compile=args.compile or False, warmup=args.warmup, steps=args.steps,
            frames=[row.frames] if row.frames else None, kernels=True, eager=not args.compiled_only,
            log=lambda line: print(line, flush=True))  # each record as made: a run cut short keeps them in its log
        for r in rows_records:
            r["gpu_row"] = name
        records += rows_records
        metas.append(meta)
    meta = dict(metas[0], dtype="per row (see each table)", repeats="each row's own number of" if args.repeats is None
                else args.repeats, presets={k: v for m in metas for k, v in m["presets"].items()})
    command = command_line()
    report.annotate(records)
    preface = gpu.summary(records, [command], [meta])
    paths = report.write_outputs(records, meta, outputs, command, args.stem, preface=preface)
    print(preface)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _row_problem(preset, methods) -> str | None:
    """What a row's preset refuses of the ``--methods`` given to replace its own (None: nothing)."""
    rank = 3 if preset.video else 2
    for m in methods:
        if m.name == "tomesd" and preset.family != "unet":
            return f"{m.text}: tomesd patches UNets only; {preset.name} is a transformer"
        if m.name == "grid-limit" and preset.family == "unet":
            return f"{m.text}: grid-limit is for transformers; {preset.name} is a UNet (use limit)"
        if isinstance(m.value, tuple) and m.is_factor and len(m.value) != rank:
            return f"{m.text}: {len(m.value)} factors, but {preset.name}'s token grid has {rank} axes"
        if dict(m.options).get("st", 1) != 1 and not preset.video:
            return f"{m.text}: st applies to video; {preset.name} is an image model"
    return None


def summarize(args, parser) -> int:
    """``--summarize``: the GPU table of earlier runs' records, written to STEM.md.

    Args:
        args: the parsed ``bench`` arguments (``summarize``: the JSONL files; ``out``, ``stem``).
        parser: for argument errors.
    """
    import json

    from ..bench import gpu, report
    from ..tools.outputs import Outputs

    records, commands, metas = [], [], []
    for path in args.summarize:
        try:
            lines = path.read_text().splitlines()
            loaded = [json.loads(line) for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            parser.error(f"--summarize: cannot read {quote(str(path), 80)} as the bench's JSONL records ({err})")
        if not all(isinstance(r, dict) and "label" in r and "meta" in r for r in loaded):
            parser.error(f"--summarize: {quote(str(path), 80)} holds no bench records (a .jsonl written by "
                         "tokenmerge bench)")
        for r in loaded:
            commands.append(r.pop("command", ""))
            metas.append(r.pop("meta"))
            records.append(r)
    outputs = Outputs(args.out, [f"{args.stem}.md"])
    check_outputs(parser, outputs)
    report.annotate(records)
    text = gpu.summary(records, [c for c in commands if c], metas)
    path = outputs.write_text(f"{args.stem}.md", text + "\n")
    print(text)
    print(f"wrote {path}")
    return 0
