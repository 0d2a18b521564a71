#!/usr/bin/env bash
# The frontiers on the testbeds nearer real token counts (#49): fashion-mosaic (Flux.1 layout, 1,024 image + 32 text
# tokens a call) and fashion-video-long (Wan layout, 2,048 tokens a call), each setting's fidelity on the trained
# model (PSNR, SSIM, the classifier's FD and prompt adherence), its speed from the bench at real widths (the Flux.1
# and Wan presets' tables in benchmarks/results/perf, as the 32 px testbeds' frontiers), joined by scripts/frontier.py.
# Settings are chosen on seeds 0-1 and reported on seeds 2-5: two quality runs per model over one image cache.
#
#   bash scripts/frontier_testbeds.sh [mosaic|video|all] [CACHE_DIR]
#
# The generation runs split the methods over two processes (one thread each); the report runs then read the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-all}"
CACHE="${2:-/tmp/frontier-testbeds}"
export OMP_NUM_THREADS=1
Q=(.venv/bin/tokenmerge quality --no-progress --steps 20)
R=(--out benchmarks/results/quality)

IMAGE_A="tome:0.5,match_radius=1 tome:0.5,scope=block,match_radius=1 todo:2 fbc:0.1 fbc:0.2 taylorseer:5 pab:2 \
magcache:0.06 magcache:0.12 magcache:0.25 reuse:0.5,warmup=3,keys=kept"
IMAGE_B="reuse:0.5,warmup=4,keys=kept,text=true reuse:0.5,warmup=3,keys=kept,text=true \
reuse:0.4,warmup=3,keys=kept,text=true reuse:0.3,warmup=3,keys=kept,text=true \
reuse:0.55,fraction_end=0.25,warmup=2,keys=kept,text=true reuse:0.5,warmup=3,keys=kept,text=true+fbc:0.08 \
reuse:0.4,warmup=3,keys=kept,text=true+fbc:0.1 reuse:0.3,warmup=3,keys=kept,text=true+fbc:0.1 \
reuse:0.5,warmup=5,keys=kept,text=true reuse:0.6,warmup=4,keys=kept,text=true reuse:0.4,warmup=5,keys=kept,text=true \
reuse:0.3,warmup=6,keys=kept,text=true,spread=0.5 \
reuse:0.5,warmup=5,keys=kept,text=true+magcache:0.12 reuse:0.4,warmup=5,keys=kept,text=true+magcache:0.12"
# extrapolate=1: the kept residuals, keys and values move along their measured change
X=keys=kept,text=true,extrapolate=1
IMAGE_A="$IMAGE_A reuse:0.5,warmup=3,$X reuse:0.5,warmup=4,$X reuse:0.4,warmup=4,$X reuse:0.35,warmup=4,$X \
reuse:0.5,fraction_end=0.2,warmup=4,$X+fbc:0.08 reuse:0.5,fraction_end=0.2,warmup=4,$X+magcache:0.06 \
magcache:0.08 magcache:0.1 reuse:0.35,warmup=4,$X+fbc:0.2"
IMAGE_B="$IMAGE_B reuse:0.5,fraction_end=0.2,warmup=4,$X reuse:0.4,fraction_end=0.2,warmup=4,$X \
reuse:0.35,fraction_end=0.2,warmup=4,$X reuse:0.35,warmup=4,$X+fbc:0.1 reuse:0.35,warmup=4,$X+magcache:0.06"
# skip=: token reuse's step cache (rounds of skipped steps, every kept residual moved, and a computed one)
IMAGE_A="$IMAGE_A reuse:1,warmup=4,$X,skip=1 reuse:1,warmup=4,$X,skip=2 reuse:1,warmup=4,$X,skip=3 \
reuse:1,warmup=4,$X,skip=4 reuse:0.5,warmup=4,$X,skip=1 taylorseer:2 taylorseer:3"
IMAGE_B="$IMAGE_B reuse:1,warmup=3,$X,skip=2 reuse:1,warmup=3,$X,skip=3 reuse:0.7,warmup=4,$X,skip=1 \
reuse:0.85,warmup=4,$X,skip=2 reuse:0.5,warmup=4,$X+magcache:0.12"
# skip_growth=1: each round skips one more step than the last
IMAGE_A="$IMAGE_A reuse:1,warmup=4,$X,skip=2,skip_growth=1 reuse:1,warmup=3,$X,skip=1,skip_growth=1 \
reuse:1,warmup=4,$X,skip=1,skip_growth=1 reuse:0.5,warmup=4,$X,skip=1,skip_growth=1 \
reuse:0.5,warmup=5,$X,skip=1,skip_growth=1"
IMAGE_B="$IMAGE_B reuse:1,warmup=3,$X,skip=2,skip_growth=1 reuse:1,warmup=5,$X,skip=1,skip_growth=1 \
reuse:1,warmup=4,$X,skip=3,skip_growth=1"
VIDEO_A="tome:0.5,match_radius=1 tome:0.5,scope=block,match_radius=1 todo:2x2x2 fbc:0.1 fbc:0.2 pab:2 reuse:0.5,keys=kept \
magcache:0.06 magcache:0.12 magcache:0.25"
VIDEO_B="reuse:0.4 reuse:0.35 reuse:0.3 reuse:0.25 reuse:0.2 reuse:0.3+fbc:0.1 reuse:0.25+fbc:0.1 reuse:0.2+fbc:0.1 \
reuse:0.4+magcache:0.12 reuse:0.3+magcache:0.12"
Y=keys=kept,extrapolate=1
VIDEO_A="$VIDEO_A reuse:0.3,extrapolate=1 reuse:0.4,$Y reuse:0.3,$Y reuse:0.25,$Y reuse:0.3,$Y+fbc:0.1 \
reuse:0.3,$Y+magcache:0.06 magcache:0.35 magcache:0.5"
VIDEO_B="$VIDEO_B reuse:0.4,fraction_end=0.1,$Y reuse:0.25,fraction_end=0.1,$Y reuse:0.4,fraction_end=0.1,$Y+fbc:0.1 \
reuse:0.25,$Y+fbc:0.1 reuse:0.4,fraction_end=0.1,$Y+magcache:0.06"
VIDEO_A="$VIDEO_A reuse:1,warmup=4,$Y,skip=1 reuse:1,warmup=4,$Y,skip=2 reuse:1,warmup=4,$Y,skip=3 \
reuse:1,warmup=4,$Y,skip=4 reuse:1,warmup=5,$Y,skip=3 reuse:1,warmup=3,$Y,skip=4 reuse:0.6,warmup=4,$Y,skip=1"
VIDEO_B="$VIDEO_B reuse:1,warmup=4,$Y,skip=2,skip_growth=1 reuse:1,warmup=3,$Y,skip=1,skip_growth=1 \
reuse:1,warmup=4,$Y,skip=1,skip_growth=1 reuse:1,warmup=3,$Y,skip=2,skip_growth=1 reuse:1,warmup=5,$Y,skip=1,skip_growth=1"

