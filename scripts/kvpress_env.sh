#!/usr/bin/env bash
# Create .venv-kvpress/ from requirements-kvpress.txt (idempotent: re-installs only when the
# file changes, hash stamp in .venv-kvpress/.requirements.sha256). A separate venv because
# NVIDIA kvpress needs numpy >= 2 and transformers < 5.3, the runtime .venv numpy < 2.
# Used by experiments/kvpress_crosscheck.py (a benchmark, not a test).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-kvpress
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
if [ -z "$PY" ] || ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
  echo "kvpress_env: Python >= 3.10 is required (kvpress 0.5.5); set PYTHON=/path/to/python3" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "kvpress_env: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
  echo '*' > "$VENV/.gitignore"   # keep the venv out of git status
fi
stamp="$VENV/.requirements.sha256"
want=$(sha256sum requirements-kvpress.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "kvpress_env: installing requirements-kvpress.txt into $VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements-kvpress.txt
  # torch==2.13.0 must be the CPU build: refuse a CUDA wheel (and its nvidia-* downloads).
  if ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)'; then
    echo "kvpress_env: pip installed a CUDA build of torch; install the CPU wheel" \
         "(torch 2.13.0+cpu) into $VENV and re-run" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
print("kvpress_env: ready:", ", ".join(f"{p} {version(p)}" for p in
                                      ("kvpress", "torch", "transformers", "numpy", "gguf")))
PY
