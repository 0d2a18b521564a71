"""Benchmark output: a Markdown table in the founding documents' shape, CSV/JSONL records, a PNG plot."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from ..tools.outputs import Outputs

__all__ = ["markdown", "write_outputs", "output_names"]

# preset families whose tables keep their first shape (no description or token column)
LEGACY_FAMILIES = ("unet", "pixart", "sd3", "flux", None)


def _speedup(vanilla, t):
    return vanilla / t if vanilla and t else None


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind", "step") == "step"]


def _suffix(r: dict) -> str:
    """The label suffix of a record's compile mode (empty for eager)."""
    from .steps import compile_suffix

    return compile_suffix(r.get("compile_mode") or ("default" if r.get("compiled") else None))


def _limit_label(r: dict, cell: dict | None = None) -> str | None:
    """The zero-overhead reference a mode's gain is measured against: ToMe's limit or ToDo's; for whole-block
    merging (``scope=block``) the unpatched model at the merged token count (``grid-limit``) where the cell has it."""
    suffix = _suffix(r)
    if cell is not None and r["mode"] == "tokenmerge" and (r.get("options") or {}).get("scope") == "block":
        grid = f"grid-limit {r['ratio']:g}" + suffix
        if grid in cell:
            return grid
    if "reference" in r:  # named by the method spec (ToDo's factor per axis too)
        return r["reference"] + suffix if r["reference"] else None
    if r["mode"] in ("tokenmerge", "tomesd"):
        return f"limit {r['ratio']:g}" + suffix
    if r["mode"] == "todo":
        return f"todo-limit {r['factor']:g}" + suffix
    return None


def _paired(vanilla_runs, runs) -> list[float] | None:
    """Speed-up of each round: vanilla's run i over this mode's run i. The modes take turns within a round, so a
    round's pair shares the machine's state; the spread of these is the noise a speed-up must stand out of."""
    if not vanilla_runs or not runs or len(vanilla_runs) != len(runs):
        return None
    return [v / t for v, t in zip(vanilla_runs, runs)]


def _cell_key(r: dict) -> tuple:
    return r["preset"], r["attention"], r["resolution"], r["batch"], r.get("frames")


def _pixels(resolution) -> float:
    """A resolution as one number for plots and sorting: the side of a square of the same area."""
    if isinstance(resolution, str):
        h, _, w = resolution.lower().partition("x")
        return (int(h) * int(w)) ** 0.5
    return float(resolution)


def annotate(records: list[dict]) -> None:
    """Add ``speedup`` (vanilla time / this time, same cell), ``gain_kept`` (share of the limit's gain) and, with
    generation times, ``generate_speedup``."""
    by_cell = defaultdict(dict)
    for r in _steps(records):
        by_cell[_cell_key(r)][r["label"]] = r
    for cell in by_cell.values():
        base = cell.get("vanilla", {})
        for r in cell.values():
            r["speedup"] = _speedup(base.get("median_s"), r["median_s"])
            r["speedup_runs"] = _paired(base.get("times_s"), r.get("times_s"))
            if r.get("compiled"):  # compiled modes against compiled vanilla (and eager vanilla in `speedup`)
                compiled_base = cell.get("vanilla" + _suffix(r), {})
                r["speedup_vs_compiled"] = _speedup(compiled_base.get("median_s"), r["median_s"])
                if compiled_base.get("kernels_per_call") or compiled_base.get("launches_per_call"):
                    r["kernels_vs_vanilla"] = _ratio(r, compiled_base)
            elif base:
                r["kernels_vs_vanilla"] = _ratio(r, base)
            if r.get("generate_s"):
                r["generate_speedup"] = _speedup(base.get("generate_s"), r["generate_s"])
            if r.get("full_median_s"):  # a stateful mode (token reuse): its full step beside the partial one
                r["full_speedup"] = _speedup(base.get("median_s"), r["full_median_s"])
        for r in cell.values():
            limit = cell.get(_limit_label(r, cell) or "")
            r["limit_label"] = limit["label"] if limit else None
            own = r.get("speedup_vs_compiled") if r.get("compiled") else r["speedup"]
            ref = limit.get("speedup_vs_compiled") if limit and r.get("compiled") else (limit or {}).get("speedup")
            if ref and own:
                gain = ref - 1
                # a share of a gain inside timing noise means nothing: only report it for a real gain
                r["gain_kept"] = (own - 1) / gain if gain > 0.05 else None
                r["limit_share"] = own / ref  # this mode's speed over its limit's (1.0: as fast as the limit)


