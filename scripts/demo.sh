#!/usr/bin/env bash
# The embedded demo: sets up (idempotently), then trains SmolLM2-135M-Instruct with GRPO to search a
# synthetic knowledge base. Extra arguments go to `lldslight fit` (e.g. --trainer.max_steps 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${LLDSLIGHT_VENV:-.venv}/bin/lldslight" fit --config configs/demo.yaml "$@"
