#!/usr/bin/env bash
# The GPU lane (issue #32): the CUDA tests and the GPU bench on a CUDA machine, online or offline.
#
#   bash scripts/gpu_lane.sh [--wheels DIR] PART [ROW ...]
#
# PART (each prints its own duration; run them one by one where a command has a time limit):
#   check          Python, torch, CUDA device, diffusers/tomesd/pytest versions (seconds)
#   lane           the CUDA lane without torch.compile: pytest -m "(cuda or triton) and not compile"
#                  (tests/test_cuda_lane.py, and the Triton kernels' tests/test_kernels.py)
#   lane-compile   the CUDA lane's torch.compile tests: pytest -m "cuda and compile" (15 inductor compiles)
#   quick          the GPU table's quick rows (sd15-512, flux1-dev-1024, wan2.1-1.3b-480p), eager
#   bench [ROW..]  GPU table rows, eager, one bench command per row -> benchmarks/results/gpu/ROW-eager.*
#   compiled [ROW..]  the same rows compiled, one command per row and compile mode (inductor's default, then
#                  reduce-overhead) -> ROW-compiled-MODE.*; every method is compiled by itself (about a minute
#                  or two each for the big models): GPU_METHODS picks a few per command
#   summary        benchmarks/results/gpu/gpu-table.md: the table of every ROW-eager / ROW-compiled-MODE .jsonl
#   all            check, lane, lane-compile, bench, compiled, summary
#   quick15        a 15-minute GPU lease in one command (about 8 minutes, QUICK_BUDGET seconds, default 480): check,
#                  a CUDA smoke of the lane (a handful of cases: plans CPU = CUDA, no host sync, fp16/bf16
#                  finite), then eager rows while time lasts (flux1-dev-1024 sdxl-1024 pixart-alpha-1024 sd15-512
#                  wan2.1-1.3b-480p, --repeats 5), one compiled row (pixart-alpha-1024: vanilla and whole-block,
#                  inductor's default mode), the summary. A part that would not end inside the budget is skipped
#                  and says so; each part runs under `timeout`. RESULTS_COPY=DIR: after every part, a tarball of
#                  benchmarks/results/gpu (DIR/gpu-results.tgz) and the log so far are left there, so a lease that
#                  ends early still keeps what was measured.
#   next15         the next 15-minute lease, as quick15 (same budget and RESULTS_COPY): check, the smoke (with the
#                  Triton kernels' tests, tests/test_kernels.py, and benchmarks/merge_kernels.py: the merge alone,
#                  torch against Triton -> merge-kernels.md), the Triton kernels against the torch ones
#                  (KERNELS_METHODS: whole-block and attention ToMe 0.5 with kernels=triton and without, the grid
#                  limit) on flux1-dev-1024, with token reuse's full and partial steps in the same run (REUSE_METHODS,
#                  default $REUSE_FLUX: extrapolated at 0.5 and 0.2, and the one-token step that times skip=),
#                  and on pixart-alpha-1024 (files tagged -kernels); token reuse on wan2.1-1.3b-480p (REUSE_METHODS,
#                  default $REUSE_WAN; tagged -reuse), then the rows not yet
#                  measured: wan2.1-14b-480p hunyuan-video-720p flux1-dev-2048 sdxl-2048 (eager), one compiled row
#                  with CUDA graphs (pixart-alpha-1024, whole-block, reduce-overhead), the summary.
#   gen15          the lease for #64 (as quick15, same budget and RESULTS_COPY): whole generations (GEN_STEPS denoiser
#                  steps, default the pipeline's: Flux.1-dev 28, Wan and the UNets 50, with the pipeline's scheduler
#                  and guidance) of tokenmerge.accelerate's three speeds and the step cache's computed and skipped
#                  steps, eager, on flux1-dev-1024, wan2.1-1.3b-480p, sd15-512 and sdxl-1024 (files tagged -gen);
#                  accelerate's computed and skipped steps compiled regionally and with CUDA graphs beside compiled
#                  vanilla on flux1-dev-1024 (tagged -accelerate); then the summary.
# ROW: the rows of `tokenmerge bench --gpu` (all when none is named): sd15-512 sd15-1024 sdxl-1024 sdxl-2048
#   pixart-alpha-1024 flux1-dev-1024 flux1-dev-2048 wan2.1-1.3b-480p wan2.1-14b-480p hunyuan-video-720p
#
# Packages: torch (a CUDA build) must be importable by $PYTHON (default python3; .venv/bin/python if that one
# has no torch and the venv does). Missing diffusers, tomesd, pytest are installed into .gpu/site (on PYTHONPATH
# with src/, nothing else is touched): from the wheel folder --wheels DIR (or $TOKENMERGE_WHEELS, or .gpu/whl when
# it exists), offline, exactly as `pip install --no-index --no-deps --no-compile --target .gpu/site DIR/*.whl`;
# else from the package index (diffusers==0.42.1 with its dependencies, tomesd==0.1.3 without torch, pytest).
# Environment: BENCH_ARGS adds options to every bench command (e.g. BENCH_ARGS="--repeats 5"); GPU_METHODS
# replaces the rows' methods (vanilla always runs; e.g. GPU_METHODS="tome:0.5 grid-limit:0.5"), TAG is added to
# the file names so such partial runs sit beside each other; COMPILE_MODES (default "default reduce-overhead");
# PYTEST_ARGS goes to the lane's pytest (e.g. "-k flux -x"); TOKENMERGE_LANE_DEVICE=cpu runs the lane on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=benchmarks/results/gpu
WHEELS=${TOKENMERGE_WHEELS:-}
[ -z "$WHEELS" ] && [ -d .gpu/whl ] && WHEELS=.gpu/whl
if [ "${1:-}" = "--wheels" ]; then
  [ $# -ge 2 ] || { echo "gpu_lane.sh: --wheels needs a folder of .whl files" >&2; exit 2; }
  WHEELS=$2
  shift 2
fi
PART=${1:-}
shift || true
ROWS=("$@")

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//' >&2; }
case "$PART" in
  check|lane|lane-compile|quick|quick15|next15|gen15|bench|compiled|summary|all) ;;
  "") usage; exit 2 ;;
  *) echo "gpu_lane.sh: unknown part '$PART'" >&2; usage; exit 2 ;;
