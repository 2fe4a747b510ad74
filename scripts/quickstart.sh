#!/usr/bin/env bash
# Set everything up, then run the main job on the embedded default: a private answer from
# SmolLM2-135M-Instruct with the default MPCache under 3PC ABY3 (SPU's simulator):
#   mpcache run --flagfile=experiments/flags/private_chat.flags
# Plaintext chat instead: bash scripts/quickstart.sh --backend=xla
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mpcache run --flagfile=experiments/flags/private_chat.flags \
  --output_dir=results/quickstart "$@"
