"""What ``tokenmerge tune`` writes (``tokenmerge.tune``'s result, reported): the report (Markdown and JSON), a
speed-versus-fidelity plot of the candidates with the chosen point, ``accelerate``'s presets and the peers marked,
and the points beside the tune (``compare``: a method spec's PSNR on the held-out items, from the same
references)."""

from __future__ import annotations

import statistics

from ..tools.peers import calibrate, computed_share, needs_calibration
from ..tuning import fidelity
from .run import linear_work

__all__ = ["compare", "markdown", "plot", "HOW"]

HOW = ("PSNR is computed in float (data range 1) between each output and the unpatched model's output from the same "
       "noise (a CPU generator seeded by the item), over the whole output (every frame of a clip), then averaged over "
       "the items. Figures from code that squares the difference of two `uint8` images without a cast (cache-dit "
       "1.5.3's default `PSNR_TYPE = \"custom\"`, L2P's `evaluate.py`) are not comparable: the difference wraps "
       "modulo 256, so their PSNR cannot fall below 24.07 dB and reads high.")


def compare(search, spec, label: str) -> dict:
    """``spec`` (a method spec: ``auto,speed=fast``, ``fbc:0.05``, ``cachedit:0.2``...) on the tune's held-out items:
    its PSNR to their references, its speed-up (in steps: the steps over the computed ones, by this library's or
    cache-dit's own count; else over its share of the unpatched model's ``nn.Linear`` work) and its seconds."""
    pipe, runner = search.pipe, search.runner
    first = search.held[0]
    if needs_calibration(spec):  # MagCache's ratios, from one unpatched generation at these steps
        calibrate(pipe, lambda: runner(first), runner.steps)
    with linear_work(pipe) as base:  # the unpatched model's linear work on the first held-out item
        runner(first)
    values, seconds, shares, works = [], [], [], []
    with spec.applied(pipe):
        for item in search.held:
            with linear_work(pipe) as work:
                out, took = runner(item)
            values.append(fidelity(out, search.reference(item)))
            seconds.append(took)
            works.append(work[0])
            counted = computed_share(pipe)
            if counted is not None and counted.get("computed") is not None:
                shares.append(counted["computed"])
    share = statistics.fmean(shares) if len(shares) == len(values) else None
    work = statistics.fmean(works) / base[0] if base[0] else None
    speed = 1 / share if share else 1 / work if work else None
    return {"label": label, "spec": spec.text, "held_out": round(statistics.fmean(values), 3),
            "worst": round(min(values), 3), "step_speedup": None if speed is None else round(speed, 3),
            "speedup_by": "steps" if share else "counted linear work", "seconds": round(statistics.median(seconds), 3)}


def _fmt(value, form: str = ".2f") -> str:
    return "-" if value is None else format(value, form)


