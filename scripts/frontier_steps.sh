#!/usr/bin/env bash
# The step cache's frontiers (#57) on the testbeds nearer real token counts, at the models' own step counts (20 and
# 50): fashion-mosaic (Flux.1 layout, 1,024 image + 32 text tokens) and fashion-video-long (Wan layout, 2,048
# tokens). Each setting's fidelity on the trained model (PSNR, SSIM, FD, adherence) on held-out seeds 2-3 (the
# settings were chosen on seeds 0-1 by scripts/select_step_cache.py), beside diffusers' caches (First Block Cache,
# TaylorSeer, MagCache calibrated for the step count) and a cache-dit-style static step mask with first-order
# extrapolation; speed: the step cache's measured computed and skipped steps at real widths (the bench tables below),
# the caches' counted linear work; joined by scripts/frontier.py. History: these ran on the linear time grid (shift 1,
# kept here by --shift 1), with the presets counted in steps that accelerate used then; the frontiers under the
# pipelines' grids: scripts/frontier_grids.sh.
#
#   bash scripts/frontier_steps.sh [mosaic|video|all] [20|50|all] [CACHE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-all}"
STEPS="${2:-all}"
CACHE="${3:-/tmp/frontier-steps}"
export OMP_NUM_THREADS=1
Q=(.venv/bin/tokenmerge quality --no-progress --seeds 2 3 --shift 1 --out benchmarks/results/quality)
F=(.venv/bin/python scripts/frontier.py --out benchmarks/results/frontier/history)
FLUX_BENCH=benchmarks/results/perf/cpu-flux-2+4-1024-stepcache.jsonl
WAN_BENCH=benchmarks/results/perf/cpu-wan-2b-480x832x33-stepcache.jsonl
# cache-dit's example steps mask (DBCache's steps_computation_mask), cut at 20 steps / continued with gaps of 4
DIT20=11111101001000001000
DIT50=11111101001000001000010000100001000010000100001000
S=stepcache:1

CACHES_20="fbc:0.1 fbc:0.2 taylorseer:2 taylorseer:3 magcache:0.12 magcache:0.25 magcache:0.5"
STEP_20="$S,warmup=4,extrapolate=0.85 $S,warmup=5,skip_growth=1,extrapolate=0.7 $S,warmup=4,skip_growth=1,extrapolate=0.7 \
$S,warmup=4,skip_growth=1,extrapolate=1 $S,warmup=3,skip_growth=1,extrapolate=0.7 $S,warmup=3,skip_growth=1,extrapolate=0.85 \
$S,warmup=3,skip_growth=1,extrapolate=0 $S,warmup=3,skip_growth=2,extrapolate=0.7 stepcache:2,warmup=3,skip_growth=1,extrapolate=0.7 \
$S,warmup=2,skip_growth=2,extrapolate=0.7 $S,mask=$DIT20,extrapolate=1"
CACHES_50="fbc:0.2 taylorseer:4 magcache:0.25 magcache:0.5"
STEP_50="$S,warmup=5,skip_growth=1,extrapolate=0.7 $S,warmup=4,skip_growth=1,extrapolate=0.7 \
$S,warmup=3,skip_growth=1,extrapolate=0.7 $S,warmup=4,skip_growth=2,extrapolate=0.7 $S,warmup=3,skip_growth=2,extrapolate=0.7 \
$S,warmup=2,skip_growth=2,extrapolate=0.7 $S,mask=$DIT50,extrapolate=1"

run() {  # testbed model, prompt arguments, steps, stem, title, bench table
  local model="$1" prompts="$2" steps="$3" stem="$4" title="$5" bench="$6"
  local caches="CACHES_$steps" step="STEP_$steps"
  "${Q[@]}" --model "$model" $prompts --steps "$steps" --images "$CACHE/$model-$steps" --stem "quality-$stem" \
    --methods ${!step} ${!caches}
  "${F[@]}" --bench "$bench" --quality "benchmarks/results/quality/quality-$stem.json" --stem "frontier-$stem" \
    --title "$title, $steps steps"
}

for steps in 20 50; do
  [ "$STEPS" = all ] || [ "$STEPS" = "$steps" ] || continue
  if [ "$WHAT" = mosaic ] || [ "$WHAT" = all ]; then
    run fashion-mosaic "--prompts mosaics --count 8" "$steps" "fashion-mosaic-steps$steps" \
      "Flux.1-style mosaic DiT (1,024 image + 32 text tokens)" "$FLUX_BENCH"
  fi
  if [ "$WHAT" = video ] || [ "$WHAT" = all ]; then
    run fashion-video-long "--prompts classes --count 5" "$steps" "fashion-video-long-steps$steps" \
      "Wan-style long-video DiT (2,048 tokens)" "$WAN_BENCH"
  fi
done
