"""``tokenmerge demo``: the main job on a fresh machine: the embedded model, vanilla vs merged, in minutes."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import check_outputs
from .quality import EMBEDDED_PROMPTS, _check_methods, add_common, embedded, load

HELP = """\
Generate the same prompts and seeds with the vanilla model and with tokenmerge.accelerate (the UNet cache on the
UNet, the step cache on the transformers) beside ToMe and ToDo, print a timing and fidelity table
and write a comparison grid. Offline, no download: by default it runs the three small
models that ship inside tokenmerge, trained on Fashion-MNIST, on five of its classes: a diffusers UNet (32x32
images, 1024 tokens at its finest level), a Flux.1-style transformer (256 image tokens beside 4 text tokens) and a
Wan-style video transformer (8-frame clips, 512 tokens), then times one denoising step of the Wan 2.1 1.3B
architecture at 480x832 x 9 frames (its real widths with 1 of its 30 blocks and RANDOM weights: a speed figure,
not images), vanilla against ToMe per attention, whole-block ToMe and the step cache (a computed and a skipped
step). With --model
it does the first part on a real diffusers pipeline you have locally (four Parti prompts).

It writes demo.md, demo.json, demo-grid.png and demo-plot.png (and demo-dit.*, demo-video.*, demo-video.gif,
demo-speed.md for the embedded models) into --out, and caches its images in OUT/cache.
Running it again into the same folder replaces those files when they are the ones it wrote (it records them
with their checksums in OUT/.tokenmerge-outputs.json) and reuses the cache; a file of yours in their place, or
one of them edited since, is never overwritten: the demo stops before it runs and names it.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="vanilla vs merged on the embedded model (or --model): table and grid",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, ["auto", "tome:0.5", "todo:2"], 20)
    p.add_argument("--no-speed", action="store_true", help="skip the real-width speed figure (about a minute)")
    p.add_argument("--out", type=Path, default=Path("tokenmerge-demo"),
                   help="output folder (default tokenmerge-demo; created if missing): demo.md, .json, -grid.png, "
                        "-plot.png and the image cache OUT/cache, replaced or reused on a rerun (see above)")
    p.set_defaults(run=run)


# the classes the embedded models draw (indices into the ten Fashion-MNIST class names): clothes, shoes and a bag,
# five so that the demo stays within a few minutes on 2 cores
CLASSES = (0, 1, 3, 7, 8)
# the embedded transformers' parts of the demo: (--model name, output stem, methods)
# the transformers: tokenmerge.accelerate (the step cache at the frontier's points: benchmarks/results/frontier/), the
# faithful setting there, beside ToMe in every step and in the second half of the steps only (start=0.5)
TRANSFORMERS = (("fashion-dit", "demo-dit", ("auto", "auto,speed=fast", "tome:0.5", "tome:0.5,start=0.5", "todo:2")),
                ("fashion-video", "demo-video", ("auto", "auto,speed=fast", "tome:0.5", "tome:0.5,start=0.5",
                                                 "todo:1x2x2")))
# the speed figure: one block of the real-width Wan preset is enough for a per-block speed-up (the others are alike)
# and keeps it under a minute on 2 cores; ToDo's speed-up at this size is small (`tokenmerge bench` gives it)
SPEED = dict(preset="wan-1b", resolution="480x832", frames=9,
             methods=("vanilla", "tome:0.5", "tome:0.5,scope=block", "stepcache:1"), repeats=1)


def _outputs(args):
    from ..quality.report import output_names
    from ..tools.outputs import Outputs

    names = output_names("demo")
    if args.model is None:
        names += [n for _, stem, _ in TRANSFORMERS for n in output_names(stem)] + ["demo-video.gif"]
        names += [] if args.no_speed else ["demo-speed.md"]
    return Outputs(args.out, names, stem_option=None)


