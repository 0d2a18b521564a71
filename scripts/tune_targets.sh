#!/usr/bin/env bash
# tokenmerge tune on the trained testbeds at the cells of #69's targets, each with its default budget (40
# generations), 4 prompts (2 searched at seed 0, 2 held out at seed 1), accelerate's presets and the peers run on the
# same held-out items beside it (cache-dit's need the bench extra: pip install -e ".[bench]"). Writes benchmarks/results/tune/CELL.{md,json,-plot.png,-setting.json}.
#   mosaic28-t34, mosaic28-t31, mosaic28-s3   fashion-mosaic on Flux.1-dev 1024's grid (flow-matching Euler,
#                                             shift e^1.15), 28 steps: target 34 dB, 31 dB, speed 3
#   mosaic28-s2, mosaic28-s1.65               speed 2 and 1.65 at 28 steps, no points beside them: ours at the
#                                             shares of SeaCache's and cache-dit's points (matched computed share)
#   mosaic50-t34                              the same at 50 steps (mosaic50-s2.5: speed 2.5, SeaCache's share)
#   video50-t33                               fashion-video-long on Wan 2.1 720p's UniPC, shift 5, 50 steps
#                                             (video50-s2.2: speed 2.2, SeaCache's share)
#   unet25-t36                                fashion-unet under DPM-Solver++ 2M, 25 steps (peer: DeepCache's recipe)
#
#   bash scripts/tune_targets.sh CELL [CELL...]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY="${PYTHON:-.venv/bin/python}"
OUT=benchmarks/results/tune
# the peers at their best settings of the committed frontiers, SeaCache, and cache-dit's calibrators with its step
# masks of fixed budgets (fast: 11 computed of 28, 20 of 50; ultra: 8 of 28, 14 of 50)
FLOW_PEERS=(seacache:0.25 magcache:0.06 magcache:0.12 fbc:0.1 taylorseer:3 cachedit:0.2,taylorseer=true
            cachedit:0.2,calibrator=foca,mask=fast cachedit:0.2,calibrator=dmd,mask=fast
            cachedit:0.2,calibrator=taylorseer,mask=ultra)
for cell in "$@"; do
  T=("$PY" -m tokenmerge tune --no-progress --out "$OUT" --stem "$cell")
  case "$cell" in
    mosaic28-t34) "${T[@]}" --model fashion-mosaic --steps 28 --target-psnr 34 --peers "${FLOW_PEERS[@]}" ;;
    mosaic28-t31) "${T[@]}" --model fashion-mosaic --steps 28 --target-psnr 31 --peers "${FLOW_PEERS[@]}" ;;
    mosaic28-s3) "${T[@]}" --model fashion-mosaic --steps 28 --speed 3 --peers "${FLOW_PEERS[@]}" ;;
    mosaic28-s2) "${T[@]}" --model fashion-mosaic --steps 28 --speed 2 --no-presets ;;
    mosaic28-s1.65) "${T[@]}" --model fashion-mosaic --steps 28 --speed 1.65 --no-presets ;;
    mosaic50-t34) "${T[@]}" --model fashion-mosaic --steps 50 --target-psnr 34 --peers "${FLOW_PEERS[@]}" ;;
    mosaic50-s2.5) "${T[@]}" --model fashion-mosaic --steps 50 --speed 2.5 --no-presets ;;
    video50-s2.2) "${T[@]}" --model fashion-video-long --shift 5 --steps 50 --speed 2.2 --no-presets ;;
    video50-t33) "${T[@]}" --model fashion-video-long --shift 5 --steps 50 --target-psnr 33 \
                   --peers seacache:0.25 magcache:0.12 fbc:0.1 cachedit:0.2,taylorseer=true \
                   cachedit:0.2,calibrator=dmd,mask=fast ;;
    unet25-t36) "${T[@]}" --model fashion-unet --scheduler dpm++2m --steps 25 --target-psnr 36 \
                  --peers unetcache:2,warmup=1,extrapolate=0 ;;
    *) echo "tune_targets.sh: unknown cell '$cell'" >&2; exit 2 ;;
  esac
done