def kernels_of(r: dict) -> float | None:
    """Kernels per denoiser call: the profiler's launches where measured (CUDA), else the operators dispatched."""
    return r.get("launches_per_call") if r.get("launches_per_call") is not None else r.get("kernels_per_call")


def _ratio(r: dict, base: dict) -> float | None:
    mine, theirs = kernels_of(r), kernels_of(base)
    return mine / theirs if mine is not None and theirs else None


def _fmt(r) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    text = f"{r['median_s']:.3g} s" + (" (not one graph)" if r.get("fullgraph") is False else "") \
        + (" (CUDA graphs skipped)" if r.get("cudagraph_skips") else "")
    if r.get("speedup_vs_compiled") and r["mode"] != "vanilla":
        text += f" ({(r['speedup_vs_compiled'] - 1) * 100:+.0f}% vs vanilla{_suffix(r)})"
        if r.get("gain_kept") is not None:
            text += f", {r['gain_kept'] * 100:.0f}% of limit"
    elif r["mode"] != "vanilla" and r.get("speedup") and not r.get("compiled"):
        runs = r.get("speedup_runs") or []
        spread = f" [{(min(runs) - 1) * 100:+.0f}, {(max(runs) - 1) * 100:+.0f}]" if len(runs) > 1 else ""
        text += f" ({(r['speedup'] - 1) * 100:+.0f}%{spread})"
        if r.get("gain_kept") is not None:
            text += f", {r['gain_kept'] * 100:.0f}% of limit"
    if r.get("full_median_s"):  # token reuse: the time above is its partial step; a generation's full steps cost
        text += f"; full step {r['full_median_s']:.3g} s"
    if r.get("peak_mem_mb") is not None:
        text += f", {r['peak_mem_mb'] / 1024:.2f} GB"
        if r.get("step_mem_mb") is not None:
            text += f" ({r['step_mem_mb'] / 1024:.2f} GB step)"
    return text


def _tokens(r: dict) -> str:
    return f"{r['tokens']:,} ({r['grid'].replace('x', ' x ')})" if r.get("tokens") else ""


def _table(rows: list[dict], labels: list[str], fmt, tokens: bool = False) -> list[str]:
    """One row per (resolution, batch[, frames]) of ``rows``, one column per label; ``tokens``: a column with
    the token grid of one call."""
    video = any(r.get("frames") for r in rows)
    tokens = tokens and any(r.get("tokens") for r in rows)
    head = ["resolution", "batch"] + (["frames"] if video else []) + (["tokens per call"] if tokens else [])
    lines = ["| " + " | ".join(head + labels) + " |", "|" + "---|" * (len(head) + len(labels))]
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["resolution"], r["batch"], r.get("frames"))][r["label"]] = r
    for (res, batch, frames), by_label in cells.items():
        first = next(iter(by_label.values()))
        key = [str(res), str(batch)] + ([str(frames)] if video else []) + ([_tokens(first)] if tokens else [])
        lines.append("| " + " | ".join(key + [fmt(by_label.get(lb)) for lb in labels]) + " |")
    return lines + [""]


