#!/usr/bin/env bash
# Run the test suite inside .venv (created by scripts/setup.sh when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
