"""``tokenmerge bench``: speed and memory tables of vanilla vs merged UNet steps, on any device."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from ..tools.text import quote
from .common import OUT_HELP, STEM_HELP, check_outputs, pick_device, positive_int, stem

HELP = """\
Time one UNet step (with classifier-free guidance) per cell of a grid of presets x attention backends x
resolutions x batch sizes, for each mode, interleaved (A, B, A, B...) after a warm-up, and write a Markdown
table, CSV and JSONL records (with library and device versions) and a PNG plot.

Presets are the real UNet architectures with RANDOM weights: they give real timings and memory, not images,
and need no download. --model loads a real diffusers pipeline folder (or hub id, when the weights are cached).
"""


def _resolution(text: str) -> int:
    value = int(text)
    if value < 64 or value % 8:
        raise argparse.ArgumentTypeError(f"resolution must be a multiple of 8 and >= 64; got {quote(text, 40)}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 < value <= 0.75:
        raise argparse.ArgumentTypeError(f"ratio must be in (0, 0.75]; got {quote(text, 40)}")
    return value


def _megabytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d{1,12}(?:\.\d{1,12})?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"memory limit must look like 512MB, 8GB or 8GiB; got {quote(text, 40)}")
    scale = {"": 1 / 2**20, "K": 1 / 1024, "M": 1, "G": 1024, "T": 2**20}[m.group(2).upper()]
    return max(1, int(float(m.group(1)) * scale))


def _spec(text: str):
    from ..tools.methods import parse_spec

    try:
        return parse_spec(text, bench=True)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _warmup(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("warmup must be >= 0 (untimed rounds before the timed ones); "
                                         f"got {quote(text, 40)}")
    return value


def _steps(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"steps must be >= 0 (0: no end-to-end timing); got {quote(text, 40)}")
    return value


def add_parser(sub) -> None:
    from ..bench.presets import PRESETS
    from ..bench.cell import ATTENTION_BACKENDS, MODE_NAMES
    from ..tools.methods import BENCH_METHODS, METHODS

    p = sub.add_parser("bench", help="speed/memory table: vanilla vs tokenmerge vs tomesd vs the limit",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["sd15"],
                   help="architecture presets with random weights: "
                        + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()) + " (default: sd15)")
    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="a real diffusers pipeline: a local folder (with model_index.json) or a hub id whose files "
                        "are cached; replaces --preset. Nothing is downloaded when the hub is out of reach.")
    p.add_argument("--resolutions", nargs="+", type=_resolution, default=[512], metavar="PX",
                   help="image sizes in pixels (square; the latent is 1/8 of it). Default: 512")
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1], metavar="N",
                   help="images per step (the UNet sees twice as many: guidance). Default: 1")
    p.add_argument("--modes", nargs="+", choices=MODE_NAMES, default=["vanilla", "tokenmerge", "tomesd", "limit"],
                   help="vanilla: no merging; tokenmerge: this library's ToMe; tomesd: the reference package "
                        "(if installed), on the same blocks; limit: the same attention on the merged token count "
                        "with a free merge (a slice) and unmerge (a repeat): the best any merge could do; "
                        "todo: token downsampling of keys/values (--todo-factors); todo-limit: attention on the "
                        "pooled key/value count with free pooling (a slice). "
                        "Default: vanilla tokenmerge tomesd limit")
    p.add_argument("--ratios", nargs="+", type=_ratio, default=[0.5], metavar="R",
                   help="merge ratios of the merging modes. Default: 0.5")
    p.add_argument("--todo-factors", nargs="+", type=positive_int, default=[2], metavar="F",
                   help="downsampling factors per side of the todo modes (2 = 4x fewer keys/values). Default: 2")
    p.add_argument("--methods", nargs="+", type=_spec, default=[], metavar="SPEC",
                   help="more modes as method specs NAME[:VALUE][,KEY=VALUE...], the options of apply_patch / "
                        "apply_todo: e.g. 'tome:0.5,reuse_steps=2' (plans kept 2 steps), 'tome:0.5,share_plans=true', "
                        "'tome:0.5,stop=0.5' (first half of the steps: use with --steps), 'todo:2,mode=avg', "
                        "'todo:2,ratio=0.3'. Names: " + ", ".join({**METHODS, **BENCH_METHODS}))
    p.add_argument("--attention", nargs="+", choices=ATTENTION_BACKENDS, default=["sdpa"],
                   help="attention backend: vanilla (diffusers' unfused attention), sdpa (PyTorch fused), "
                        "xformers (if installed). Default: sdpa")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per mode per cell, after one warm-up "
                   "(default 3; more on a noisy machine)")
    p.add_argument("--warmup", type=_warmup, default=1, metavar="N",
                   help="untimed rounds (every mode once) before the timed ones, per cell (default 1). 0 suits cells "
                        "whose steps take minutes, where a warm-up round would cost more than it settles; "
                        "--compile needs at least 1 (that round compiles)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto (default)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: float16 on CUDA/MPS, float32 on CPU")
    p.add_argument("--steps", type=_steps, default=0, metavar="N",
                   help="also time whole generations: N denoising steps with a real scheduler and guidance, then the "
                        "VAE decode (random weights for presets; prompt embeddings given, so no text encoder), "
                        "modes interleaved, --repeats times each. 0 (default) = off; small on a CPU (e.g. 4)")
    p.add_argument("--compile", action="store_true",
                   help="also run every mode under torch.compile (inductor), interleaved with the eager runs; the "
                        "warm-up round compiles (minutes per mode on a CPU). Compiled modes are compared with "
                        "compiled vanilla")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the phases inside the patched blocks (similarity, merge, attention, unmerge) "
                        "for this library's modes, against the same blocks unmerged; the device is synchronised at "
                        "every phase boundary, so read shares, not step times")
    p.add_argument("--memory", action="store_true",
                   help="measure peak memory on a CPU too (one isolated process per mode and cell: slow); "
                        "on CUDA the allocator's peak is always reported")
    p.add_argument("--memory-limit", type=_megabytes, default=None, metavar="SIZE",
                   help="CPU: run each mode of each cell first in its own process under this data-size limit "
                        "(e.g. 8GB); what does not fit is reported as OOM and not timed")
    p.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="output folder (default bench-results; created if missing), checked before the run. "
                        + OUT_HELP)
    p.add_argument("--stem", type=stem, default="bench",
                   help=f"file name stem of the outputs: STEM.md, .csv, .jsonl, .png ({STEM_HELP}; default bench)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _modes(args) -> list:
    """The modes of the run, as method specs: vanilla first, then each mode per ratio / factor, then --methods."""
    from ..tools.methods import MethodSpec

    modes = [MethodSpec("vanilla")] if "vanilla" in args.modes else []
    by_ratio = [n for n in args.modes if n in ("tokenmerge", "tomesd", "limit")]
    modes += [MethodSpec("tome" if n == "tokenmerge" else n, r) for r in args.ratios for n in by_ratio]
    modes += [MethodSpec(n, f) for n in args.modes if n in ("todo", "todo-limit") for f in args.todo_factors]
    modes += [m for m in args.methods if m not in modes]
    return modes


def run(args, parser) -> int:
    import torch

    from ..bench import cell, report, runner
    from ..bench.presets import PRESETS
    from ..tools.outputs import Outputs

    device = pick_device(args.device, parser)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "float16"))
    modes = _modes(args)
    names = {m.name for m in modes}
    if "tomesd" in names:
        try:
            import tomesd  # noqa: F401
        except ImportError:
            parser.error("--modes tomesd needs the tomesd package (pip install tomesd==0.1.3), or leave it out")
    families = {PRESETS[n].family for n in args.preset} if not args.model else {"unet"}
    if "tomesd" in names and families - {"unet"}:
        parser.error("--modes tomesd: tomesd patches UNets only; leave it out for the transformer presets")
    if "limit" in names and "flux" in families:
        parser.error("--modes limit: not available for Flux (its merged tokens carry rotary positions)")
    joint = families & {"sd3", "flux"}
    if joint and (names & {"todo", "todo-limit"} or args.attention != ["sdpa"]):
        parser.error(f"--preset {' '.join(sorted(joint))}: joint attention runs with --attention sdpa only, and "
                     "ToDo cannot apply to it (--modes todo / todo-limit)")
    missing = [a for a in args.attention if a not in cell.available_attention()]
    if missing:
        parser.error(f"--attention {' '.join(missing)}: not available here (xformers is not installed)")
    if not modes:
        parser.error("--modes/--methods: nothing to run")
    if args.compile and args.warmup < 1:
        parser.error("--warmup 0 with --compile: the warm-up round is where the modes compile; use --warmup 1 or more")
    outputs = Outputs(args.out, report.output_names(args.stem))
    check_outputs(parser, outputs)  # before the run: a file in the way must not cost the measurements
    from ..bench.presets import resolve
    from ..tools.pipelines import PipelineLoadError

    try:
        presets = [resolve(model=args.model, dtype=dtype)] if args.model else [resolve(n) for n in args.preset]
    except (FileNotFoundError, PipelineLoadError, TypeError) as err:
        parser.error(f"--model: {err}")
    records, meta = runner.run_grid(presets, args.attention, args.resolutions, args.batch_sizes, modes,
                                    args.repeats, device, dtype, memory=args.memory,
                                    memory_limit_mb=args.memory_limit, progress=not args.no_progress,
                                    breakdown=args.breakdown, steps=args.steps, compile=args.compile,
                                    warmup=args.warmup)
    command = "tokenmerge bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["bench"] \
        else "tokenmerge bench ..."
    paths = report.write_outputs(records, meta, outputs, command, args.stem)
    print(report.markdown(records, meta, command))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
