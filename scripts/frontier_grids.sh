#!/usr/bin/env bash
# The caches' frontiers under the time grids real pipelines run (#62), on held-out seeds 2-5 (the presets were chosen
# on seeds 0-1: benchmarks/results/frontier/select/README.md):
#   mosaic   fashion-mosaic (Flux.1 layout, 1,024 image + 32 text tokens) on Flux.1-dev 1024's grid (flow-matching
#            Euler, shift e^1.15), 28 and 50 steps
#   video    fashion-video-long (Wan layout, 2,048 tokens) on Wan 2.1's UniPC, 50 steps, shifts 3, 5 and 7
#   unet     fashion-unet under DDIM and DPM-Solver++ 2M, 25 and 50 steps (PNDM at 50)
#   linear   the mosaic on the linear grid at 20 steps (the history's point, 2.66x at 33.8 dB, held or bettered)
# accelerate's three speeds (auto), a neighbour, the schedule counted in steps that accelerate used before (rounds),
# beside diffusers' MagCache (calibrated on the same grid), First Block Cache and TaylorSeer and cache-dit's DBCache
# (the real package: pip install -e ".[bench]"), with and without its TaylorSeer calibrator, thresholds and warmups
# swept so that it caches at these step counts. Speed: this library's caches from the bench's measured computed and
# cached steps at real widths (the tables below) times the share of the steps the generations computed (counted);
# the others' counted linear work; joined by scripts/frontier.py.
#
#   bash scripts/frontier_grids.sh [mosaic|video|unet|linear|all] [CACHE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-all}"
CACHE="${2:-/tmp/frontier-grids}"
export OMP_NUM_THREADS=1
Q=(.venv/bin/tokenmerge quality --no-progress --seeds 2 3 4 5 --out benchmarks/results/quality)
F=(.venv/bin/python scripts/frontier.py --out benchmarks/results/frontier)
FLUX_BENCH=benchmarks/results/perf/cpu-flux-2+4-1024-stepcache.jsonl
WAN_BENCH=benchmarks/results/perf/cpu-wan-2b-480x832x33-stepcache.jsonl
UNET_BENCH=benchmarks/results/perf/cpu-sd15-512-unetcache.jsonl
OURS="auto,speed=faithful auto,speed=balanced auto,speed=fast"
ROUNDS="stepcache:1,warmup=3,skip_growth=1"  # accelerate's balanced before: rounds counted in steps
PEERS="magcache:0.06 magcache:0.12 magcache:0.25 fbc:0.1 fbc:0.2 taylorseer:2 taylorseer:3 cachedit:0.1 \
cachedit:0.2 cachedit:0.3 cachedit:0.2,taylorseer=true cachedit:0.3,warmup=4 cachedit:0.5,warmup=4"
FEW_PEERS="magcache:0.12 magcache:0.25 cachedit:0.2 cachedit:0.3,warmup=4"

run() {  # model, prompt arguments, steps, grid arguments, stem, title, bench, auto spec, methods...
  local model="$1" prompts="$2" steps="$3" grid="$4" stem="$5" title="$6" bench="$7" auto="$8"
  shift 8
  "${Q[@]}" --model "$model" $prompts --steps "$steps" $grid --images "$CACHE/$stem" --stem "quality-$stem" \
    --methods "$@"
  "${F[@]}" --bench "$bench" --quality "benchmarks/results/quality/quality-$stem.json" --stem "frontier-$stem" \
    --title "$title" --auto "$auto"
}

if [ "$WHAT" = mosaic ] || [ "$WHAT" = all ]; then
  for steps in 28 50; do
    run fashion-mosaic "--prompts mosaics --count 8" "$steps" "" "grid-fashion-mosaic-flux-steps$steps" \
      "Flux.1-style mosaic DiT, Flux.1-dev 1024's grid (shift e^1.15), $steps steps" "$FLUX_BENCH" stepcache \
      $OURS stepcache,gap=0.02,gap_growth=0.3 $ROUNDS $PEERS
  done
fi
if [ "$WHAT" = video ] || [ "$WHAT" = all ]; then
  for shift in 3 5 7; do
    peers="$PEERS"
    [ "$shift" = 7 ] && peers="$FEW_PEERS"
    run fashion-video-long "--prompts classes --count 5" 50 "--shift $shift" "grid-fashion-video-long-unipc$shift-steps50" \
      "Wan-style long-video DiT, Wan 2.1's UniPC at shift $shift, 50 steps" "$WAN_BENCH" stepcache \
      $OURS stepcache,gap=0.02,gap_growth=0.4 stepcache:1,warmup=3,skip_growth=2 $peers
  done
fi
if [ "$WHAT" = unet ] || [ "$WHAT" = all ]; then
  U="unetcache:1,depth=1,layers=0"
  for sched in ddim dpm++2m pndm; do
    for steps in 25 50; do
      [ "$sched" = pndm ] && [ "$steps" = 25 ] && continue
      run fashion-unet "--prompts classes" "$steps" "--scheduler $sched" "grid-fashion-unet-$sched-steps$steps" \
        "SD-style UNet (speed sd15 at 512, random weights), $sched, $steps steps" "$UNET_BENCH" \
        "unetcache,depth=1,layers=0" $OURS unetcache,depth=1,layers=0,gap=0.06,gap_growth=0.1 "$U,warmup=3,skip_growth=1" \
        "unetcache:2,depth=1,layers=0,warmup=1,extrapolate=0" tome:0.5
    done
  done
fi
if [ "$WHAT" = linear ] || [ "$WHAT" = all ]; then
  run fashion-mosaic "--prompts mosaics --count 8" 20 "--shift 1" "grid-fashion-mosaic-linear-steps20" \
    "Flux.1-style mosaic DiT, the linear grid (shift 1), 20 steps" "$FLUX_BENCH" stepcache \
    $OURS $ROUNDS magcache:0.12 cachedit:0.2
fi
