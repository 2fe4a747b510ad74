#!/usr/bin/env bash
# Set everything up, then run the main job on the embedded default (greedy chat with
# SmolLM2-135M-Instruct): python -m experiments.run --flagfile=experiments/flags/chat.flags
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m experiments.run --flagfile=experiments/flags/chat.flags \
  --output_dir=results/quickstart "$@"
