"""``tokenmerge quality``: fidelity of merged generations to the vanilla model's, from identical noise."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..tools.text import quote
from .common import OUT_HELP, STEM_HELP, check_outputs, finite_float, pick_device, positive_int, seed, stem

HELP = """\
Generate every prompt x seed with the vanilla model and with each method (same noise), and report fidelity to
vanilla (PSNR, SSIM: per image, mean and 95% confidence interval), seconds per image, a grid (rows prompts,
columns methods), Markdown and JSON, and a speed-vs-fidelity plot. Images are kept (--images): a rerun with one
more method generates only that method's images. That folder is this command's own: files named by a hash of their
settings, each written whole or not at all; a damaged one is generated again, with a warning naming it.

Methods are specs NAME[:VALUE][,KEY=VALUE...]: tome:0.5 (ratio), todo:2 (factor), tomesd:0.5 (reference package),
with options of apply_patch/apply_todo, e.g. tome:0.5,stop=0.5 or todo:2,mode=avg.

With no --model, the embedded Fashion-MNIST model runs on its class names as prompts. Scale out with
`accelerate launch --num_processes N -m tokenmerge quality ...`: the prompts are split across processes.
"""


def _spec(text: str):
    from ..tools.methods import parse_spec

    try:
        return parse_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_common(p, default_methods: list[str], default_steps: int) -> None:
    """Options shared by ``quality`` and ``demo``."""
    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="an embedded model: fashion-unet (the default; a diffusers UNet), fashion-dit (a Flux.1-style "
                        "transformer), fashion-video (a Wan-style video transformer, 8-frame clips), fashion-mosaic "
                        "(Flux.1-style, 64 px mosaics from sentences: 1024 image + 32 text tokens), "
                        "fashion-video-long (Wan-style, 32-frame clips: 2048 tokens); or a real "
                        "diffusers pipeline: a local folder (with model_index.json) or a hub id already on this "
                        "machine. Nothing is downloaded.")
    p.add_argument("--methods", nargs="+", type=_spec, default=[_spec(m) for m in default_methods], metavar="SPEC",
                   help=f"methods to compare with vanilla (default: {' '.join(default_methods)})")
    p.add_argument("--steps", type=positive_int, default=default_steps,
                   help=f"denoising steps (default {default_steps})")
    p.add_argument("--guidance", type=finite_float, default=None, help="guidance scale (default: the pipeline's)")
    p.add_argument("--scheduler", default=None, metavar="NAME",
                   help="the embedded models' scheduler: euler or unipc on the flow testbeds, ddim, dpm++2m, euler or "
                        "pndm on fashion-unet (default: the pipeline each stands for: fashion-mosaic Flux.1-dev's "
                        "flow-matching Euler, fashion-dit SD3's, the video testbeds Wan 2.1's UniPC; fashion-unet "
                        "DDIM)")
    p.add_argument("--shift", type=finite_float, default=None, metavar="S",
                   help="the flow testbeds' time shift, sigma' = S sigma / (1 + (S - 1) sigma) (default: the pipeline "
                        "each stands for: fashion-mosaic e^1.15 ~ 3.16 as Flux.1-dev at 1024 px, the others 3; 1: "
                        "the linear grid they sampled on before)")
    p.add_argument("--size", type=positive_int, default=None, metavar="PX",
                   help="image height and width for --model pipelines (default: the pipeline's)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto (default)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: float16 on CUDA/MPS, float32 on CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(sub) -> None:
    from ..quality.extra import EXTRA_METRICS

    p = sub.add_parser("quality", help="image fidelity of merged vs vanilla generations (PSNR, SSIM, grid)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, ["tome:0.3", "tome:0.5", "tome:0.6"], 20)
    p.add_argument("--prompts", default=None, metavar="SOURCE",
                   help="parti (the Parti prompts, shipped), classes (the embedded model's), mosaics (fashion-mosaic's "
                        "sentences, --count of them, 32 by default), or a file: one prompt a line, or a TSV with a "
                        "Prompt column. Default: parti with a pipeline --model, mosaics with fashion-mosaic, classes "
                        "with the other embedded models")
    p.add_argument("--category", nargs="+", default=None, help="Parti categories to keep (e.g. Animals Vehicles)")
    p.add_argument("--count", type=positive_int, default=None,
                   help="at most this many prompts, spread over the categories (default: all)")
    p.add_argument("--seeds", nargs="+", type=seed, default=[0], help="seeds per prompt (default 0)")
    p.add_argument("--metrics", nargs="+", choices=EXTRA_METRICS, default=[],
                   help="extra metrics, run when their library and weights are here: clip (CLIP score), fid, kid, "
                        "lpips; a missing file is named in the report, the rest still runs")
    p.add_argument("--clip-model", default=None, metavar="PATH_OR_ID",
                   help="CLIP model for --metrics clip (local folder or a hub id already on this machine; default "
                        "openai/clip-vit-base-patch16)")
    p.add_argument("--images", "--cache", dest="images", type=Path, default=None,
                   help="the folder of generated images kept across runs (default OUT/images; --cache: its former "
                        "name): this command's own files (KEY.png, KEY.json), which it adds to and regenerates when "
                        "damaged; other files there are left alone")
    p.add_argument("--out", type=Path, default=Path("quality-results"),
                   help="output folder (default quality-results; created if missing), checked before the run. "
                        + OUT_HELP)
    p.add_argument("--stem", type=stem, default="quality",
                   help=f"file name stem of the outputs: STEM.md, .json, -grid.png, -plot.png ({STEM_HELP}; "
                        "default quality)")
    p.add_argument("--grid-rows", type=positive_int, default=8, help="prompts shown in the grid (default 8)")
    p.set_defaults(run=run)


# the embedded models: --model name -> (loader in tokenmerge.fashion, cache key)
EMBEDDED = {"fashion-unet": ("load_fashion_pipeline", "embedded Fashion-MNIST"),
            "fashion-dit": ("load_fashion_dit", "embedded Fashion-MNIST DiT"),
            "fashion-video": ("load_fashion_video", "embedded moving Fashion-MNIST video DiT"),
            "fashion-mosaic": ("load_fashion_mosaic", "embedded Fashion-MNIST mosaic DiT"),
            "fashion-video-long": ("load_fashion_video_long", "embedded moving Fashion-MNIST long video DiT")}
# the embedded models' default --prompts (the others: classes)
EMBEDDED_PROMPTS = {"fashion-mosaic": "mosaics"}


def default_prompts(args) -> str:
    """``--prompts`` when not given: parti for a pipeline, the embedded model's own set otherwise."""
    return EMBEDDED_PROMPTS.get(args.model, "classes") if embedded(args) else "parti"


