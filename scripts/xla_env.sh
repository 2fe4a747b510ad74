#!/usr/bin/env bash
# Create .venv-xla/: the plaintext path (XLA) on a current JAX release, without SPU
# (requirements-xla.txt; with --gpu also CUDA's plugin, requirements-gpu.txt). Idempotent: a
# hash stamp of the files in .venv-xla/.requirements.sha256 skips pip unless a pin changed.
# Then, for example:
#   .venv-xla/bin/python -m pytest -q -m "not slow and not spu" tests/   # plaintext tests
#   .venv-xla/bin/python -m experiments.device_check --out=results/device  # any accelerator
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-xla
files=(requirements-xla.txt)
if [ "${1:-}" = "--gpu" ]; then files+=(requirements-gpu.txt); fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.12 python3.11 python3; do   # (a pyenv shim may exist and fail)
    if "$candidate" -c 'pass' >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
if [ -z "$PY" ] || ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "xla_env: Python >= 3.11 is required; set PYTHON=/path/to/python3" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "xla_env: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
  echo '*' > "$VENV/.gitignore"   # keep the venv out of git status
fi
stamp="$VENV/.requirements.sha256"
want=$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "xla_env: installing ${files[*]} into $VENV"
  args=()
  for f in "${files[@]}"; do args+=(-r "$f"); done
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${args[@]}"
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c 'import jax; print("xla_env: jax", jax.__version__, "on", jax.default_backend())'
