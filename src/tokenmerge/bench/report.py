"""Benchmark output: a Markdown table in the founding documents' shape, CSV/JSONL records, a PNG plot."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from ..tools.outputs import Outputs

__all__ = ["markdown", "write_outputs", "output_names"]


def _speedup(vanilla, t):
    return vanilla / t if vanilla and t else None


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind", "step") == "step"]


def _limit_label(r: dict) -> str | None:
    """The zero-overhead reference a mode's gain is measured against: ToMe's limit or ToDo's."""
    suffix = " compiled" if r.get("compiled") else ""
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


def annotate(records: list[dict]) -> None:
    """Add ``speedup`` (vanilla time / this time, same cell), ``gain_kept`` (share of the limit's gain) and, with
    generation times, ``generate_speedup``."""
    by_cell = defaultdict(dict)
    for r in _steps(records):
        by_cell[(r["preset"], r["attention"], r["resolution"], r["batch"])][r["label"]] = r
    for cell in by_cell.values():
        base = cell.get("vanilla", {})
        compiled_base = cell.get("vanilla compiled", {})
        for r in cell.values():
            r["speedup"] = _speedup(base.get("median_s"), r["median_s"])
            r["speedup_runs"] = _paired(base.get("times_s"), r.get("times_s"))
            if r.get("compiled"):  # compiled modes against compiled vanilla (and eager vanilla in `speedup`)
                r["speedup_vs_compiled"] = _speedup(compiled_base.get("median_s"), r["median_s"])
            if r.get("generate_s"):
                r["generate_speedup"] = _speedup(base.get("generate_s"), r["generate_s"])
        for r in cell.values():
            limit = cell.get(_limit_label(r) or "")
            if limit and limit.get("speedup") and r["speedup"]:
                gain = limit["speedup"] - 1
                # a share of a gain inside timing noise means nothing: only report it for a real gain
                r["gain_kept"] = (r["speedup"] - 1) / gain if gain > 0.05 else None


def _fmt(r) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    text = f"{r['median_s']:.3g} s"
    if r.get("speedup_vs_compiled"):
        text += f" ({(r['speedup_vs_compiled'] - 1) * 100:+.0f}% vs vanilla compiled)"
    elif r["mode"] != "vanilla" and r.get("speedup"):
        runs = r.get("speedup_runs") or []
        spread = f" [{(min(runs) - 1) * 100:+.0f}, {(max(runs) - 1) * 100:+.0f}]" if len(runs) > 1 else ""
        text += f" ({(r['speedup'] - 1) * 100:+.0f}%{spread})"
        if r.get("gain_kept") is not None:
            text += f", {r['gain_kept'] * 100:.0f}% of limit"
    if r.get("peak_mem_mb") is not None:
        text += f", {r['peak_mem_mb'] / 1024:.2f} GB"
        if r.get("step_mem_mb") is not None:
            text += f" ({r['step_mem_mb'] / 1024:.2f} GB step)"
    return text