def _fmt_kernels(r) -> str:
    """Kernels per call (x vanilla's), host issue time / device time of a step, launch-bound, syncs."""
    if r is None or r["status"] != "ok":
        return "" if r is None else r["status"]
    parts = []
    k = kernels_of(r)
    if k is not None:
        parts.append(f"{k:,.0f} kernels/call" + (f" ({r['kernels_vs_vanilla']:.2f}x)"
                                                  if r.get("kernels_vs_vanilla") and r["mode"] != "vanilla" else ""))
    if r.get("host_median_s") is not None and r.get("device") != "cpu" and r.get("host_median_s") != r["median_s"]:
        parts.append(f"host {r['host_median_s'] * 1000:.3g} / device {r['median_s'] * 1000:.3g} ms")
    if r.get("device_busy") is not None:
        parts.append(f"GPU busy {r['device_busy'] * 100:.0f}%")
    if r.get("launch_bound"):
        parts.append("**launch-bound**")
    if r.get("syncs_per_call"):
        parts.append(f"{r['syncs_per_call']:g} syncs/call")
    return ", ".join(parts)


def _fmt_generate(r) -> str:
    if r is None or not r.get("generate_s"):
        return "" if r is None else r["status"] if r["status"] != "ok" else ""
    text = f"{r['generate_s']:.3g} s"
    if r["mode"] != "vanilla" and r.get("generate_speedup"):
        text += f" ({(r['generate_speedup'] - 1) * 100:+.0f}%)"
    if r.get("generate_ran"):
        ran = r["generate_ran"]
        text += f", {ran['computed'] * ran['steps']:.3g} of {ran['steps']} steps computed"
    return text


def _breakdown_lines(rows: list[dict]) -> list[str]:
    from .breakdown import PHASES

    phases = [p for p in PHASES if any(p in r["phases_s"] for r in rows)]
    by_label = {r["label"]: r for r in rows}
    unmerged = next((r["phases_s"].get("block") for r in rows if r["spec"] == "tome:0"), None)
    lines = ["| mode | " + " | ".join(phases) + " | merge machinery | blocks: share of the limit's saving |",
             "|---|" + "---|" * (len(phases) + 2)]
    for r in rows:
        ph = r["phases_s"]
        cost = sum(ph.get(k, 0.0) for k in ("similarity", "merge", "unmerge"))
        share = f"{cost / ph['block'] * 100:.1f}% of blocks" if ph.get("block") else ""
        limit = by_label.get(r.get("reference") or "")
        kept = ""
        if limit and unmerged and ph.get("block") and limit["phases_s"].get("block"):
            saving = unmerged - limit["phases_s"]["block"]
            if saving > 0.05 * unmerged:  # a share of a saving inside the noise means nothing
                kept = f"{(unmerged - ph['block']) / saving * 100:.0f}%"
        label = "unmerged blocks (tome 0)" if r["spec"] == "tome:0" else r["label"]
        lines.append(f"| {label} | " + " | ".join(f"{ph[k] * 1000:.0f} ms" if k in ph else "" for k in phases)
                     + f" | {share} | {kept} |")
    return lines + [""]


def _warmups(n: int) -> str:
    return "no warm-up round" if n == 0 else "a warm-up round" if n == 1 else f"{n} warm-up rounds"


