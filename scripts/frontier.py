"""Speed versus fidelity: one family's bench table (speed at a real width) joined with the quality table of the
trained embedded model of that family (fidelity), its Pareto frontier marked. Writes STEM.md and STEM.png.

    python scripts/frontier.py --bench benchmarks/results/perf/cpu-flux-2+4-1024-scope.jsonl [MORE.jsonl] \
        --quality benchmarks/results/quality/quality-fashion-dit-caches.json --out benchmarks/results/frontier \
        --stem frontier-dit --title "Flux.1-style DiT"

x, the speed-up of a setting:
- a token reduction (tome, todo): its step speed-up over vanilla in the bench table (same spec), measured;
- token reuse and the step cache: the bench's measured full (computed) step and partial (token reuse) or skipped
  (the step cache) step, over vanilla's, weighted by the setting's schedule over the generation;
- a cache alone (fbc, taylorseer, pab): 1 / the share of vanilla's linear work it ran on the trained model (counted
  during the quality run): its speed-up at zero overhead, since a cache's savings depend on the trained model's
  trajectory, which random-weight presets do not have;
- a combination: the token reduction's measured speed-up times the cache's further saving on the trained model
  (the token reduction's linear work over the combination's).
y: PSNR (and SSIM) to the vanilla model's output from the same noise, on the trained model.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from tokenmerge.tools.methods import Combined, MethodSpec, parse_spec


def _kind(spec) -> str:
    if isinstance(spec, Combined):
        return "combined"
    return "cache" if spec.is_cache or spec.is_across_steps or spec.name == "auto" else "tokens"


def _step_speed(speed: dict, spec: MethodSpec):
    """(speed-up, how) of a token reduction: measured for one step; with a start/stop schedule, the measured step
    speed-up on that fraction of the steps and vanilla on the rest (1 / ((1 - f) + f / s))."""
    if spec.text in speed:
        return speed[spec.text], "measured"
    options = dict(spec.options)
    plain = MethodSpec(spec.name, spec.value, tuple((k, v) for k, v in spec.options if k not in ("start", "stop")))
    if plain.text != spec.text and plain.text in speed:
        on = max(0.0, options.get("stop", 1.0) - options.get("start", 0.0))
        return 1 / ((1 - on) + on / speed[plain.text]), f"measured step, on {on:.0%} of steps"
    return None, ""


def _reuse_speed(steps_by_fraction: dict, spec: MethodSpec, steps: int):
    """(speed-up, how) of token reuse over a generation of ``steps`` steps: its full steps at the bench's measured
    full step, each partial step at the bench's measured partial step of its fraction (linearly interpolated
    between the measured fractions: a step's work is affine in the tokens it recomputes)."""
    measured = steps_by_fraction.get((spec.name, spec.steady().options))
    if not measured:
        return None, ""
    schedule = spec.reuse_config().schedule(steps)
    fractions = sorted(measured)
    fulls = [measured[f][0] for f in fractions if measured[f][0]]
    if not fulls:
        return None, ""
    full = sum(fulls) / len(fulls)  # the full step does not depend on the fraction: the mean of its measures

    def partial(f):  # time of a partial step over vanilla's
        if f in measured:
            return measured[f][1]
        lower = [g for g in fractions if g < f]
        upper = [g for g in fractions if g > f]
        if not lower or not upper:
            return None
        a, b = lower[-1], upper[0]
        return measured[a][1] + (measured[b][1] - measured[a][1]) * (f - a) / (b - a)

    times = [full if f is None else partial(f) for f in schedule]
    if any(t is None for t in times):
        return None, ""
    n_full = sum(f is None for f in schedule)
    used = sorted({f for f in schedule if f})
    at = "" if not used else " (at " + (f"{used[0]:g}" if len(used) == 1 else f"{used[0]:.2f} to {used[-1]:.2f}") + (
        "" if all(f in measured for f in used) else ", interpolated between measured fractions") + ")"
    return 1 / (sum(times) / steps), f"measured steps: {n_full} full + {steps - n_full} partial{at} of {steps}"


