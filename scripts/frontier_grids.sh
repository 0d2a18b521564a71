#!/usr/bin/env bash
# The caches' frontiers under the time grids real pipelines run (#62), on held-out seeds 2-5 (the presets were chosen
# on seeds 0-1: benchmarks/results/frontier/select/README.md). Parts:
#   mosaic28, mosaic50  fashion-mosaic (Flux.1 layout, 1,024 image + 32 text tokens) on Flux.1-dev 1024's grid
#                       (flow-matching Euler, shift e^1.15), 8 sentences x 4 seeds
#   linear              the mosaic on the linear grid at 20 steps (the history's point, 2.66x at 33.8 dB), 4 sentences
#   video3, video5      fashion-video-long (Wan layout, 2,048 tokens) on Wan 2.1's UniPC at shift 3 (480p: 4 class
#                       names) and 5 (720p: 2), 50 steps
#   video7              the same at HunyuanVideo's shift 7 (2 class names, fewer peers)
#   unet-SCHED-STEPS    fashion-unet under ddim / dpm++2m (25 and 50 steps) and pndm (50), 10 class names
# accelerate's three speeds (auto), a neighbour, the schedule counted in steps that accelerate used before (rounds),
# beside diffusers' MagCache (calibrated on the same grid), First Block Cache and TaylorSeer and cache-dit's DBCache
# (the real package: pip install -e ".[bench]"), with and without its TaylorSeer calibrator, thresholds and warmups
# swept so that it caches at these step counts (the UNet: DeepCache's uniform schedule and ToMe; diffusers' and
# cache-dit's caches patch transformers only). Speed: this library's caches from the bench's measured computed and
# cached steps at real widths (the tables below) times the share of the steps the generations computed (counted);
# the others' counted linear work; joined by scripts/frontier.py. A part's images are kept in CACHE_DIR/STEM, so a
# run that stops resumes.
#
#   bash scripts/frontier_grids.sh PART|all [CACHE_DIR]
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
PEERS28="magcache:0.06 magcache:0.12 magcache:0.25 fbc:0.1 fbc:0.2 taylorseer:2 taylorseer:3 cachedit:0.1 \
cachedit:0.2 cachedit:0.3 cachedit:0.2,taylorseer=true cachedit:0.3,warmup=4 cachedit:0.5,warmup=4"
PEERS50="magcache:0.12 magcache:0.25 fbc:0.1 taylorseer:3 cachedit:0.2 cachedit:0.2,taylorseer=true \
cachedit:0.3,warmup=4 cachedit:0.5,warmup=4"
VPEERS="magcache:0.12 magcache:0.25 fbc:0.1 taylorseer:2 cachedit:0.2 cachedit:0.2,taylorseer=true cachedit:0.3,warmup=4"
VPEERS5="magcache:0.12 magcache:0.25 fbc:0.1 cachedit:0.2 cachedit:0.2,taylorseer=true"

run() {  # model, prompt arguments, steps, grid arguments, stem, title, bench, auto spec, methods...
  local model="$1" prompts="$2" steps="$3" grid="$4" stem="$5" title="$6" bench="$7" auto="$8"
  shift 8
  "${Q[@]}" --model "$model" $prompts --steps "$steps" $grid --images "$CACHE/$stem" --stem "quality-$stem" \
    --methods "$@"
  "${F[@]}" --bench "$bench" --quality "benchmarks/results/quality/quality-$stem.json" --stem "frontier-$stem" \
    --title "$title" --auto "$auto"
}
mosaic() {  # steps, peers
  run fashion-mosaic "--prompts mosaics --count 8" "$1" "" "grid-fashion-mosaic-flux-steps$1" \
    "Flux.1-style mosaic DiT, Flux.1-dev 1024's grid (shift e^1.15), $1 steps" "$FLUX_BENCH" stepcache \
    $OURS stepcache,gap=0.02,gap_growth=0.3 stepcache:1,warmup=3,skip_growth=1 $2
}
video() {  # shift, class names, methods beside ours
  run fashion-video-long "--prompts classes --count $2" 50 "--shift $1" "grid-fashion-video-long-unipc$1-steps50" \
    "Wan-style long-video DiT, Wan 2.1's UniPC at shift $1, 50 steps" "$WAN_BENCH" stepcache $OURS $3
}
unet() {  # scheduler, steps
  local u="unetcache,depth=1,layers=0"
  run fashion-unet "--prompts classes" "$2" "--scheduler $1" "grid-fashion-unet-$1-steps$2" \
    "SD-style UNet (speed sd15 at 512, random weights), $1, $2 steps" "$UNET_BENCH" "$u" \
    $OURS "$u,gap=0.06,gap_growth=0.1" "$u,gap=0.04,gap_growth=0.3" "unetcache:2,depth=1,layers=0,warmup=1,extrapolate=0" \
    tome:0.5
}

case "$WHAT" in
  mosaic28) mosaic 28 "$PEERS28" ;;
  mosaic50) mosaic 50 "$PEERS50" ;;
  linear)
    run fashion-mosaic "--prompts mosaics --count 4" 20 "--shift 1" "grid-fashion-mosaic-linear-steps20" \
      "Flux.1-style mosaic DiT, the linear grid (shift 1), 20 steps" "$FLUX_BENCH" stepcache \
      $OURS stepcache,gap=0.02,gap_growth=0.6 stepcache:1,warmup=3,skip_growth=1 magcache:0.12 cachedit:0.2 ;;
  video3) video 3 4 "stepcache,gap=0.02,gap_growth=0.4 stepcache:1,warmup=3,skip_growth=2 $VPEERS" ;;
  video5) video 5 2 "stepcache,gap=0.02,gap_growth=0.4 $VPEERS5" ;;
  video7) video 7 2 "stepcache:1,warmup=3,skip_growth=2 magcache:0.12 cachedit:0.2" ;;
  unet-*-*) IFS=- read -r _ sched steps <<< "$WHAT"; unet "$sched" "$steps" ;;
  all)
    for part in mosaic28 mosaic50 linear video3 video5 video7 unet-ddim-25 unet-ddim-50 unet-dpm++2m-25 \
        unet-dpm++2m-50 unet-pndm-50; do
      bash "$0" "$part" "$CACHE"
    done ;;
  *) echo "unknown part: $WHAT (mosaic28, mosaic50, linear, video3, video5, video7, unet-SCHED-STEPS, all)" >&2; exit 2 ;;
esac