def markdown(report: dict) -> str:
    """The report in Markdown: what was asked and chosen, how it was verified, every candidate, the points beside."""
    t = report["tuned"]
    f, cal, held = t["tuned_for"], t["calibration"], t["held_out"]
    asked = f"target_psnr={t['target']['psnr']:g} dB" if "psnr" in t["target"] else \
        f"speed={t['target']['speed']:g} (at most {int(f['grid_steps'] / t['target']['speed'] + 1e-9)} of " \
        f"{f['grid_steps']} steps computed)"
    verdict = {True: "holds the target", False: "**below the target**", None: "a speed: no target"}[t["holds"]]
    config = t["config"]
    setting = " ".join(f"{k}={v}" for k, v in config.items() if v not in (None, (), []) and not (
        k == "skip_growth" and config.get("skip") is None))
    lines = [f"# tokenmerge tune: {report['model']}", "", f"`{report['command']}`", "",
             f"Tuned for {asked} on {f['model']} ({f['pipeline']}), {f['steps']} steps, scheduler "
             f"{f['scheduler'].get('class')}, output {' x '.join(map(str, f['output']))}, guidance {f['guidance']}; "
             f"device {t['device']}, tokenmerge {t['tokenmerge']}, {t['created']}.", "",
             "## Chosen", "",
             f"- **{t['technique']}**: `{setting}`",
             f"- {t['computed']} of {f['grid_steps']} steps computed: **{t['step_speedup']:.2f}x in steps**, "
             f"{_fmt(t['wall_speedup'])}x wall (vanilla's seconds over the setting's, interleaved medians on "
             f"{t['device']})",
             f"- held-out PSNR **{held['mean']:.2f} dB** (worst {held['worst']:.2f}, 95% interval +-"
             f"{_fmt(held['ci95'])}, {held['n']} items: prompts and seeds the search never used): {verdict}",
             f"- calibration PSNR {_fmt(cal.get('mean'))} dB (worst {_fmt(cal.get('worst'))}, {cal.get('n', 0)} items)",
             f"- {t['generations']} generations of a budget of {t['budget']} (references, search, verification, "
             f"timing)" + (f" in {t['seconds'] / 60:.1f} minutes" if t.get("seconds") else "")
             + f"; the points beside took {report.get('compare_generations', 0)} more",
             f"- the setting: `{report.get('setting_file', '')}`: `tokenmerge.accelerate(pipe, setting=PATH)`", "",
             "## Held-out PSNR per item", "", "| prompt | seed | PSNR (dB) |", "|---|---|---|"]
    lines += [f"| {p[:80]} | {s} | {v:.2f} |" for (p, s), v in zip(held["items"], held["per_item"])]
    lines += ["", "## Candidates evaluated (calibration items; the chosen one verified)", "",
              "| setting | computed | speed-up in steps | calibration PSNR | held-out PSNR |", "|---|---|---|---|---|"]
    for c in sorted(t["candidates"], key=lambda c: (c["computed"], -(c["calibration"] or 0))):
        name = " ".join(f"{k}={v}" for k, v in c["setting"].items())
        mark = " **chosen**" if c["chosen"] else ""
        lines.append(f"| `{name}`{mark} | {c['computed']} | {f['grid_steps'] / c['computed']:.2f}x | "
                     f"{_fmt(c['calibration'])} | {_fmt(c['held_out'])} |")
    if report.get("compare"):
        lines += ["", "## Beside it, on the same held-out items", "",
                  "| method | speed-up (in steps, or counted) | held-out PSNR | worst | seconds (median) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {p['label']} (`{p['spec']}`) | {_fmt(p['step_speedup'])}x ({p['speedup_by']}) | "
                  f"{p['held_out']:.2f} | {p['worst']:.2f} | {p['seconds']:.2f} |" for p in report["compare"]]
    lines += ["", "## How it was measured", "", HOW,
              "Speed-up in steps: the steps over the steps computed (per call of a step, by the cache's own count); "
              "a peer whose cache keeps no count: counted, the unpatched model's `nn.Linear` multiply-adds over its "
              "own (zero overhead: an upper bound). The search: bisection on the number of computed steps over the "
              "distinct masks of this library's schedules on this time grid, then more masks just below the count "
              "found; the verification on the held-out items; where their mean fell below the target, the next more "
              "faithful candidate (docs/guides/tune.md)."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Speed (in steps, or counted) against PSNR: the candidates on the calibration items, the chosen one held out,
    the points beside (presets, peers) held out, the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = report["tuned"]
    steps = t["tuned_for"]["grid_steps"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    cands = [c for c in t["candidates"] if c["calibration"] is not None]
    ax.scatter([steps / c["computed"] for c in cands], [c["calibration"] for c in cands], s=18, c="0.6",
               label="candidates (calibration)")
    ax.scatter([t["step_speedup"]], [t["held_out"]["mean"]], s=120, marker="*", c="tab:red", zorder=5,
               label="chosen (held out)")
    styles = {"preset": ("s", "tab:blue"), "peer": ("^", "tab:orange")}
    for kind, (marker, color) in styles.items():
        points = [p for p in report.get("compare", []) if p.get("kind") == kind and p["step_speedup"]]
        if points:
            ax.scatter([p["step_speedup"] for p in points], [p["held_out"] for p in points], marker=marker, c=color,
                       label=f"{'presets' if kind == 'preset' else 'peers'} (held out)")
            for p in points:
                ax.annotate(p["label"], (p["step_speedup"], p["held_out"]), fontsize=7)
    if "psnr" in t["target"]:
        ax.axhline(t["target"]["psnr"], ls="--", c="tab:red", lw=0.8, label="target")
    else:
        ax.axvline(t["target"]["speed"], ls="--", c="tab:red", lw=0.8, label="speed asked")
    ax.set_xlabel("speed-up in steps (steps / computed steps; peers without a count: counted linear work)")
    ax.set_ylabel("PSNR to the unpatched output (dB)")
    ax.set_title(f"tune: {report['model']}, {steps} steps", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