def _cache_speed(measured: dict, spec: MethodSpec, steps: int, share: float | None = None):
    """(speed-up, how) of the step cache over a generation of ``steps`` steps: its computed steps at the bench's
    measured computed step, its skipped steps at the bench's measured skipped step (each over vanilla's). A skipped
    step's work does not depend on the schedule nor on the slope's factor (one multiply-add whatever it is): any
    measured record of the same ``order`` serves. ``share``: the share of the steps the generations computed, as
    the cache counted them (a schedule that follows the time grid: ``steps_computed`` of the quality report); else
    the config's schedule on the linear grid."""
    def key(options):
        return tuple((k, v) for k, v in options if k != "extrapolate")

    want = key(spec.steady().options)
    found = [steps for (name, options), steps in measured.items() if name == spec.name and key(options) == want]
    if not found:
        return None, ""
    full, skipped = next(iter(found[0].values()))
    computed = share * steps if share is not None else sum(spec.config().schedule(steps))
    return steps / (computed * full + (steps - computed) * skipped), (
        f"measured steps: {computed:.3g} computed + {steps - computed:.3g} skipped of {steps}"
        + (" (counted in the generations)" if share is not None else ""))


def _reuse_table(bench: list[dict]) -> dict:
    """Token reuse's measured steps: {steady options: {fraction: (full step time, partial step time) over
    vanilla's}}, from the bench records (each times a full and a partial step)."""
    table: dict = {}
    for r in bench:
        if r.get("status") != "ok" or not r.get("speedup") or not r.get("full_speedup"):
            continue
        spec = parse_spec(r["spec"], bench=True)
        if not spec.stateful:
            continue
        table.setdefault((spec.name, spec.steady().options), {})[spec.value] = (1 / r["full_speedup"],
                                                                                1 / r["speedup"])
    return table


def points(bench: list[dict], quality: dict, omit: dict | None = None,
           auto: MethodSpec | None = None) -> tuple[list[dict], list[str]]:
    """(points, notes): one point per quality method with a speed; notes name the methods left out and why (``omit``:
    {label: why} left out on purpose; ``auto``: the cache whose bench record times accelerate's computed and cached
    steps on this model)."""
    speed = {r["spec"]: r["speedup"] for r in bench if r.get("status") == "ok" and r.get("speedup")}
    reuse = _reuse_table(bench)
    work = {m["spec"]: m.get("linear_work") for m in quality["methods"]}
    out, notes = [], []

    def token_speed(spec, share=None):
        if spec.name == "auto" and auto is not None:
            return _cache_speed(reuse, auto, quality.get("steps", 20), share)
        if spec.is_across_steps:
            return _cache_speed(reuse, spec, quality.get("steps", 20), share)
        if spec.stateful:
            return _reuse_speed(reuse, spec, quality.get("steps", 20))
        return _step_speed(speed, spec)

    for m in quality["methods"]:
        if m["spec"] == "vanilla":
            continue
        if m["label"] in (omit or {}):
            notes.append(f"{m['label']}: {omit[m['label']]}")
            continue
        spec = parse_spec(m["spec"])
        kind = _kind(spec)
        if kind == "tokens" or spec.is_across_steps or spec.name == "auto":
            x, how = token_speed(spec, m.get("steps_computed"))
        elif kind == "cache":
            x, how = (1 / m["linear_work"] if m.get("linear_work") else None), "counted"
        else:
            token = next(p for p in spec.parts if not p.is_cache)
            (base, how), base_work = token_speed(token), work.get(token.text)
            x = base * base_work / m["linear_work"] if base and base_work and m.get("linear_work") else None
            how += " x counted"
        if x is None:
            notes.append(f"{m['label']}: no speed (not in the bench table, or no linear work counted)")
            continue
        psnr = m["psnr_mean"] if isinstance(m["psnr_mean"], float) else float("inf")
        if psnr == float("inf"):
            notes.append(f"{m['label']}: identical to vanilla on this model (it skipped or merged nothing)")
            continue
        own = spec.is_across_steps or spec.name == "auto"  # this library's caches across steps
        out.append(dict(label=m["label"], spec=m["spec"], kind=kind, step=own, speedup=x, how=how,
                        psnr=psnr, psnr_ci=m.get("psnr_ci95"), ssim=m["ssim_mean"], work=m.get("linear_work")))
    for p in out:  # on the frontier: no other point is at least as fast and as faithful, and better in one
        p["frontier"] = not any(q is not p and q["speedup"] >= p["speedup"] and q["psnr"] >= p["psnr"]
                                and (q["speedup"] > p["speedup"] or q["psnr"] > p["psnr"]) for q in out)
    return sorted(out, key=lambda p: p["speedup"]), notes