def run(args, parser) -> int:
    from ..quality.prompts import load_prompts
    from ..quality.report import markdown, write_report
    from ..quality.run import QualityJob, run_job
    from ..tools.methods import parse_spec

    _check_methods(args.methods, parser)
    outputs = _outputs(args)
    check_outputs(parser, outputs, (args.out / "cache", "--out"))  # before any work
    parts = [(args.model, "demo", args.methods)]
    if args.model is None:
        parts += [(name, stem, [parse_spec(m) for m in methods]) for name, stem, methods in TRANSFORMERS]
    for model, stem, methods in parts:
        missing = _missing_class(model)
        if missing:
            print(f"{model}: skipped: {missing}\n")
            continue
        args.model = model
        pipe, key, device = load(args, parser)
        if embedded(args) and EMBEDDED_PROMPTS.get(model):  # fashion-mosaic: five of its sentences
            prompts = load_prompts(EMBEDDED_PROMPTS[model], count=len(CLASSES))
        elif embedded(args):
            prompts = [load_prompts("classes")[i] for i in CLASSES]
        else:
            prompts = load_prompts("parti", count=4)
        job = QualityJob(key, prompts, [0], methods, args.steps, args.guidance, args.size, args.out / "cache",
                         frames=getattr(pipe, "frames", 0))
        report = run_job(pipe, job, device, progress=not args.no_progress)
        if report is None:
            return 0
        paths = write_report(report, outputs, stem, "tokenmerge demo", grid_rows=len(prompts))
        print(markdown(report))
        print(f"grid: {paths['grid']}\nreport: {paths['markdown']}\n")
        if job.frames:
            _gif(job, outputs)
    if parts[0][0] is None:  # the embedded models
        print("Speed on these small models is not what a real one gets: their attention over 256-1024 tokens is "
              "cheap, so merging has little to save there.")
        if not args.no_speed and not _missing_class("fashion-video"):
            _speed(args, outputs, device)
    return 0


def _missing_class(model: str | None) -> str | None:
    """Why an embedded transformer cannot run on the installed diffusers (None: it can)."""
    import diffusers

    cls = {"fashion-dit": "FluxTransformer2DModel", "fashion-video": "WanTransformer3DModel",
           "fashion-mosaic": "FluxTransformer2DModel", "fashion-video-long": "WanTransformer3DModel"}.get(model or "")
    if cls and not hasattr(diffusers, cls):
        return f"diffusers {diffusers.__version__} has no {cls}, the class of this model"
    return None


def _gif(job, outputs) -> None:
    """demo-video.gif: the first prompt's clip, vanilla and each method side by side, from the cached frame strips
    the quality run just made (same noise, no generation)."""
    from PIL import Image

    from ..quality.images import ImageCache

    cache = ImageCache(job.cache)
    strips = [cache.load(job.key(spec, job.prompts[0], job.seeds[0]))[0].convert("L") for spec in job.all_specs]
    w, h = strips[0].width // job.frames, strips[0].height
    frames = []
    for f in range(job.frames):  # frame f of every clip, left to right, 4x larger
        row = Image.new("L", (w * len(strips), h))
        for i, strip in enumerate(strips):
            row.paste(strip.crop((f * w, 0, (f + 1) * w, h)), (i * w, 0))
        frames.append(row.resize((row.width * 4, h * 4), Image.NEAREST))
    path = outputs.write("demo-video.gif", lambda tmp: frames[0].save(tmp, format="GIF", save_all=True,
                                                                     append_images=frames[1:], duration=150, loop=0))
    print(f"clip ({', '.join(s.label for s in job.all_specs)}, left to right): {path}\n")


def _speed(args, outputs, device) -> None:
    """One denoising step of a real-width video preset, vanilla vs ToMe and ToDo (random weights, REDUCED)."""
    import torch

    from ..bench.presets import resolve
    from ..bench.report import annotate
    from ..bench.report import markdown as bench_markdown
    from ..bench.runner import run_grid
    from ..tools.methods import parse_spec

    preset = resolve(SPEED["preset"])
    print(f"Timing one step of {preset.name} ({preset.description}) at {SPEED['resolution']} x {SPEED['frames']} "
          "frames, RANDOM weights, one timed round after a warm-up round...", flush=True)
    modes = [parse_spec(m, bench=True) for m in SPEED["methods"]]
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    records, meta = run_grid([preset], ["sdpa"], [SPEED["resolution"]], [1], modes, repeats=SPEED["repeats"],
                             device=device,
                             dtype=dtype, progress=not args.no_progress, frames=[SPEED["frames"]],
                             log=lambda *a: None)
    command = (f"tokenmerge bench --preset {SPEED['preset']} --resolutions {SPEED['resolution']} --frames "
               f"{SPEED['frames']} --methods {' '.join(SPEED['methods'][1:])} --repeats {SPEED['repeats']}")
    annotate(records)
    text = bench_markdown(records, meta, command)
    outputs.write_text("demo-speed.md", text)
    print(text)
