"""``tokenmerge bench``: speed and memory tables of vanilla vs merged denoiser steps, on any device."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from ..tools.text import quote
from .bench_gpu import command_line, run_gpu, summarize
from .common import OUT_HELP, STEM_HELP, check_outputs, pick_device, positive_int, stem

HELP = """\
Time one denoising step (with guidance as the model's pipeline runs it) per cell of a grid of presets x attention
backends x resolutions x batch sizes (x frames, for video), for each mode, interleaved (A, B, A, B...) after a
warm-up, and write a Markdown table, CSV and JSONL records (with library and device versions) and a PNG plot.

Presets are the real architectures with RANDOM weights: they give real timings and memory, not images, and need
no download; the large transformers keep their real widths with fewer blocks, named in the preset (wan-2b: 2 of
Wan 2.1 1.3B's 30 blocks) and marked REDUCED. The full-size presets, named by their model (flux1-dev, wan2.1-14b,
hunyuan-video-13b, ...), hold every block, built on the device in the target dtype: they are for GPUs. --model
loads a real diffusers pipeline folder (or hub id, when the weights are cached).

--gpu runs the GPU table: full-size models at their usual sizes, every method against vanilla and its zero-overhead
limit, with kernels per call and host against device time; add --compile default reduce-overhead for the compiled
table. --summarize puts the records of several runs (their .jsonl) into one such table.
"""

# what --gpu sets itself: the options that describe the grid
_GRID_OPTIONS = ("preset", "model", "resolutions", "frames", "batch_sizes", "modes", "ratios", "todo_factors",
                 "breakdown", "memory", "memory_limit")  # (--steps: its rows' whole generations too)


def _resolution(text: str) -> int | str:
    """``512`` (square) or ``480x832`` (height x width); each side a multiple of 8 and >= 64."""
    h, x, w = text.strip().lower().partition("x")
    sides = (h, w) if x else (h,)
    if not all(side.strip().isdigit() and len(side.strip()) <= 6 for side in sides):
        raise argparse.ArgumentTypeError(f"resolution must be pixels per side (512) or height x width (480x832); "
                                         f"got {quote(text, 40)}")
    values = [int(side) for side in sides]
    if any(v < 64 or v % 8 for v in values):
        raise argparse.ArgumentTypeError("resolution must be a multiple of 8 and >= 64 (each side); got "
                                         f"{quote(text, 40)}")
    return values[0] if len(values) == 1 or values[0] == values[1] else f"{values[0]}x{values[1]}"


def _frames(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"frames must be >= 1 (pixel frames of a video); got {quote(text, 40)}")
    return value


def _factor(text: str) -> int | tuple[int, ...]:
    """A ToDo factor: ``2`` (per spatial side) or one per grid axis, ``1x2x2`` / ``2x2x2``."""
    from ..tools.methods import parse_spec

    try:
        return parse_spec("todo:" + text.strip()).value
    except ValueError:
        raise argparse.ArgumentTypeError(f"ToDo factor must be an integer >= 1 or one per axis such as 1x2x2; "
                                         f"got {quote(text, 40)}") from None


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
    from ..bench.cell import ATTENTION_BACKENDS, MODE_NAMES
    from ..bench.gpu import QUICK, ROWS
    from ..bench.parallel import KINDS
    from ..bench.presets import ALIASES, PRESETS
    from ..bench.steps import COMPILE_MODES
    from ..tools.methods import BENCH_METHODS, METHODS

    p = sub.add_parser("bench", help="speed/memory table: vanilla vs tokenmerge vs tomesd vs the limit",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", choices=sorted(PRESETS) + sorted(ALIASES), default=None,
                   help="architecture presets with random weights: "
                        + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items())
                        + ". Aliases: " + ", ".join(f"{k} = {v}" for k, v in ALIASES.items()) + " (default: sd15)")
    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="a real diffusers pipeline: a local folder (with model_index.json) or a hub id whose files "
                        "are cached; replaces --preset. Nothing is downloaded when the hub is out of reach.")
    p.add_argument("--resolutions", nargs="+", type=_resolution, default=None, metavar="PX",
                   help="image or video frame sizes in pixels: 512 (square) or HxW such as 480x832 (height x width). "
                        "Each preset needs multiples of its VAE scale x patch (8 for UNets, 16 for Wan, HunyuanVideo, "
                        "Flux.2, Qwen-Image; 32 for LTX and SANA). Default: 512")
    p.add_argument("--frames", nargs="+", type=_frames, default=None, metavar="N",
                   help="pixel frames of the video presets: 4k+1 for Wan and HunyuanVideo (33 -> 9 latent frames), "
                        "8k+1 for LTX (33 -> 5); refused for image presets. Default: each video preset's own (33)")
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, default=None, metavar="N",
                   help="images or videos per step (with guidance in one call the denoiser sees twice as many). "
                        "Default: 1")
    p.add_argument("--modes", nargs="+", choices=MODE_NAMES, default=None,
                   help="vanilla: no merging; tokenmerge: this library's ToMe; tomesd: the reference package "
                        "(if installed), on the same blocks; limit: the same attention on the merged token count "
                        "with a free merge (a slice) and unmerge (a repeat): the best any merge could do; "
                        "todo: token downsampling of keys/values (--todo-factors); todo-limit: attention on the "
                        "pooled key/value count with free pooling (a slice). "
                        "grid-limit: whole-block merging's limit on transformers, the unpatched model at the merged "
                        "token count (no hooks). "
                        "Default: vanilla tokenmerge tomesd limit (without tomesd for the transformer presets)")
    p.add_argument("--ratios", nargs="+", type=_ratio, default=None, metavar="R",
                   help="merge ratios of the merging modes. Default: 0.5")
    p.add_argument("--todo-factors", nargs="+", type=_factor, default=None, metavar="F",
                   help="downsampling factors per side of the todo modes (2 = 4x fewer keys/values; on video: "
                        "each frame), or one per grid axis: 1x2x2, 2x2x2 (frames too). Default: 2")
    p.add_argument("--methods", nargs="+", type=_spec, default=[], metavar="SPEC",
                   help="more modes as method specs NAME[:VALUE][,KEY=VALUE...], the options of apply_patch / "
                        "apply_todo: e.g. 'tome:0.5,plan_steps=2' (plans kept 2 steps), 'tome:0.5,share_plans=true', "
                        "'tome:0.5,stop=0.5' (first half of the steps: use with --steps), 'todo:2,mode=avg', "
                        "'todo:2,ratio=0.3'. Names: " + ", ".join({**METHODS, **BENCH_METHODS}))
    p.add_argument("--attention", nargs="+", choices=ATTENTION_BACKENDS, default=["sdpa"],
                   help="attention backend of the UNet and PixArt presets: vanilla (diffusers' unfused attention), "
                        "sdpa (PyTorch fused), xformers (if installed); the other transformers run their own "
                        "attention processors, on SDPA: sdpa only. Default: sdpa")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed runs per mode per cell, after one "
                   "warm-up (default 3; more on a noisy machine; --gpu: each row's own, 3 to 15)")
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
    p.add_argument("--compile", nargs="*", choices=COMPILE_MODES, default=None, metavar="MODE",
                   help="also run every mode under torch.compile (inductor) in these modes: default (inductor's "
                        "default; what --compile alone means) and/or reduce-overhead (CUDA graphs), the whole "
                        "denoiser, and/or regional (its repeated blocks compiled in place, fullgraph=True, as "
                        "diffusers' compile_repeated_blocks). Each mode is compiled by itself after the eager rounds "
                        "(compiled code is not interleaved: dynamo does not tell a patched model from an unpatched "
                        "one), warmed up, then timed; compiled modes are compared with compiled vanilla of the same "
                        "compile mode (minutes per mode on a CPU)")
    p.add_argument("--compiled-only", action="store_true",
                   help="with --compile: time only the compiled modes (no eager rounds), e.g. to split a GPU table "
                        "into commands that fit a time limit")
    p.add_argument("--kernels", action="store_true",
                   help="count each mode's kernels per denoiser call once after the timed rounds: the operators "
                        "dispatched (on any device), and on CUDA the profiler's kernel launches and the share of "
                        "the step the GPU was busy (below 80%%: launch-bound). On by default with --gpu")
    p.add_argument("--gpu", nargs="*", choices=list(ROWS) + ["quick"], default=None, metavar="ROW",
                   help="run the GPU table on a CUDA device: full-size models with random weights, one step each, "
                        "ToMe 0.5 (local and global matching), whole-block ToMe 0.5, ToDo 2 (video also 2x2x2), "
                        "tomesd 0.5 (UNets) and their zero-overhead limits, with --kernels; add --compile default "
                        "reduce-overhead for the compiled tables. Rows (all when none is named): "
                        + ", ".join(ROWS) + f"; quick = {' '.join(QUICK)}. Sets presets, sizes, frames, dtypes "
                        "and modes itself (leave those options out); --methods, if given, replaces each row's "
                        "methods (vanilla is always run), e.g. to compile a few at a time")
    p.add_argument("--summarize", nargs="+", type=Path, default=None, metavar="JSONL",
                   help="no run: write STEM.md with the GPU table of the records in these .jsonl files of earlier "
                        "runs (e.g. one per row, eager and compiled)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the phases inside the patched blocks (similarity, merge, attention, unmerge) "
                        "for this library's modes, against the same blocks unmerged; the device is synchronised at "
                        "every phase boundary, so read shares, not step times")
    p.add_argument("--breakdown-repeats", type=positive_int, default=None, metavar="N",
                   help="timed rounds of the breakdown (default: --repeats; no warm-up round of its own: the step "
                        "rounds of the cell warmed every mode); its phases' shares settle in fewer rounds than step "
                        "times")
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
    p.add_argument("--context-parallel", choices=KINDS, default=None,
                   help="time the presets under diffusers' context parallelism, in processes started by torchrun: "
                        "torchrun --nproc-per-node N -m tokenmerge bench --context-parallel ulysses --preset wan-2b "
                        "... (one process per GPU; gloo processes on the CPU with --device cpu). ulysses: "
                        "ContextParallelConfig(ulysses_degree=N); ring: ring_degree=N (needs an attention backend "
                        "that returns the log-sum-exp: flash, on CUDA). Each mode is applied after parallelism is "
                        "enabled, each rank merges its slice of the tokens; a step's time is its slowest rank's; "
                        "rank 0 writes the outputs. For presets whose model has a context-parallel plan (Wan, "
                        "Flux.1, Flux.2, Qwen-Image, LTX-Video) and the modes vanilla, tokenmerge, todo, limit, "
                        "todo-limit (and --methods of tome/todo); eager step timing only")
    p.set_defaults(run=run)


def _modes(args) -> list:
    """The modes of the run, as method specs: vanilla first, then each mode per ratio / factor, then --methods."""
    from ..tools.methods import MethodSpec

    modes = [MethodSpec("vanilla")] if "vanilla" in args.modes else []
    by_ratio = [n for n in args.modes if n in ("tokenmerge", "tomesd", "limit", "grid-limit")]
    modes += [MethodSpec("tome" if n == "tokenmerge" else n, r) for r in args.ratios for n in by_ratio]
    modes += [MethodSpec(n, f) for n in args.modes if n in ("todo", "todo-limit") for f in args.todo_factors]
    modes = list(dict.fromkeys(modes))
    modes += [m for m in args.methods if m not in modes]
    return modes


def _check_presets(args, presets, modes) -> str | None:
    """What the presets refuse of these arguments (frames, sizes, attention, modes), as an error message."""
    from ..bench.cell import GENERIC_PROCESSORS
    from ..bench.generation import GENERATION_FAMILIES

    if args.model and any(m.name == "grid-limit" for m in modes):
        return "grid-limit runs a transformer preset at the merged token count; --model is a UNet"
    if args.model and any(isinstance(r, str) for r in args.resolutions):
        return "--resolutions: --model takes square resolutions (one number per size)"
    if args.frames and (not presets or any(not p.video for p in presets)):
        images = [p.name for p in presets if not p.video] or ["--model"]
        return (f"--frames applies to video presets only; {', '.join(images)} "
                f"{'is an image preset' if len(images) == 1 else 'are image presets'} (leave --frames out)")
    for p in presets:
        for frames in args.frames or []:
            if p.check_frames(frames):
                return "--frames: " + p.check_frames(frames)
        for res in args.resolutions:
            if p.check_resolution(res):
                return "--resolutions: " + p.check_resolution(res)
        if p.family not in GENERIC_PROCESSORS and args.attention != ["sdpa"]:
            return (f"--attention: {p.name} runs its own attention processors (on PyTorch's SDPA); use --attention "
                    "sdpa for it")
        if args.steps and p.family not in GENERATION_FAMILIES:
            return (f"--steps: whole generations are timed for the UNet, PixArt, SD3, Flux.1 and Wan presets; {p.name} "
                    "times denoiser steps only (leave --steps out)")
        rank = 3 if p.video else 2
        if p.family == "unet" and any(m.name == "grid-limit" for m in modes):
            return (f"grid-limit runs a transformer at the merged token count; {p.name} is a UNet, whose every "
                    "level would shrink: use limit (with scope=block for whole-block merging)")
        for m in modes:
            if m.options and dict(m.options).get("st", 1) != 1 and not p.video:
                return f"{m.text}: st (the window along the frame axis) applies to video presets; {p.name} is an image"
            if isinstance(m.value, tuple) and m.is_factor and len(m.value) != rank:
                return (f"{m.text}: {len(m.value)} factors, but {p.name}'s token grid has {rank} axes "
                        f"({'frames, height, width' if rank == 3 else 'height, width'})")
    return None


# what --context-parallel leaves out: options that measure another way, and modes that are not this library's merging
_NOT_PARALLEL = (("model", "--model"), ("compile", "--compile"), ("memory", "--memory"),
                 ("memory_limit", "--memory-limit"), ("breakdown", "--breakdown"), ("steps", "--steps"),
                 ("kernels", "--kernels"))
_PARALLEL_MODES = ("vanilla", "tome", "todo", "limit", "todo-limit")


def _check_parallel(args, modes) -> str | None:
    """Why ``--context-parallel`` cannot run with these arguments here (None if it can)."""
    from ..bench.parallel import launched

    if not launched():
        return ("--context-parallel runs in processes started by torchrun: torchrun --nproc-per-node N -m tokenmerge "
                f"bench --context-parallel {args.context_parallel} ... (N >= 2)")
    if int(os.environ["WORLD_SIZE"]) < 2:
        return "--context-parallel needs at least 2 processes (torchrun --nproc-per-node 2 or more)"
    given = [flag for name, flag in _NOT_PARALLEL if getattr(args, name)]
    if given:
        return f"--context-parallel times eager denoiser steps only; leave out {', '.join(given)}"
    other = [m.text for m in modes if m.name not in _PARALLEL_MODES]
    if other:
        return (f"--context-parallel runs this library's merging (vanilla, tokenmerge, todo, limit, todo-limit); "
                f"leave out {', '.join(other)}")
    return None


def run(args, parser) -> int:
    import torch

    from ..bench import cell, report, runner
    from ..bench.presets import ALIASES, PRESETS
    from ..tools.outputs import Outputs

    if args.summarize is not None:
        return summarize(args, parser)
    if args.compile == []:  # --compile alone: inductor's default mode
        args.compile = ["default"]
    if args.compiled_only and not args.compile:
        parser.error("--compiled-only needs --compile (it leaves out the eager rounds)")
    if args.gpu is not None:
        return run_gpu(args, parser, _GRID_OPTIONS)
    args.preset = args.preset or ["sd15"]  # the defaults (None above: --gpu tells given options from them)
    args.resolutions = args.resolutions or [512]
    args.repeats = args.repeats or 3
    args.batch_sizes, args.ratios = args.batch_sizes or [1], args.ratios or [0.5]
    args.todo_factors = args.todo_factors or [2]
    device = pick_device(args.device, parser)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "float16"))
    chosen = [PRESETS[ALIASES.get(n, n)] for n in args.preset] if not args.model else []
    if args.modes is None:  # tomesd patches UNets only
        unets = all(p.family == "unet" for p in chosen)
        args.modes = ["vanilla", "tokenmerge"] + (["tomesd"] if unets else []) + ["limit"]
    modes = _modes(args)
    names = {m.name for m in modes}
    if "tomesd" in names:
        try:
            import tomesd  # noqa: F401
        except ImportError:
            parser.error("--modes tomesd needs the tomesd package (pip install tomesd==0.1.3), or leave it out")
    families = {p.family for p in chosen} if not args.model else {"unet"}
    if "tomesd" in names and families - {"unet"}:
        parser.error("--modes tomesd: tomesd patches UNets only; leave it out for the transformer presets")
    problem = _check_presets(args, chosen, modes)
    if problem:
        parser.error(problem)
    missing = [a for a in args.attention if a not in cell.available_attention()]
    if missing:
        parser.error(f"--attention {' '.join(missing)}: not available here (xformers is not installed)")
    if not modes:
        parser.error("--modes/--methods: nothing to run")
    if args.compile and args.warmup < 1:
        parser.error("--warmup 0 with --compile: the warm-up round is where the modes compile; use --warmup 1 or more")
    prepare, rank = None, 0
    if args.context_parallel:
        from ..bench import parallel

        problem = _check_parallel(args, modes) or next(filter(None, map(parallel.no_plan, chosen)), None)
        if problem:
            parser.error(problem)
        device, rank, world = parallel.setup(args.device)
        prepare = parallel.Parallel(args.context_parallel, world, device)
        args.no_progress = args.no_progress or rank != 0
    outputs = Outputs(args.out, report.output_names(args.stem))
    if rank == 0:
        check_outputs(parser, outputs)  # before the run: a file in the way must not cost the measurements
    from ..bench.presets import resolve
    from ..tools.pipelines import PipelineLoadError

    try:
        presets = [resolve(model=args.model, dtype=dtype)] if args.model else [resolve(n) for n in args.preset]
    except (FileNotFoundError, PipelineLoadError, TypeError) as err:
        parser.error(f"--model: {err}")
    if prepare is not None:
        presets = [parallel.TupleOutputs(p) for p in presets]
    records, meta = runner.run_grid(presets, args.attention, args.resolutions, args.batch_sizes, modes,
                                    args.repeats, device, dtype, memory=args.memory,
                                    memory_limit_mb=args.memory_limit, progress=not args.no_progress,
                                    breakdown=args.breakdown, steps=args.steps, compile=args.compile or False,
                                    warmup=args.warmup, frames=args.frames, breakdown_repeats=args.breakdown_repeats,
                                    kernels=args.kernels, eager=not args.compiled_only, prepare=prepare)
    preface = ""
    if prepare is not None:
        parallel.slowest(records)
        meta["context_parallel"] = {"kind": args.context_parallel, "ranks": world}
        preface = (f"# Context parallelism: {args.context_parallel} over {world} ranks ({meta['device_name']}; "
                   "diffusers' enable_parallelism, then each mode; each rank merges its slice of the tokens). A "
                   "step's time is its slowest rank's.")
        parallel.teardown()
        if rank != 0:
            return 0
    command = command_line()
    paths = report.write_outputs(records, meta, outputs, command, args.stem, preface)
    print(report.markdown(records, meta, command, preface))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