def markdown(pts, notes, bench_cmds, quality_cmd: str, title: str) -> str:
    if isinstance(bench_cmds, str):
        bench_cmds = [bench_cmds]
    speed = " and ".join(f"`{c}`" for c in bench_cmds)
    lines = [f"### Speed versus fidelity: {title}", "",
             f"Speed: {speed} (random weights at real widths, each setting against vanilla in its own table; "
             "diffusers' caches: counted on the trained model, see below).",
             f"Fidelity: `{quality_cmd}` (the trained embedded model).", "",
             "| setting | kind | speed-up | how | PSNR (dB) | SSIM | linear work | frontier |",
             "|---|---|---|---|---|---|---|---|"]
    for p in pts:
        ci = f" ± {p['psnr_ci']:.2f}" if isinstance(p["psnr_ci"], float) else ""
        work = f"{p['work']:.0%}" if p["work"] else ""
        lines.append(f"| {p['label']} | {p['kind']} | {p['speedup']:.2f}x | {p['how']} | {p['psnr']:.2f}{ci} | "
                     f"{p['ssim']:.3f} | {work} | {'yes' if p['frontier'] else ''} |")
    lines += ["", "Kind: tokens = a token reduction (ToMe, ToDo, token reuse); cache = a cache across steps (the "
              "step cache, stepcache; the UNet cache, unetcache; diffusers' caches); combined = both. "
              "Speed-up, how: measured = the bench's step time (medians, interleaved); on N% of steps = a "
              "schedule (start/stop): the measured step speed-up on that share of the steps, vanilla on the rest; "
              "measured steps (token reuse, the step cache): the bench's measured full (computed) step and partial "
              "step (token reuse: its fraction's, or interpolated between two measured fractions) or skipped step "
              "(the step cache: no block runs; the UNet cache: a cached step, the shallow path only), weighted by the "
              "generation's schedule; "
              "counted = 1 / the share of vanilla's nn.Linear multiply-adds the cache ran on the trained model (zero "
              "overhead: an upper bound); x counted = times the cache's further saving on top of the token "
              "reduction (its linear work over the combination's)."]
    lines += [f"- left out: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(pts, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    style = {"tokens": ("o", "tab:blue", "token reduction (measured)"),
             "step": ("D", "tab:red", "step / UNet cache (measured steps)"),
             "cache": ("s", "tab:orange", "diffusers cache (counted)"), "combined": ("^", "tab:green", "both")}
    for kind, (marker, color, label) in style.items():
        sel = [p for p in pts if ("step" if p["step"] else p["kind"]) == kind]
        if sel:
            ax.scatter([p["speedup"] for p in sel], [p["psnr"] for p in sel], marker=marker, color=color,
                       label=label, zorder=3)
    front = sorted((p for p in pts if p["frontier"]), key=lambda p: p["speedup"])
    ax.plot([p["speedup"] for p in front], [p["psnr"] for p in front], "k--", lw=1, label="frontier", zorder=2)
    for p in pts:  # the frontier's points and the other methods' named; the many reuse and step cache settings off
        if p["frontier"] or not (p["step"] or p["label"].startswith("reuse")):  # it are not
            ax.annotate(p["label"], (p["speedup"], p["psnr"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("speed-up over vanilla")
    ax.set_ylabel("PSNR to vanilla (dB), trained model")
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", type=Path, nargs="+", required=True,
                   help="tokenmerge bench JSONL files (a setting in several: the last file's record)")
    p.add_argument("--quality", type=Path, required=True, help="a tokenmerge quality JSON file")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--stem", required=True, help="file name stem: STEM.md, STEM.png")
    p.add_argument("--title", required=True)
    p.add_argument("--omit", nargs=2, action="append", default=[], metavar=("LABEL", "WHY"),
                   help="leave the quality method LABEL out of the join, with the reason WHY (said in the table)")
    p.add_argument("--auto", type=parse_spec, default=None, metavar="SPEC",
                   help="the cache whose bench record times accelerate's (auto's) computed and cached steps on this "
                        "model, e.g. stepcache or unetcache,depth=1,layers=0")
    a = p.parse_args(argv)
    files = [[json.loads(line) for line in path.read_text().splitlines() if line.strip()] for path in a.bench]
    bench = [r for records in files for r in records]  # later files' records override earlier ones (points)
    quality = json.loads(a.quality.read_text())
    pts, notes = points(bench, quality, dict(a.omit), a.auto)
    if not pts:
        p.error("no quality method has a speed: run the bench with the same specs")
    a.out.mkdir(parents=True, exist_ok=True)
    commands = [records[0].get("command", "?") if records else "?" for records in files]
    md = markdown(pts, notes, commands, quality.get("command", "?"), a.title)
    tmp = a.out / f"{a.stem}.md.tmp"
    tmp.write_text(md)
    tmp.replace(a.out / f"{a.stem}.md")
    plot(pts, a.out / f"{a.stem}.png", a.title)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