def markdown(records: list[dict], meta: dict, command: str, preface: str = "") -> str:
    """The tables of a run: per preset and attention backend, one row per cell, one column per mode.

    Args:
        records: the run's (annotated) records.
        meta: the run's metadata (versions, device, settings).
        command: the command line, shown first.
        preface: Markdown put before the tables (the GPU table of ``--gpu``).
    """
    steps = _steps(records)
    labels = list(dict.fromkeys(r["label"] for r in steps))
    lines = ([preface, "", "## Every cell", ""] if preface else []) + [
        f"Command: `{command}`",
        "",
        f"Device: {meta['device_name']} ({meta['device']}, {meta['threads']} threads), {meta['dtype']}; "
        f"torch {meta['torch']}, diffusers {meta['diffusers']}, tokenmerge {meta['tokenmerge']}"
        + (f", tomesd {meta['tomesd']}" if "tomesd" in meta else "")
        + (". Modes marked 'compiled' ran under torch.compile (inductor; 'compiled reduce-overhead': with CUDA "
           "graphs; 'compiled regional': the repeated blocks compiled in place), each compiled by itself after the "
           "eager rounds (reset, patch, compile, warm up, then its timed calls: compiled modes are not interleaved, "
           "see bench/steps.py); their % is against compiled vanilla of the same compile mode"
           if meta.get("compile") else "")
        + (". Times are the device's (CUDA events); 'host': the time the host takes to issue a step, 'GPU busy': "
           "the share of the step the device spent in kernels (profiler), below 80% = launch-bound (the GPU waits "
           "for Python)" if meta.get("device", "").startswith("cuda") else "")
        + f". One denoising step with guidance as the pipeline runs it (UNets, PixArt, SD3: classifier-free "
        f"guidance in one call, the denoiser sees 2 x batch; other presets: below), median of {meta['repeats']} "
        f"runs after {_warmups(meta.get('warmup', 1))}, modes interleaved. Speed-up in % against vanilla in the same "
        "cell; "
        "[a, b]: the lowest and highest speed-up of a single round (vanilla's run over this mode's run in the same "
        "round), the noise a figure must stand out of. "
        "'% of limit': share of the zero-overhead limit's gain at that ratio (ToDo: at that factor). "
        + ("Token reuse (reuse), the step and UNet caches (stepcache, unetcache, and auto: accelerate's, its warm-up "
           "cut to one step): each round times a generation's first step (every block and token computed: 'full "
           "step') and then a partial (token reuse) or skipped (the caches) step at a later timestep (the time and % "
           "shown); a generation's time is the whole-generation table's (--steps), or the two weighted by its schedule "
           "(scripts/frontier.py). " if any(r.get("full_median_s") for r in steps) else "")
        + "Memory: " + meta["memory"] + (" (step: what one step adds to the resident memory before it)"
                                       if "isolated" in meta["memory"] else "") + ".",
        "",
    ]
    groups = defaultdict(list)
    for r in steps:
        groups[(r["preset"], r["attention"])].append(r)
    described = meta.get("presets", {})
    for (preset, attention), rows in groups.items():
        about = described.get(preset, {})
        new = about.get("family") not in LEGACY_FAMILIES
        lines += [f"### {preset}, {attention} attention", ""]
        if new and about.get("description"):
            lines += [f"{about['description']}. Step: {about.get('guidance')}.", ""]
        lines += _table(rows, labels, _fmt, tokens=new)
        if any(kernels_of(r) is not None or r.get("launch_bound") is not None for r in rows):
            lines += [f"#### {preset}, {attention} attention: kernels per denoiser call and host time", ""]
            lines += _table(rows, labels, _fmt_kernels)
        if any(r.get("generate_s") for r in rows):
            decode = ", the denoising loop without the VAE decode" if rows[0].get("frames") else " + VAE decode"
            lines += [f"#### {preset}, {attention} attention: whole generation ({meta.get('steps')} steps{decode}), "
                      f"median of {meta['repeats']}", ""] + _table(rows, labels, _fmt_generate)
    parts = defaultdict(list)
    for r in records:
        if r.get("kind") == "breakdown":
            parts[_cell_key(r)].append(r)
    rounds = meta.get("breakdown_repeats") or meta["repeats"]
    for (preset, attention, res, batch, frames), rows in parts.items():
        video = f", {frames} frames" if frames else ""
        lines += [f"#### Inside the patched blocks: {preset}, {attention} attention, {res} px{video}, batch {batch} "
                  f"(seconds per step, medians of {rounds} rounds after the step rounds; synchronised at every phase, "
                  "so slower than the "
                  "step above; 'share of the limit's saving': unmerged blocks minus these blocks, over unmerged "
                  "blocks minus the limit's)", ""]
        lines += _breakdown_lines(rows)
    return "\n".join(lines)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(records: list[dict], path: Path) -> bool:
    """Speed-up (and peak memory) against resolution, as a PNG at ``path``; False without matplotlib."""
    if not _has_matplotlib():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_mem = any(r.get("peak_mem_mb") for r in _steps(records))
    fig, axes = plt.subplots(1, 2 if has_mem else 1, figsize=(11 if has_mem else 6, 4), squeeze=False)
    series = defaultdict(list)
    for r in _steps(records):
        if r["status"] == "ok":
            series[(r["preset"], r["attention"], r["batch"], r["label"])].append(r)
    for (preset, attention, batch, label), rows in sorted(series.items()):
        rows.sort(key=lambda r: (_pixels(r["resolution"]), r.get("frames") or 0))
        name = f"{preset} {attention} b{batch} {label}"
        xs = [_pixels(r["resolution"]) for r in rows]
        if label != "vanilla":
            axes[0][0].plot(xs, [r.get("speedup") or float("nan") for r in rows], marker="o", label=name)
        if has_mem:
            axes[0][1].plot(xs, [(r.get("peak_mem_mb") or float("nan")) / 1024 for r in rows], marker="o", label=name)
    axes[0][0].axhline(1.0, color="grey", lw=0.8)
    axes[0][0].set(xlabel="resolution (px; H x W: the side of the same area)", ylabel="speed-up over vanilla (x)",
                   title="denoiser step speed-up")
    if has_mem:
        axes[0][1].set(xlabel="resolution (px)", ylabel="peak memory (GB)", title="peak memory")
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return True


