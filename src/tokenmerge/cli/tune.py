"""``tokenmerge tune``: the fastest cache schedule that holds a fidelity target on a model (or the most faithful within
a speed), searched on some prompts and seeds, verified on others; a report, a plot and the setting file."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from .common import OUT_HELP, STEM_HELP, check_outputs, finite_float, positive_int, seed, stem

HELP = """\
Search this library's cache schedules (the step cache on a transformer, the UNet cache on a UNet) for the fastest
that holds --target-psnr (dB of float PSNR to the unpatched output from the same noise), or the most faithful that
computes at most 1/--speed of the steps, on the first half of the prompts at the first half of the seeds; verify the
choice on the other prompts at the other seeds (never used by the search). Writes STEM.md and STEM.json (the report:
every candidate, the held-out PSNR per prompt, the points beside it), STEM-plot.png (speed against fidelity: the
candidates, the chosen point, accelerate's presets and the --peers) and STEM-setting.json, which
tokenmerge.accelerate(pipe, setting="STEM-setting.json") applies. Everything goes into --out; no other file is
written.
"""

# the step count of the pipeline each embedded model stands for (Flux.1-dev 28, SD3 28, Wan 50; the UNet's 25)
EMBEDDED_STEPS = {"fashion-unet": 25, "fashion-dit": 28, "fashion-video": 50, "fashion-mosaic": 28,
                  "fashion-video-long": 50}


def _spec(text: str):
    from ..tools.methods import parse_spec

    try:
        return parse_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_parser(sub) -> None:
    from .quality import add_common

    p = sub.add_parser("tune", help="the fastest cache schedule that holds a fidelity target on your model, verified",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, [], 0)
    p.set_defaults(methods=None)
    for action in p._actions:  # (quality's --methods and --steps: tune has --peers, and steps by model)
        if action.dest == "methods":
            action.help = argparse.SUPPRESS
        if action.dest == "steps":
            action.default = None
            action.help = ("denoising steps (default: the pipeline's; the embedded models: the step count of the "
                           "pipeline each stands for, fashion-mosaic 28, fashion-video-long 50, fashion-unet 25)")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target-psnr", type=finite_float, default=None, metavar="DB",
                      help="the fidelity to hold: mean PSNR (dB) to the unpatched output on the held-out items")
    goal.add_argument("--speed", type=finite_float, default=None, metavar="X",
                      help="the speed to reach: at most 1/X of the steps computed (X > 1, e.g. 2.5)")
    p.add_argument("--prompts", default=None, metavar="SOURCE",
                   help="as tokenmerge quality's (parti, classes, mosaics, or a file); default as there")
    p.add_argument("--count", type=positive_int, default=4,
                   help="prompts taken from --prompts (default 4: 2 searched, 2 held out)")
    p.add_argument("--seeds", nargs="+", type=seed, default=[0, 1],
                   help="seeds, at least 2 (default 0 1): the first half searched, the rest held out")
    p.add_argument("--budget", type=positive_int, default=40,
                   help="generations in all: references, search, verification, timing (default 40)")
    p.add_argument("--timing", type=int, default=1, metavar="N",
                   help="interleaved (vanilla, setting) generation pairs timed beyond the verification's (default 1)")
    p.add_argument("--peers", nargs="*", type=_spec, default=[], metavar="SPEC",
                   help="peer methods run on the held-out items for the report and plot (fbc:0.05, magcache:0.12, "
                        "seacache:0.25, cachedit:0.2,taylorseer=true...: tokenmerge quality's specs)")
    p.add_argument("--no-presets", action="store_true", help="do not run accelerate's three speeds beside it")
    p.add_argument("--out", type=Path, default=Path("tune-results"),
                   help="output folder (default tune-results; created if missing), checked before the run. " + OUT_HELP)
    p.add_argument("--stem", type=stem, default="tune",
                   help=f"file name stem: STEM.md, .json, -plot.png, -setting.json ({STEM_HELP}; default tune)")
    p.set_defaults(run=run)


def output_names(name: str) -> list[str]:
    return [f"{name}.md", f"{name}.json", f"{name}-plot.png", f"{name}-setting.json"]


def run(args, parser) -> int:
    from ..quality.prompts import load_prompt_items
    from ..quality.tune_report import compare, markdown, plot
    from ..tools.methods import parse_spec
    from ..tools.outputs import Outputs
    from ..tuning import run_tune
    from .quality import check_class_names, default_prompts, embedded, load

    if args.timing < 0:
        parser.error(f"--timing must be an integer >= 0; got {args.timing}")
    outputs = Outputs(args.out, output_names(args.stem))
    check_outputs(parser, outputs)  # before any work
    try:
        items = load_prompt_items(args.prompts or default_prompts(args), None, args.count)
    except ValueError as err:
        parser.error(f"--prompts/--count: {err}")
    if embedded(args):
        check_class_names(items, parser, args.model)
    prompts = [prompt for prompt, _ in items]
    steps = args.steps if args.steps is not None else EMBEDDED_STEPS.get(args.model or "fashion-unet") \
        if embedded(args) else None
    pipe, key, device = load(args, parser)
    call = {}
    if args.guidance is not None:
        call["guidance_scale"] = args.guidance
    if args.size is not None:
        call["height"] = call["width"] = args.size
    try:
        tuned, search = run_tune(pipe, prompts, target_psnr=args.target_psnr, speed=args.speed, seeds=args.seeds,
                                 steps=steps, call_kwargs=call, budget=args.budget, timing=args.timing,
                                 progress=not args.no_progress)
    except (ValueError, TypeError) as err:
        print(f"tokenmerge tune: {err}", file=sys.stderr)
        return 2
    before = search.runner.generations
    points = [] if args.no_presets else [
        (parse_spec(f"auto,speed={s}"), f"accelerate {s}", "preset") for s in ("faithful", "balanced", "fast")]
    points += [(spec, spec.label, "peer") for spec in args.peers]
    compared = []
    for spec, label, kind in points:
        try:
            compared.append({**compare(search, spec, label), "kind": kind})
        except (ValueError, TypeError, RuntimeError, ImportError) as err:
            print(f"tokenmerge tune: {spec.text} not run beside it: {err}", file=sys.stderr)
    command = "tokenmerge tune " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["tune"] else sys.argv[1:])
    setting_name = f"{args.stem}-setting.json"
    report = {"model": key, "command": command, "tuned": tuned.to_json(), "compare": compared,
              "compare_generations": search.runner.generations - before, "setting_file": setting_name}
    paths = [outputs.write_text(setting_name, json.dumps(tuned.to_json(), indent=1) + "\n"),
             outputs.write_text(f"{args.stem}.md", markdown(report)),
             outputs.write_text(f"{args.stem}.json", json.dumps(report, indent=1) + "\n")]
    try:
        paths.append(outputs.write(f"{args.stem}-plot.png", lambda tmp: plot(report, tmp)))
    except ImportError:
        print("tokenmerge tune: no plot (matplotlib is not installed)", file=sys.stderr)
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
