#!/usr/bin/env bash
# The UNet cache's frontiers (#58) on the trained fashion-unet (a diffusers UNet2DConditionModel) at 20 and 50 steps:
# each setting's fidelity (PSNR, SSIM, FD, adherence) on held-out seeds 2-3 (the settings were chosen on seeds 0-1 by
# scripts/select_unet_cache.py), beside ToMe, ToDo and DeepCache's own recipe (a computed step every N, the feature
# held: unetcache:N-1,warmup=1,layers=0); speed: the bench's measured computed and cached steps at SD 1.5 widths
# (benchmarks/results/perf/cpu-sd15-512-unetcache.jsonl), joined by scripts/frontier.py. History: the presets counted
# in steps that accelerate used then, under DDIM alone; the frontiers under DDIM, DPM-Solver++ 2M and PNDM at 25 and
# 50 steps: scripts/frontier_grids.sh.
#
#   bash scripts/frontier_unet.sh [20|50|all] [CACHE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-all}"
CACHE="${2:-/tmp/frontier-unet}"
export OMP_NUM_THREADS=1
BENCH=benchmarks/results/perf/cpu-sd15-512-unetcache.jsonl
U=unetcache
C="depth=1,layers=0"
# accelerate's faithful / balanced / fast, then the neighbours, DeepCache N=3 and N=5, ToMe and ToDo
COMMON="$U:2,$C,warmup=4,extrapolate=0.7 $U:1,$C,warmup=3,skip_growth=1,extrapolate=0.7 \
$U:1,$C,warmup=2,skip_growth=1,extrapolate=0.7 $U:2,$C,warmup=3,extrapolate=0.7 $U:2,$C,warmup=1 $U:4,$C,warmup=1 \
tome:0.5 todo:2"
EXTRA_20="$U:3,$C,warmup=3,extrapolate=0.7 $U:2,depth=1,warmup=3,extrapolate=0.7 \
$U:2,depth=1,layers=1,warmup=3,extrapolate=0.7 $U:2,$C,warmup=3"
EXTRA_50="$U:2,$C,warmup=5,skip_growth=1,extrapolate=0.7 $U:3,$C,warmup=5,extrapolate=0.7"
for steps in 20 50; do
  [ "$STEPS" = all ] || [ "$STEPS" = "$steps" ] || continue
  extra="EXTRA_$steps"
  .venv/bin/tokenmerge quality --no-progress --seeds 2 3 --out benchmarks/results/quality --model fashion-unet \
    --steps "$steps" --images "$CACHE/$steps" --stem "quality-fashion-unet-steps$steps" --methods $COMMON ${!extra}
  .venv/bin/python scripts/frontier.py --bench "$BENCH" --quality "benchmarks/results/quality/quality-fashion-unet-steps$steps.json" \
    --out benchmarks/results/frontier/history --stem "frontier-fashion-unet-steps$steps" \
    --title "SD-style UNet: speed sd15 at 512 (random weights), fidelity on the trained fashion-unet, $steps steps" \
    --omit "unetcache 2 depth=1 layers=1 warmup=3 extrapolate=0.7" "the fashion-unet's levels have one layer each, so \
layers=1 is its whole block (the row above), while SD 1.5's cached step at layers=1 (the speed) is not"
done
