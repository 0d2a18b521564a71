"""The table of tune's cells (scripts/tune_targets.sh's reports in benchmarks/results/tune/*.json): per cell what was
asked, what was chosen, its speed-up in steps, its calibration and held-out PSNR, and the peers beside it on the same
held-out items; Markdown on stdout.

    python scripts/tune_table.py benchmarks/results/tune > benchmarks/results/tune/README-table.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = ("unet25-t36", "mosaic28-t34", "mosaic28-t31", "mosaic28-s3", "mosaic28-s2", "mosaic28-s1.65", "mosaic50-t34",
         "mosaic50-s2.5", "video50-t33", "video50-s2.2")


def setting(config: dict) -> str:
    keys = ("gap", "gap_growth") if config.get("skip") is None else ("skip", "skip_growth")
    return ", ".join(f"{k}={config[k]:g}" for k in ("warmup", *keys))


def main(folder: str) -> int:
    rows = ["| cell | asked | chosen (warmup, schedule) | computed | speed-up in steps | wall | calibration PSNR | "
            "held-out PSNR (worst) | generations |", "|---|---|---|---|---|---|---|---|---|"]
    peers = ["| cell | method | speed-up (in steps, or counted) | held-out PSNR |", "|---|---|---|---|"]
    for stem in ORDER:
        path = Path(folder) / f"{stem}.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        t = report["tuned"]
        f = t["tuned_for"]
        asked = f"{t['target']['psnr']:g} dB" if "psnr" in t["target"] else f"speed {t['target']['speed']:g}"
        wall = f"{t['wall_speedup']:.2f}x" if t.get("wall_speedup") else "-"
        rows.append(f"| {stem} | {asked} | {setting(t['config'])} | {t['computed']} of {f['grid_steps']} | "
                    f"{t['step_speedup']:.2f}x | {wall} | {t['calibration']['mean']:.2f} | "
                    f"{t['held_out']['mean']:.2f} ({t['held_out']['worst']:.2f}) | {t['generations']} |")
        for p in report.get("compare", []):
            speed = "-" if p["step_speedup"] is None else f"{p['step_speedup']:.2f}x ({p['speedup_by']})"
            peers.append(f"| {stem} | {p['label']} | {speed} | {p['held_out']:.2f} |")
    print("\n".join(rows) + "\n\n" + "\n".join(peers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/tune"))
