"""Write a quality report: Markdown and JSON, the image grid (rows prompts, columns methods), the plot."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from ..tools.outputs import Outputs

__all__ = ["markdown", "write_report", "make_grid", "output_names"]


def _num(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else str(x)


def markdown(report: dict, command: str | None = None) -> str:
    lines = []
    if command:
        lines += [f"`{command}`", ""]
    lines += [f"Model: {report['model']}; {report['prompts']} prompts x {len(report['seeds'])} seeds, "
              f"{report['steps']} steps; fidelity is to the vanilla image from the same noise "
              "(mean with 95% confidence interval; PSNR in dB, inf = identical).", "",
              "| method | PSNR (dB) | SSIM | s / image (median) | speed-up |", "|---|---|---|---|---|"]
    video = bool(report.get("frames"))
    if video:
        lines[-3] += (f" Each sample is a clip of {report['frames']} frames: PSNR over the clip, per frame (mean), "
                      "SSIM per frame (mean), and temporal PSNR (of the frame-to-frame differences: motion).")
        lines[-2:] = ["| method | PSNR (dB) | per-frame PSNR | SSIM (per frame) | temporal PSNR | s / clip (median) "
                      "| speed-up |", "|---|---|---|---|---|---|---|"]
    work = all(m.get("linear_work") for m in report["methods"])
    dist = all("adherence" in m for m in report["methods"])
    if dist:  # the classifier's Fréchet distance and prompt adherence, before the timing columns
        head, rule = lines[-2].split(" s / "), lines[-1]
        lines[-2:] = [head[0] + " FD | adherence | s / " + head[1], rule + "---|---|"]
    if work:  # "linear work": the share of vanilla's nn.Linear multiply-adds each method ran
        lines[-2:] = [lines[-2] + " linear work |", lines[-1] + "---|"]
    counted = any(m.get("steps_computed") is not None for m in report["methods"])
    if counted:  # a cache's own count of the steps it computed (cache-dit's)
        lines[-2:] = [lines[-2] + " steps computed |", lines[-1] + "---|"]
    for m in report["methods"]:
        ci = lambda v, f: "" if not isinstance(v, float) else f" ± {v:{f}}"  # noqa: E731
        cells = [f"{_num(m['psnr_mean'], '.2f')}{ci(m['psnr_ci95'], '.2f')}"]
        if video:
            cells.append(f"{_num(m['frame_psnr_mean'], '.2f')}{ci(m['frame_psnr_ci95'], '.2f')}")
        cells.append(f"{_num(m['ssim_mean'], '.4f')}{ci(m['ssim_ci95'], '.4f')}")
        if video:
            cells.append(f"{_num(m['temporal_psnr_mean'], '.2f')}{ci(m['temporal_psnr_ci95'], '.2f')}")
        if dist:
            cells += [_num(m["fd"], ".3f"), f"{_num(m['adherence'], '.1%')}{ci(m['adherence_ci95'], '.1%')}"]
        lines.append(f"| {m['label']} | " + " | ".join(cells) + f" | {m['seconds_median']:.3f} | {m['speedup']:.2f}x |"
                     + (f" {m['linear_work']:.0%} |" if work else "")
                     + ((f" {m['steps_computed']:.0%} |" if m.get("steps_computed") is not None else " |")
                        if counted else ""))
    if dist:
        info = report.get("distribution") if isinstance(report.get("distribution"), dict) else {}
        crop = {"frames": "frame", "mosaic": "32 px cell of a mosaic"}.get(info.get("crops"), "image")
        count = f"{info['per_method']} crops a method, each a {crop}" if "per_method" in info else f"each a {crop}"
        lines += ["", "FD: the Fréchet distance of the generated images' features in the shipped Fashion-MNIST "
                  "classifier to real data of the classes the prompts ask for (as FID; lower is closer; biased upwards "
                  "at few samples: compare rows, vanilla's first). Adherence: the share of crops the classifier "
                  f"labels as the prompt asks ({count})."]
    elif isinstance(report.get("distribution"), str):
        lines += ["", f"- FD and prompt adherence: {report['distribution']}"]
    if work:
        lines += ["", "Linear work: the multiply-adds of the denoiser's nn.Linear calls (projections, feed-forwards), "
                  "as a share of vanilla's, counted during the generation: what a cache skips and merged tokens "
                  "shrink (attention's own products are not counted). 1 / share is a cache's speed-up at zero "
                  "overhead."]
    if counted:
        lines += ["", "Steps computed: the share of the steps on which the cache ran the blocks it can skip, by its "
                  "own count (this library's caches: the calls they computed, as describe_patch reports them; "
                  "cache-dit: its statistics, with several block lists each list's share weighted by the blocks it "
                  "can skip), mean over images."]
    for name, value in (report.get("extra") or {}).items():
        lines += ["", f"- {name}: {value}"]
    return "\n".join(lines) + "\n"


def make_grid(images: list[list], row_labels: list[str], col_labels: list[str], cell: int = 128):
    """A labelled grid image: ``images[row][col]`` are PIL images, scaled (nearest) to ``cell`` pixels."""
    from PIL import Image, ImageDraw

    # column heads wrapped, not cut: "tome 0.5 match_radius=1" and "tome 0.5 share_plans=True" must differ
    heads = ["\n".join(textwrap.wrap(text, 20, break_on_hyphens=False)[:4]) for text in col_labels]
    label_w, head_h = 150, 12 + 14 * max([h.count("\n") + 1 for h in heads] or [1])
    first = next((img for row in images for img in row), None)
    aspect = max(1, round(first.width / first.height)) if first is not None else 1  # clips: frame strips
    if aspect > 1:
        cell = max(48, cell // 2)
    width = cell * aspect
    grid = Image.new("RGB", (label_w + width * len(col_labels), head_h + cell * len(row_labels)), "white")
    draw = ImageDraw.Draw(grid)
    for c, text in enumerate(heads):
        draw.multiline_text((label_w + c * width + 4, 4), text, fill="black")
    for r, (row, text) in enumerate(zip(images, row_labels)):
        wrapped = "\n".join(textwrap.wrap(text, 22)[:5])
        draw.multiline_text((4, head_h + r * cell + 4), wrapped, fill="black")
        for c, img in enumerate(row):
            grid.paste(img.convert("RGB").resize((width, cell), Image.NEAREST),
                       (label_w + c * width, head_h + r * cell))
    return grid


def output_names(stem: str = "quality") -> list[str]:
    """The files ``write_report`` may write for ``stem``: check them (``tools.outputs.Outputs``) before a run."""
    return [f"{stem}.md", f"{stem}.json", f"{stem}-grid.png", f"{stem}-plot.png"]


def write_report(report: dict, out: Path | Outputs, stem: str = "quality", command: str | None = None,
                 grid_rows: int = 8) -> dict[str, Path]:
    """Write ``stem``.md / .json / -grid.png / -plot.png into ``out`` (a folder, or the ``Outputs`` checked before
    the run): each file atomically, none over a file this library did not write. Returns the paths written."""
    from PIL import Image

    outputs = out if isinstance(out, Outputs) else Outputs(out, output_names(stem))
    paths = {"markdown": outputs.write_text(f"{stem}.md", markdown(report, command)),
             "json": outputs.write_text(f"{stem}.json", json.dumps(dict(report, command=command), indent=1) + "\n")}
    labels = [m["label"] for m in report["methods"]]
    by_item: dict[tuple, dict] = {}
    for row in report["images"]:
        by_item.setdefault((row["prompt"], row["seed"]), {})[row["label"]] = row["image"]
    # rows: every prompt with its first seed, then the next seeds, so a few rows still show every prompt
    seeds = sorted({seed for _, seed in by_item})
    items = sorted(by_item, key=lambda item: seeds.index(item[1]))[:grid_rows]
    rows = [[Image.open(by_item[item][label]) for label in labels] for item in items]
    grid = make_grid(rows, [f"{p} (seed {s})" for p, s in items], labels)
    paths["grid"] = outputs.write(f"{stem}-grid.png", lambda tmp: grid.save(tmp, format="PNG"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(5, 4))
    for m in report["methods"][1:]:
        if isinstance(m["psnr_mean"], float):
            ax.scatter(m["speedup"], m["psnr_mean"])
            ax.annotate(m["label"], (m["speedup"], m["psnr_mean"]), fontsize=8)
    ax.set_xlabel("speed-up over vanilla (median s / image)")
    ax.set_ylabel("PSNR to vanilla (dB)")
    ax.set_title(f"{report['model']}: speed vs fidelity")
    fig.tight_layout()
    paths["plot"] = outputs.write(f"{stem}-plot.png", lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return paths
