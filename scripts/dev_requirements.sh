#!/usr/bin/env bash
# Add the test-only references (requirements-dev.txt: torch, transformers, accelerate, pytest)
# to .venv, installed together with requirements.txt so the runtime pins hold. Idempotent and
# instant when present: a hash stamp of both files in .venv/.requirements-dev.sha256 skips pip
# unless a pin changed. Called by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "dev_requirements: no .venv; run bash scripts/setup.sh first" >&2
  exit 1
fi
stamp=.venv/.requirements-dev.sha256
want=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "dev_requirements: installing the test references (requirements-dev.txt) into .venv"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -r requirements.txt -r requirements-dev.txt
  echo "$want" > "$stamp"
fi
