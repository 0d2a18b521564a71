#!/usr/bin/env bash
# accelerate's three speeds across the time grids users run (#62: "across shifts 1, 3, 5, 7 at 20-50 steps"), on
# held-out seeds 2-3: the mosaic (Flux.1 layout, flow-matching Euler on Flux's grid) at shifts 1, 3, 5, 7 and 20, 28,
# 50 steps; the long video (Wan layout, UniPC) at shift 1 and 50 steps and at shift 3 and 20 and 28 steps (its
# frontier runs cover shifts 3, 5, 7 at 50: scripts/frontier_grids.sh). One quality table per grid
# (benchmarks/results/quality/quality-shifts-*.md, with the steps each speed computed), gathered by
# scripts/shift_table.py into benchmarks/results/frontier/shifts.md.
#
#   bash scripts/shift_sweep.sh [mosaic|video|all] [CACHE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-all}"
CACHE="${2:-/tmp/shift-sweep}"
export OMP_NUM_THREADS=1
Q=(.venv/bin/tokenmerge quality --no-progress --seeds 2 3 --out benchmarks/results/quality)
OURS="auto,speed=faithful auto,speed=balanced auto,speed=fast"
if [ "$WHAT" = mosaic ] || [ "$WHAT" = all ]; then
  for shift in 1 3 5 7; do
    for steps in 20 28 50; do
      stem="shifts-fashion-mosaic-shift$shift-steps$steps"
      "${Q[@]}" --model fashion-mosaic --prompts mosaics --count 4 --steps "$steps" --shift "$shift" \
        --images "$CACHE/$stem" --stem "quality-$stem" --methods $OURS
    done
  done
fi
if [ "$WHAT" = video ] || [ "$WHAT" = all ]; then
  for grid in "1 50" "3 20" "3 28"; do
    set -- $grid
    stem="shifts-fashion-video-long-shift$1-steps$2"
    "${Q[@]}" --model fashion-video-long --prompts classes --count 2 --steps "$2" --shift "$1" \
      --images "$CACHE/$stem" --stem "quality-$stem" --methods $OURS
  done
fi
.venv/bin/python scripts/shift_table.py benchmarks/results/quality/quality-shifts-*.json \
  > benchmarks/results/frontier/shifts.md
