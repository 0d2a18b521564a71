#!/usr/bin/env bash
# Build the documentation site (mkdocs.yml, docs/) with --strict: a broken link, a stale generated page or a bad
# docstring fails. Installs the `docs` extra into .venv when mkdocs is missing (quietly). The site goes to a temporary
# folder, removed afterwards; `bash scripts/docs.sh OUT` keeps it in OUT instead (`mkdocs serve` previews it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if ! "$PY" -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  "$PY" -m pip install -q --no-compile -e ".[docs]" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
fi
OUT="${1:-}"
if [ -z "$OUT" ]; then OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT; fi
echo "== docs: mkdocs build --strict"
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet -d "$OUT"
