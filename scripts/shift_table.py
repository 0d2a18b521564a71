"""accelerate's speeds across time grids: one Markdown table from ``tokenmerge quality`` reports of its three speeds
(``scripts/shift_sweep.sh``), a row per testbed, scheduler and step count, each cell the PSNR (dB, mean over the
report's images) and the counted speed-up (steps over the steps computed, as the cache counted them).

    python scripts/shift_table.py benchmarks/results/quality/quality-shifts-*.json > shifts.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPEEDS = ("faithful", "balanced", "fast")


def main(paths: list[str]) -> int:
    rows = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        cells = {}
        for m in report["methods"]:
            for speed in SPEEDS:
                if m["label"] == f"auto speed={speed}":
                    share = m.get("steps_computed")
                    cells[speed] = f"{m['psnr_mean']:.1f} dB, {1 / share:.2f}x" if share else f"{m['psnr_mean']:.1f}"
        rows.append((report["model"], report["steps"], len(report.get("images", [])) or "", cells))
    print("# accelerate across time grids (held-out seeds 2-3)\n")
    print("PSNR to the unpatched model's output (the same noise), mean over the report's images; the speed-up "
          "counted: steps over the steps the cache computed (the bench's measured computed and skipped steps make "
          "it a little lower: benchmarks/results/frontier/frontier-grid-*.md). Made by `bash scripts/shift_sweep.sh` "
          "(the quality reports: benchmarks/results/quality/quality-shifts-*.md).\n")
    print("| testbed and time grid | steps | " + " | ".join(SPEEDS) + " |")
    print("|---|---|" + "---|" * len(SPEEDS))
    for model, steps, _, cells in sorted(rows, key=lambda r: (r[0], r[1])):
        print(f"| {model} | {steps} | " + " | ".join(cells.get(s, "") for s in SPEEDS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
