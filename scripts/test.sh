#!/usr/bin/env bash
# The test command: set up, lint (ruff), run the suite on the installed diffusers, then again on the oldest diffusers we
# declare supported (pyproject: diffusers>=0.27), installed beside the venv in .venv-oldest (no torch there:
# the venv's is reused); between them the Triton kernels under Triton's interpreter. Extra arguments go to pytest. Exit code 5 (no tests collected) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# the suite's time budget counts its own runs (ruff, pytest, the docs), not the installs (downloads vary)
BUDGET="${TOKENMERGE_TEST_BUDGET:-480}"  # 8 minutes of runs: with the installs of a fresh clone, under 10
SPENT=0
OLDEST="diffusers==0.27.2 transformers==4.40.2 tokenizers==0.19.1 huggingface_hub==0.25.2 accelerate==0.30.1 peft==0.10.0"
run() {
  local start rc
  start=$(date +%s)
  "$@"
  rc=$?
  SPENT=$(( SPENT + $(date +%s) - start ))
  [ "$rc" -eq 5 ] && { echo "pytest collected no tests" >&2; return 1; }
  return "$rc"
}
# one pytest worker per core (pytest-xdist; TOKENMERGE_TEST_WORKERS=0 runs in this process), each on one OpenMP
# thread: two workers of two threads each on two cores ran slower than one process (thread oversubscription)
WORKERS="${TOKENMERGE_TEST_WORKERS:-auto}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# bytecode written (the gitignored __pycache__), where an environment says not to: each run after the first, and
# each pytest worker, then reuses the compiled modules and pytest's rewritten test modules (collection: 15 s -> 9 s)
unset PYTHONDONTWRITEBYTECODE
PARALLEL=(-n "$WORKERS" --dist worksteal)
[ "$WORKERS" = 0 ] && PARALLEL=()
echo "== ruff (pyproject.toml's [tool.ruff])"
run .venv/bin/python -m ruff check --output-format concise . || exit 1
echo "== tests, installed diffusers"
run .venv/bin/python -m pytest -q "${PARALLEL[@]}" "$@" || exit 1
run bash scripts/docs.sh || exit 1
# the Triton kernels (kernels="triton") on the CPU, under Triton's interpreter: triton beside the venv in
# .venv-triton (its wheel alone; a CUDA machine runs them compiled, in the run above)
TRITON_SPEC="triton==3.6.0"
if [ "${TOKENMERGE_SKIP_TRITON:-0}" != 1 ]; then
  if [ ! -f .venv-triton/.done ] || [ "$(cat .venv-triton/.done)" != "$TRITON_SPEC" ]; then
    rm -rf .venv-triton
    if .venv/bin/python -m pip install -q --no-deps --target .venv-triton "$TRITON_SPEC"; then
      echo "$TRITON_SPEC" > .venv-triton/.done
    else  # a run that cannot test the kernels fails (TOKENMERGE_SKIP_TRITON=1 leaves them out on purpose)
      rm -rf .venv-triton
      echo "== the Triton kernels: $TRITON_SPEC could not be installed; set TOKENMERGE_SKIP_TRITON=1 to run without them" >&2
      exit 1
    fi
  fi
  if [ -f .venv-triton/.done ]; then
    echo "== the Triton kernels on the CPU ($TRITON_SPEC, TRITON_INTERPRET=1)"
    TRITON_INTERPRET=1 PYTHONPATH="$PWD/.venv-triton" run .venv/bin/python -m pytest -q -p no:cacheprovider \
      "${PARALLEL[@]}" -m triton tests/test_kernels.py || exit 1
  fi
fi
if [ "${TOKENMERGE_SKIP_OLDEST:-0}" != 1 ]; then
  if [ ! -f .venv-oldest/.done ] || [ "$(cat .venv-oldest/.done)" != "$OLDEST" ]; then
    rm -rf .venv-oldest
    .venv/bin/python -m pip install -q --no-deps --target .venv-oldest $OLDEST 2>&1 \
      | grep -v "is ignored: it is neither a file nor a directory" || true
    echo "$OLDEST" > .venv-oldest/.done
  fi
  echo "== tests, oldest supported diffusers ($OLDEST)"
  # torch.compile is the same torch either way: its tests run once, above; so do the tests that start other
  # processes (accelerate, memory limits, seeds across processes: process handling, not diffusers' API), and the
  # library's own tooling, the same on any diffusers (the README's layout, the glossary, the CLI's fuzzing and file
  # safety, the Triton kernels, tune's search: the same code on any diffusers, its pipeline calls quality's)
  PYTHONPATH="$PWD/.venv-oldest" run .venv/bin/python -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" \
    -m "not compile and not processes and not slow" --ignore=tests/test_readme.py --ignore=tests/test_glossary.py \
    --ignore=tests/test_tools_layout.py --ignore=tests/test_cli_fuzz.py --ignore=tests/test_cli_safety.py \
    --ignore=tests/test_kernels.py --ignore=tests/test_tune.py "$@" || exit 1
fi
echo "== the suite's runs took ${SPENT} s (budget ${BUDGET} s; the installs aside)"
if [ "$SPENT" -gt "$BUDGET" ]; then  # the fast suite must stay fast: slow tests belong behind -m slow
  echo "== over budget: the suite passed but took ${SPENT} s > ${BUDGET} s; mark the slowest tests slow, or make" \
       "them smaller (pytest --durations=30 lists them)" >&2
  exit 1
fi
