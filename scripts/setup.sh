#!/usr/bin/env bash
# Set up a virtual environment in .venv with tokenmerge and its test/demo dependencies.
#   bash scripts/setup.sh            # idempotent: a second run only checks
# torch: an already installed torch of any build (CUDA, ROCm, MPS, CPU) is kept. With none, TORCH_SPEC is
# installed (default torch==2.13.0: pip takes it from a local wheel where the machine has one, as our CI
# does, else from PyPI, the platform's default build). Set TORCH_SPEC to pick another, e.g. "torch==2.5.1".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }
if ! "$VPY" -c "import torch" 2>/dev/null; then
  quiet "$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
if ! "$VPY" -c "import tokenmerge, diffusers, transformers, tomesd, pytest, hypothesis, matplotlib" 2>/dev/null; then
  quiet "$VPY" -m pip install -q -e ".[test]"
fi
"$VPY" -c "import torch, diffusers, tokenmerge; print(f'ready: tokenmerge {tokenmerge.__version__}, torch {torch.__version__}, diffusers {diffusers.__version__}')"
