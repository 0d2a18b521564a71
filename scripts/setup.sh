#!/usr/bin/env bash
# Set up a virtual environment in .venv with tokenmerge and its dependencies.
#   bash scripts/setup.sh            # the package with its test, docs and demo dependencies (README command 2)
#   bash scripts/setup.sh demo       # only what the demo needs (README command 1: half the install time)
# Idempotent: a second run only checks; `setup.sh` after `setup.sh demo` adds the test dependencies.
# torch: an already installed torch of any build (CUDA, ROCm, MPS, CPU) is kept. With none, TORCH_SPEC is
# installed (default torch==2.13.0: pip takes it from a local wheel where the machine has one, as our CI
# does, else from PyPI, the platform's default build). Set TORCH_SPEC to pick another, e.g. "torch==2.5.1".
# pip installs without compiling every module to bytecode (most are never imported); the full setup compiles the
# venv once afterwards on all cores, the demo setup lets Python compile what it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-test}" in
  test) EXTRAS=test,docs; NEEDS="tokenmerge, diffusers, transformers, tomesd, pytest, xdist, hypothesis, matplotlib, peft, ruff"
        NEEDS="$NEEDS, mkdocs, material, mkdocstrings_handlers.python" ;;  # docs: the site, built by test.sh
  demo) EXTRAS=quality; NEEDS="tokenmerge, diffusers, matplotlib, tqdm, accelerate, safetensors, PIL" ;;
  *) echo "setup.sh: unknown argument '$1': give nothing (tests and demo) or 'demo' (the demo only)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }
if ! "$VPY" -c "import torch" 2>/dev/null; then
  quiet "$VPY" -m pip install -q --no-compile "${TORCH_SPEC:-torch==2.13.0}"
fi
if ! "$VPY" -c "import $NEEDS" 2>/dev/null; then
  quiet "$VPY" -m pip install -q --no-compile -e ".[$EXTRAS]"
  rm -f .venv/.compiled
fi
if [ "$EXTRAS" = test,docs ] && [ ! -f .venv/.compiled ]; then  # test runs start many interpreters: compile once
  # (not the packages the tests import a few modules of, if any: Python compiles those when it imports them)
  "$VPY" -m compileall -q -j 0 -x '/(transformers|pip|fontTools|pygments|networkx|setuptools|[a-z_]+/tests)/' \
    "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  touch .venv/.compiled
fi
"$VPY" -c "import torch, diffusers, tokenmerge; print(f'ready: tokenmerge {tokenmerge.__version__}, torch {torch.__version__}, diffusers {diffusers.__version__}')"
