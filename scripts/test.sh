#!/usr/bin/env bash
# Run the test suite inside .venv: scripts/setup.sh first when .venv is missing (runtime
# requirements + the default model), then the test-only references (requirements-dev.txt,
# scripts/dev_requirements.sh: skipped when already installed), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
bash scripts/dev_requirements.sh
exec .venv/bin/python -m pytest -q "$@"