def _table(rows: list[dict], labels: list[str], fmt) -> list[str]:
    lines = ["| resolution | batch | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["resolution"], r["batch"])][r["label"]] = r
    for (res, batch), by_label in cells.items():
        lines.append(f"| {res} | {batch} | " + " | ".join(fmt(by_label.get(lb)) for lb in labels) + " |")
    return lines + [""]


def _fmt_generate(r) -> str:
    if r is None or not r.get("generate_s"):
        return "" if r is None else r["status"] if r["status"] != "ok" else ""
    text = f"{r['generate_s']:.3g} s"
    if r["mode"] != "vanilla" and r.get("generate_speedup"):
        text += f" ({(r['generate_speedup'] - 1) * 100:+.0f}%)"
    return text


def _breakdown_lines(rows: list[dict]) -> list[str]:
    from .breakdown import PHASES

    phases = [p for p in PHASES if any(p in r["phases_s"] for r in rows)]
    lines = ["| mode | " + " | ".join(phases) + " | merge machinery |", "|---|" + "---|" * (len(phases) + 1)]
    for r in rows:
        ph = r["phases_s"]
        cost = sum(ph.get(k, 0.0) for k in ("similarity", "merge", "unmerge"))
        share = f"{cost / ph['block'] * 100:.1f}% of blocks" if ph.get("block") else ""
        label = "unmerged blocks (tome 0)" if r["spec"] == "tome:0" else r["label"]
        lines.append(f"| {label} | " + " | ".join(f"{ph[k] * 1000:.0f} ms" if k in ph else "" for k in phases)
                     + f" | {share} |")
    return lines + [""]


def _warmups(n: int) -> str:
    return "no warm-up round" if n == 0 else "a warm-up round" if n == 1 else f"{n} warm-up rounds"


def markdown(records: list[dict], meta: dict, command: str) -> str:
    steps = _steps(records)
    labels = list(dict.fromkeys(r["label"] for r in steps))
    lines = [
        f"Command: `{command}`",
        "",
        f"Device: {meta['device_name']} ({meta['device']}, {meta['threads']} threads), {meta['dtype']}; "
        f"torch {meta['torch']}, diffusers {meta['diffusers']}, tokenmerge {meta['tokenmerge']}"
        + (f", tomesd {meta['tomesd']}" if "tomesd" in meta else "")
        + (". Modes marked 'compiled' ran under torch.compile (default inductor), interleaved with the eager runs; "
           "their % is against compiled vanilla" if meta.get("compile") else "")
        + f". One UNet step with classifier-free guidance (the UNet sees 2 x batch), median of {meta['repeats']} "
        f"runs after {_warmups(meta.get('warmup', 1))}, modes interleaved. Speed-up in % against vanilla in the same cell; "
        "[a, b]: the lowest and highest speed-up of a single round (vanilla's run over this mode's run in the same "
        "round), the noise a figure must stand out of. "
        "'% of limit': share of the zero-overhead limit's gain at that ratio (ToDo: at that factor). "
        "Memory: " + meta["memory"] + (" (step: what one step adds to the resident memory before it)"
                                       if "isolated" in meta["memory"] else "") + ".",
        "",
    ]
    groups = defaultdict(list)
    for r in steps:
        groups[(r["preset"], r["attention"])].append(r)
    for (preset, attention), rows in groups.items():
        lines += [f"### {preset}, {attention} attention", ""] + _table(rows, labels, _fmt)
        if any(r.get("generate_s") for r in rows):
            lines += [f"#### {preset}, {attention} attention: whole generation ({meta.get('steps')} steps + VAE "
                      f"decode), median of {meta['repeats']}", ""] + _table(rows, labels, _fmt_generate)
    parts = defaultdict(list)
    for r in records:
        if r.get("kind") == "breakdown":
            parts[(r["preset"], r["attention"], r["resolution"], r["batch"])].append(r)
    for (preset, attention, res, batch), rows in parts.items():
        lines += [f"#### Inside the patched blocks: {preset}, {attention} attention, {res} px, batch {batch} "
                  "(seconds per step, medians; synchronised at every phase, so slower than the step above)", ""]
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
        rows.sort(key=lambda r: r["resolution"])
        name = f"{preset} {attention} b{batch} {label}"
        if label != "vanilla":
            axes[0][0].plot([r["resolution"] for r in rows], [r.get("speedup") or float("nan") for r in rows],
                            marker="o", label=name)
        if has_mem:
            axes[0][1].plot([r["resolution"] for r in rows], [(r.get("peak_mem_mb") or float("nan")) / 1024
                                                              for r in rows], marker="o", label=name)
    axes[0][0].axhline(1.0, color="grey", lw=0.8)
    axes[0][0].set(xlabel="resolution (px)", ylabel="speed-up over vanilla (x)", title="UNet step speed-up")
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


def write_outputs(records: list[dict], meta: dict, out_dir: Path | Outputs, command: str, stem: str = "bench") -> dict:
    """Write ``stem``.md / .csv / .jsonl / .png into ``out_dir`` (a folder, or the ``Outputs`` checked before the
    run): each file atomically, none over a file this library did not write. Returns the paths written."""
    annotate(records)
    outputs = out_dir if isinstance(out_dir, Outputs) else Outputs(out_dir, output_names(stem))
    paths = {"markdown": outputs.write_text(f"{stem}.md", markdown(records, meta, command) + "\n")}
    columns = ["kind", "preset", "attention", "resolution", "batch", "mode", "ratio", "factor", "spec", "label",
               "compiled", "status", "median_s", "runs", "speedup", "speedup_vs_compiled", "gain_kept", "generate_s",
               "generate_speedup", "phases_s", "peak_mem_mb", "step_mem_mb", "dtype", "device"]

    def write_csv(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns + sorted(meta), extrasaction="ignore")
            writer.writeheader()
            for r in records:
                writer.writerow({**meta, **r})

    paths["csv"] = outputs.write(f"{stem}.csv", write_csv)
    paths["jsonl"] = outputs.write_text(f"{stem}.jsonl", "".join(
        json.dumps({**r, "meta": meta, "command": command}) + "\n" for r in records))
    if _has_matplotlib():
        paths["plot"] = outputs.write(f"{stem}.png", lambda tmp: plot(records, tmp))
    return paths