esac

PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PY=.venv/bin/python
  else
    echo "gpu_lane.sh: $PY cannot import torch; install a CUDA build of torch (or set PYTHON)" >&2
    exit 1
  fi
fi
export PYTHONPATH="$ROOT/.gpu/site:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

missing() {  # the modules of "$@" that $PY cannot import
  for m in "$@"; do "$PY" -c "import $m" 2>/dev/null || echo "$m"; done
}
install() {
  local need
  need=$(missing diffusers tomesd pytest)
  [ -z "$need" ] && return 0
  mkdir -p .gpu/site
  if [ -n "$WHEELS" ]; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "gpu_lane.sh: no .whl files in $WHEELS" >&2; exit 1; }
    echo "installing the wheels of $WHEELS into .gpu/site (offline) for: $need"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target .gpu/site "$WHEELS"/*.whl || exit 1
  else
    echo "installing from the package index into .gpu/site: $need"
    for m in $need; do
      case $m in
        diffusers) "$PY" -m pip install -q --no-compile --target .gpu/site diffusers==0.42.1 || exit 1 ;;
        tomesd) "$PY" -m pip install -q --no-compile --no-deps --target .gpu/site tomesd==0.1.3 || exit 1 ;;
        pytest) "$PY" -m pip install -q --no-compile --target .gpu/site pytest || exit 1 ;;
      esac
    done
  fi
  need=$(missing diffusers tomesd pytest)
  if [ -n "$need" ]; then
    echo "gpu_lane.sh: still missing after the install: $need (add their wheels, and their dependencies', to" \
      "the wheel folder)" >&2
    exit 1
  fi
}

timed() {  # timed NAME COMMAND...: run, print the duration, keep the worst exit code
  local name=$1 start rc
  shift
  start=$(date +%s)
  echo "== $name: $*"
  "$@"
  rc=$?
  echo "== $name: $(( $(date +%s) - start )) s (exit $rc)"
  [ "$rc" -gt "$STATUS" ] && STATUS=$rc
  return 0
}
STATUS=0

rows() {  # the rows named on the command line, else every row of the GPU table
  if [ ${#ROWS[@]} -gt 0 ]; then printf '%s\n' "${ROWS[@]}"; else
    "$PY" -c "from tokenmerge.bench.gpu import ROWS; print('\n'.join(ROWS))"; fi
}

check() {
  "$PY" - <<'EOF'
import importlib, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
else:
    print("device: no CUDA device (the lane's tests will be skipped, the GPU bench refused)")
for name in ("triton", "diffusers", "tomesd", "pytest", "tokenmerge"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} ({module.__file__})")
    except ImportError as err:
        print(f"{name}: not importable ({err})")
EOF
}

has_lane_device() {  # a CUDA device, or TOKENMERGE_LANE_DEVICE=cpu (the self-check): else every test would skip
  [ "${TOKENMERGE_LANE_DEVICE:-}" = cpu ] && return 0
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" && return 0
  echo "gpu_lane.sh: torch sees no CUDA device: the lane's tests would all be skipped (TOKENMERGE_LANE_DEVICE=cpu" \
    "runs their logic on the CPU)" >&2
  return 1
}
# shellcheck disable=SC2086
lane() { has_lane_device && "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_lane.py tests/test_kernels.py \
  -m "(cuda or triton) and not compile" -rfEs ${PYTEST_ARGS:-}; }
# shellcheck disable=SC2086
lane_compile() { has_lane_device && "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_lane.py \
  -m "cuda and compile" -rfEs --durations=20 ${PYTEST_ARGS:-}; }

bench_row() {  # bench_row ROW eager|compiled [COMPILE_MODE]
  local row=$1 kind=$2 stem=$1-$2 extra=()
  if [ "$kind" = compiled ]; then
    extra=(--compile "$3" --compiled-only)
    stem=$row-compiled-$3
  fi
  [ -n "${GPU_METHODS:-}" ] && extra+=(--methods $GPU_METHODS)
  # shellcheck disable=SC2086
  "$PY" -m tokenmerge bench --gpu "$row" "${extra[@]}" --device cuda --no-progress --out "$OUT" \
    --stem "$stem${TAG:+-$TAG}" ${BENCH_ARGS:-}
}

summary() {
  local files=("$OUT"/*-eager*.jsonl "$OUT"/*-compiled-*.jsonl)
  local found=()
  for f in "${files[@]}"; do [ -f "$f" ] && found+=("$f"); done
  [ ${#found[@]} -gt 0 ] || { echo "gpu_lane.sh: no ROW-eager / ROW-compiled-MODE .jsonl in $OUT yet" >&2; return 1; }
  "$PY" -m tokenmerge bench --summarize "${found[@]}" --out "$OUT" --stem gpu-table
}

# quick15's parts: the smallest time (s) each needs to be started, in the issue's order
QUICK15=(smoke:60 flux1-dev-1024:110 sdxl-1024:80 pixart-alpha-1024:70 sd15-512:50 wan2.1-1.3b-480p:150
         compiled-pixart-alpha-1024:150 summary:10)
# gen15: whole generations of accelerate's speeds (#64) at the pipelines' step counts and schedulers, eager; then its
# computed and skipped steps compiled regionally and with CUDA graphs, beside compiled vanilla; then the summary
GEN15=(gen-flux1-dev-1024:150 gen-wan2.1-1.3b-480p:200 gen-sd15-512:60 compiled-rg-flux1-dev-1024:120
       compiled-ro-auto-flux1-dev-1024:120 gen-sdxl-1024:90 summary:10)
NEXT15=(smoke:75 kernels-flux1-dev-1024:130 kernels-pixart-alpha-1024:60 reuse-wan2.1-1.3b-480p:150
        wan2.1-14b-480p:200 hunyuan-video-720p:200 flux1-dev-2048:150 sdxl-2048:100 compiled-ro-pixart-alpha-1024:150
        summary:10)
# the Triton kernels against the torch ones (kernels=triton), whole-block and around attention, with the grid limit
KERNELS_METHODS="tome:0.5,scope=block tome:0.5,scope=block,kernels=triton tome:0.5 tome:0.5,kernels=triton"
KERNELS_METHODS+=" grid-limit:0.5"
# token reuse's partial and full steps (keys=kept: the others' keys and values kept; text=true: Flux's text too),
# extrapolated, and the step cache's computed and skipped steps (stepcache:1: a computed step, then a skipped one)
REUSE_FLUX="reuse:0.5,keys=kept,text=true,extrapolate=1 reuse:0.2,keys=kept,text=true,extrapolate=1 stepcache:1"
REUSE_WAN="reuse:0.3,keys=kept,extrapolate=1 reuse:0.25,keys=kept,extrapolate=1 stepcache:1"
# whole generations of tokenmerge.accelerate's speeds (#64: the step cache on transformers), beside the step
# cache's computed and skipped steps; GEN_STEPS denoiser steps (default: the pipeline's, Flux.1-dev 28, Wan and the
# UNets 50), with the pipeline's scheduler (bench.generation.scheduler_for: Flux's dynamic shift, Wan's UniPC)
# and a tuned setting (#69, #71: what tokenmerge tune chose on the mosaic at 28 steps for 34 dB,
# benchmarks/results/tune/mosaic28-t34-setting.json), applied as its config
GEN_METHODS="auto,speed=faithful auto,speed=balanced auto,speed=fast stepcache:1 stepcache,warmup=3,gap=0.02,gap_growth=0.3"
# compiled (#63, #64): accelerate's computed and skipped steps beside compiled vanilla, regional (its blocks compiled
# in place, as compile_repeated_blocks) and whole with CUDA graphs (reduce-overhead)
COMPILED_ACCELERATE="auto,speed=balanced auto,speed=fast"
# on UNets (sd15, sdxl rows): accelerate is the UNet cache; beside it its cached step and ToMe (#58)
GEN_UNET_METHODS="auto,speed=faithful auto,speed=balanced auto,speed=fast unetcache:2,depth=1,layers=0 tome:0.5"
save() {  # leave what was measured so far in $RESULTS_COPY (quick15, next15)
  [ -n "${RESULTS_COPY:-}" ] || return 0
  tar czf "$RESULTS_COPY/gpu-results.tgz" "$OUT" 2>/dev/null
  return 0
}
in_time() {  # in_time SECONDS FUNCTION ARGS...: a function of this script under `timeout`
  local seconds=$1 fn=$2
  shift 2
  timeout "$seconds" bash -c "$(declare -f "$fn"); PY='$PY' OUT='$OUT'; $fn \"\$@\"" "$fn" "$@"
}
quick15() {  # quick15 [PART:SECONDS...]: the parts of one lease (default QUICK15), each while the budget lasts
  local budget=${QUICK_BUDGET:-480} start part name need left parts=("$@")
  [ ${#parts[@]} -gt 0 ] || parts=("${QUICK15[@]}")
  start=$(date +%s)
  export BENCH_ARGS="${BENCH_ARGS:---repeats 5}" GPU_METHODS="${GPU_METHODS:-}" TAG="${TAG:-}"
  timed check check
  for part in "${parts[@]}"; do
    name=${part%%:*} need=${part##*:}
    left=$(( start + budget - $(date +%s) ))
    if [ "$left" -lt "$need" ]; then
      echo "== $name: skipped ($left s left of the ${budget} s budget, it needs about $need s)"
      continue
    fi
    case $name in
      smoke) timed smoke timeout "$left" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_lane.py -x -rfEs \
        -m "cuda and not compile" \
        -k "flux-tome-block or flux-tome-local or wan-tome-local or unet-sd-todo or pixart-tome-local"
        left=$(( start + budget - $(date +%s) ))
        timed "smoke (Triton kernels)" timeout "$left" "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
          -rfEs -m triton
        left=$(( start + budget - $(date +%s) ))
        timed "merge kernels alone" timeout "$left" "$PY" benchmarks/merge_kernels.py --out "$OUT" ;;
      kernels-flux*) GPU_METHODS="${KERNELS_METHODS} ${REUSE_METHODS:-$REUSE_FLUX}" TAG=kernels \
        timed "bench ${name#kernels-} (Triton kernels, token reuse)" in_time "$left" bench_row "${name#kernels-}" eager ;;
      kernels-*) GPU_METHODS="${KERNELS_METHODS}" TAG=kernels \
        timed "bench ${name#kernels-} (Triton kernels)" in_time "$left" bench_row "${name#kernels-}" eager ;;
      compiled-ro-auto-*) GPU_METHODS="${COMPILED_ACCELERATE}" TAG=accelerate \
        timed "compiled ${name#compiled-ro-auto-} reduce-overhead (accelerate)" \
        in_time "$left" bench_row "${name#compiled-ro-auto-}" compiled reduce-overhead ;;
      compiled-rg-*) GPU_METHODS="${COMPILED_ACCELERATE}" TAG=accelerate \
        timed "compiled ${name#compiled-rg-} regional (accelerate)" \
        in_time "$left" bench_row "${name#compiled-rg-}" compiled regional ;;
      compiled-ro-*) GPU_METHODS="tome:0.5,scope=block" timed "compiled ${name#compiled-ro-} reduce-overhead" \
        in_time "$left" bench_row "${name#compiled-ro-}" compiled reduce-overhead ;;
      compiled-*) GPU_METHODS="tome:0.5,scope=block" timed "compiled ${name#compiled-} default" \
        in_time "$left" bench_row "${name#compiled-}" compiled default ;;
      gen-sd*) GPU_METHODS="${GEN_UNET_METHODS}" TAG=gen BENCH_ARGS="${BENCH_ARGS} --steps ${GEN_STEPS:-50}" \
        timed "generations ${name#gen-} (accelerate)" in_time "$left" bench_row "${name#gen-}" eager ;;
      gen-flux*) GPU_METHODS="${GEN_METHODS}" TAG=gen BENCH_ARGS="${BENCH_ARGS} --steps ${GEN_STEPS:-28}" \
        timed "generations ${name#gen-} (accelerate)" in_time "$left" bench_row "${name#gen-}" eager ;;
      gen-*) GPU_METHODS="${GEN_METHODS}" TAG=gen BENCH_ARGS="${BENCH_ARGS} --steps ${GEN_STEPS:-50}" \
        timed "generations ${name#gen-} (accelerate)" in_time "$left" bench_row "${name#gen-}" eager ;;
      reuse-flux*) GPU_METHODS="${REUSE_METHODS:-$REUSE_FLUX}" TAG=reuse \
        timed "bench ${name#reuse-} (token reuse)" in_time "$left" bench_row "${name#reuse-}" eager ;;
      reuse-*) GPU_METHODS="${REUSE_METHODS:-$REUSE_WAN}" TAG=reuse \
        timed "bench ${name#reuse-} (token reuse)" in_time "$left" bench_row "${name#reuse-}" eager ;;
      summary) timed summary summary ;;
      *) timed "bench $name" in_time "$left" bench_row "$name" eager ;;
    esac
    save
  done
  echo "== $PART: $(( $(date +%s) - start )) s"
}

run_part() {
  case $1 in
    quick15) quick15 ;;
    next15) quick15 "${NEXT15[@]}" ;;
    gen15) quick15 "${GEN15[@]}" ;;
    check) timed check check ;;
    lane) timed lane lane ;;
    lane-compile) timed lane-compile lane_compile ;;
    quick) for row in sd15-512 flux1-dev-1024 wan2.1-1.3b-480p; do timed "bench $row" bench_row "$row" eager; done ;;
    bench) for row in $(rows); do timed "bench $row" bench_row "$row" eager; done ;;
    compiled) for row in $(rows); do for mode in ${COMPILE_MODES:-default reduce-overhead}; do
        timed "compiled $row $mode" bench_row "$row" compiled "$mode"; done; done ;;
    summary) timed summary summary ;;
  esac
}

install
mkdir -p "$OUT"
if [ "$PART" = all ]; then
  for part in check lane lane-compile bench compiled summary; do run_part "$part"; done
else
  run_part "$PART"
fi
exit "$STATUS"