def output_names(stem: str = "bench") -> list[str]:
    """The files ``write_outputs`` may write for ``stem``: check them (``tools.outputs.Outputs``) before a run."""
    return [f"{stem}.md", f"{stem}.csv", f"{stem}.jsonl", f"{stem}.png"]


def write_outputs(records: list[dict], meta: dict, out_dir: Path | Outputs, command: str, stem: str = "bench",
                  preface: str = "") -> dict:
    """Write ``stem``.md / .csv / .jsonl / .png into ``out_dir`` (a folder, or the ``Outputs`` checked before the
    run): each file atomically, none over a file this library did not write. Returns the paths written.
    ``preface``: Markdown put before the tables in ``stem``.md."""
    annotate(records)
    outputs = out_dir if isinstance(out_dir, Outputs) else Outputs(out_dir, output_names(stem))
    paths = {"markdown": outputs.write_text(f"{stem}.md", markdown(records, meta, command, preface) + "\n")}
    columns = ["kind", "preset", "attention", "resolution", "batch", "mode", "ratio", "factor", "spec", "label",
               "compiled", "status", "median_s", "runs", "speedup", "speedup_vs_compiled", "gain_kept", "generate_s",
               "generate_speedup", "phases_s", "peak_mem_mb", "step_mem_mb", "dtype", "device", "frames", "grid",
               "tokens", "reference", "compile_mode", "host_median_s", "kernels_per_call", "launches_per_call",
               "syncs_per_call", "kernel_time_s", "device_busy", "launch_bound", "kernels_vs_vanilla",
               "limit_label", "limit_share", "compiled_vs_eager", "fullgraph", "cudagraph_skips", "step_timed",
               "full_median_s", "full_speedup"]
    flat = {k: v for k, v in meta.items() if not isinstance(v, dict)}  # per-preset descriptions: in the JSONL

    def write_csv(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns + sorted(flat), extrasaction="ignore")
            writer.writeheader()
            for r in records:
                writer.writerow({**flat, **r})

    paths["csv"] = outputs.write(f"{stem}.csv", write_csv)
    paths["jsonl"] = outputs.write_text(f"{stem}.jsonl", "".join(
        json.dumps({**r, "meta": meta, "command": command}) + "\n" for r in records))
    if _has_matplotlib():
        paths["plot"] = outputs.write(f"{stem}.png", lambda tmp: plot(records, tmp))
    return paths