run() {  # model, prompts args, stem
  local model="$1" prompts="$2" stem="$3" a="$4" b="$5"
  # generate: two processes, all six seeds (the selection and the report runs below read the cache; their own
  # tables go to the cache folder)
  "${Q[@]}" --out "$CACHE/gen" --model "$model" $prompts --seeds 0 1 2 3 4 5 --images "$CACHE/$model" --stem "$stem-gen-a" \
    --methods $a > "$CACHE/$model-a.log" 2>&1 &
  "${Q[@]}" --out "$CACHE/gen" --model "$model" $prompts --seeds 0 1 2 3 4 5 --images "$CACHE/$model" --stem "$stem-gen-b" \
    --methods $b > "$CACHE/$model-b.log" 2>&1
  wait
  "${Q[@]}" "${R[@]}" --model "$model" $prompts --seeds 0 1 --images "$CACHE/$model" --stem "$stem-select" --methods $a $b
  "${Q[@]}" "${R[@]}" --model "$model" $prompts --seeds 2 3 4 5 --images "$CACHE/$model" --stem "$stem" --methods $a $b
}

mkdir -p "$CACHE"
if [ "$WHAT" = mosaic ] || [ "$WHAT" = all ]; then
  run fashion-mosaic "--prompts mosaics --count 8" quality-fashion-mosaic "$IMAGE_A" "$IMAGE_B"
  .venv/bin/python scripts/frontier.py --bench benchmarks/results/perf/cpu-flux-2+4-1024-scope.jsonl \
    benchmarks/results/perf/cpu-flux-2+4-1024-reuse.jsonl benchmarks/results/perf/cpu-flux-2+4-1024-reuse-low.jsonl \
    benchmarks/results/perf/cpu-flux-2+4-1024-reuse-text.jsonl benchmarks/results/perf/cpu-flux-2+4-1024-reuse-extrapolate.jsonl \
    benchmarks/results/perf/cpu-flux-2+4-1024-reuse-skip.jsonl \
    --quality benchmarks/results/quality/quality-fashion-mosaic.json --out benchmarks/results/frontier \
    --stem frontier-flux-mosaic --title "Flux.1-style mosaic DiT (1,024 image + 32 text tokens)"
fi
if [ "$WHAT" = video ] || [ "$WHAT" = all ]; then
  run fashion-video-long "--prompts classes --count 5" quality-fashion-video-long "$VIDEO_A" "$VIDEO_B"
  .venv/bin/python scripts/frontier.py --bench benchmarks/results/perf/cpu-wan-2b-480x832x33-scope.jsonl \
    benchmarks/results/perf/cpu-wan-2b-480x832x33-reuse.jsonl benchmarks/results/perf/cpu-wan-2b-480x832x33-reuse-extrapolate.jsonl \
    benchmarks/results/perf/cpu-wan-2b-480x832x33-reuse-skip.jsonl \
    --quality benchmarks/results/quality/quality-fashion-video-long.json --out benchmarks/results/frontier \
    --stem frontier-wan-video-long --title "Wan-style long-video DiT (2,048 tokens)"
fi