def embedded(args) -> bool:
    """Whether ``--model`` names one of the embedded models (no ``--model``: the UNet)."""
    return args.model is None or args.model in EMBEDDED


def load(args, parser):
    """(pipeline, model key, device) for ``--model`` or the embedded model, moved to the chosen device."""
    import torch

    device = pick_device(args.device, parser)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "float16"))
    if embedded(args):
        from .. import fashion

        loader, key = EMBEDDED[args.model or "fashion-unet"]
        try:
            pipe = getattr(fashion, loader)()
        except (FileNotFoundError, ImportError) as err:
            parser.error(f"--model {args.model or 'fashion-unet'}: {err}")
        if args.size is not None:
            parser.error("--size applies to --model pipelines; the embedded models make images of their own size")
        from ..fashion.schedulers import describe, swap

        if args.scheduler is not None or args.shift is not None:
            try:
                swap(pipe, args.scheduler, args.shift)
            except ValueError as err:
                parser.error(f"--scheduler/--shift: {err}")
        key = f"{key}, {describe(pipe.scheduler)}"  # images of other time grids are other images
    else:
        from ..tools.pipelines import PipelineLoadError, load_pipeline

        if args.scheduler is not None or args.shift is not None:
            parser.error("--scheduler and --shift apply to the embedded models; a --model pipeline samples with its "
                         "own scheduler")
        try:
            pipe, key = load_pipeline(args.model, dtype), args.model
        except (FileNotFoundError, PipelineLoadError) as err:
            parser.error(f"--model: {err}")
    pipe = pipe.to(device) if pipe.dtype == dtype else pipe.to(device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe, key, device


def _check_methods(methods, parser) -> None:
    if any(m.name == "tomesd" for m in methods):
        try:
            import tomesd  # noqa: F401
        except ImportError:
            parser.error("--methods tomesd:...: needs the tomesd package (pip install tomesd==0.1.3)")


def check_class_names(items: list[tuple[str, str]], parser, model: str | None = None) -> None:
    """Every prompt names a class the embedded model knows (for fashion-mosaic: is one of its sentences), or an
    argument error quoting the first that does not (at most 200 characters of it) and where it is."""
    from ..fashion import CLASS_NAMES, class_ids

    if model == "fashion-mosaic":
        from ..fashion.data import parse_mosaic

        for prompt, where in items:
            try:
                parse_mosaic(prompt)
            except ValueError:
                parser.error(f"--prompts: the prompt at {where}, {quote(prompt)}, is not a sentence the mosaic model "
                             "knows: 'a <class> at the <top|bottom> <left|right>' parts joined by ', ' and ' and' "
                             "(e.g. 'a bag at the top left and a sneaker at the bottom right'), each cell named once")
        return
    for prompt, where in items:
        try:
            class_ids([prompt])
        except ValueError:
            parser.error(f"--prompts: the prompt at {where}, {quote(prompt)}, names no class the embedded "
                         f"Fashion-MNIST model knows; use one of: {', '.join(CLASS_NAMES)} (or pass --model)")


def run(args, parser) -> int:
    from ..quality.extra import make_extra_metrics
    from ..quality.prompts import load_prompt_items
    from ..quality.report import markdown, output_names, write_report
    from ..quality.run import MethodRefused, QualityJob, run_job
    from ..tools.outputs import Outputs

    _check_methods(args.methods, parser)
    cache = args.images or args.out / "images"
    outputs = Outputs(args.out, output_names(args.stem))
    check_outputs(parser, outputs, (cache, "--images" if args.images else "--out"))  # before any work
    try:
        items = load_prompt_items(args.prompts or default_prompts(args), args.category,
                                  args.count)
    except ValueError as err:
        parser.error(f"--prompts/--category/--count: {err}")
    if embedded(args):
        check_class_names(items, parser, args.model)
    prompts = [prompt for prompt, _ in items]
    pipe, key, device = load(args, parser)
    job = QualityJob(key, prompts, args.seeds, args.methods, args.steps, args.guidance, args.size, cache,
                     frames=getattr(pipe, "frames", 0))
    extra = make_extra_metrics(args.metrics, args.clip_model) if args.metrics else None
    try:
        report = run_job(pipe, job, device, progress=not args.no_progress, extra_metrics=extra)
    except MethodRefused as err:  # the warm-up round tries every method before the timed images
        print(f"tokenmerge quality: {err}\n(the images generated so far are kept; run again without that method)",
              file=sys.stderr)
        return 2
    if report is None:  # a worker process of a data-parallel run: the main process reports
        return 0
    command = "tokenmerge quality " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["quality"] else sys.argv[1:])
    paths = write_report(report, outputs, args.stem, command, args.grid_rows)
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
