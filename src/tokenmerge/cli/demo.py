"""``tokenmerge demo``: the main job on a fresh machine: the embedded model, vanilla vs merged, in minutes."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import check_outputs
from .quality import _check_methods, add_common, embedded, load

HELP = """\
Generate the same prompts and seeds with the vanilla model and with a few token-merging settings, print a
timing and fidelity table and write a comparison grid. Offline, no download: by default it runs the small
Fashion-MNIST diffusion model that ships inside tokenmerge (32x32 images, 1024 tokens at its finest level).
With --model it does the same on a real diffusers pipeline you have locally (four Parti prompts).

It writes demo.md, demo.json, demo-grid.png and demo-plot.png into --out, and caches its images in OUT/cache.
Running it again into the same folder replaces those files when they are the ones it wrote (it records them
with their checksums in OUT/.tokenmerge-outputs.json) and reuses the cache; a file of yours in their place, or
one of them edited since, is never overwritten: the demo stops before it runs and names it.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="vanilla vs merged on the embedded model (or --model): table and grid",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, ["tome:0.3", "tome:0.5", "todo:2"], 20)
    p.add_argument("--out", type=Path, default=Path("tokenmerge-demo"),
                   help="output folder (default tokenmerge-demo; created if missing): demo.md, .json, -grid.png, "
                        "-plot.png and the image cache OUT/cache, replaced or reused on a rerun (see above)")
    p.set_defaults(run=run)


def run(args, parser) -> int:
    from ..quality.prompts import load_prompts
    from ..quality.report import markdown, output_names, write_report
    from ..quality.run import QualityJob, run_job
    from ..tools.outputs import Outputs

    _check_methods(args.methods, parser)
    outputs = Outputs(args.out, output_names("demo"), stem_option=None)
    check_outputs(parser, outputs, (args.out / "cache", "--out"))  # before any work
    pipe, key, device = load(args, parser)
    prompts = load_prompts("classes") if embedded(args) else load_prompts("parti", count=4)
    seeds = [0]
    job = QualityJob(key, prompts, seeds, args.methods, args.steps, args.guidance, args.size, args.out / "cache")
    report = run_job(pipe, job, device, progress=not args.no_progress)
    if report is None:
        return 0
    paths = write_report(report, outputs, "demo", "tokenmerge demo", grid_rows=len(prompts) * len(seeds))
    print(markdown(report))
    print(f"grid: {paths['grid']}\nreport: {paths['markdown']}")
    if embedded(args):
        print("Speed on this small model is not what a real one gets: its attention over 1024 tokens of 32 channels is "
              "cheap, so merging has little to save. `tokenmerge bench --preset sd15` measures speed at real sizes.")
    return 0
