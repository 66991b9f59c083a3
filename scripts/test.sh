#!/usr/bin/env bash
# The test suite: sets up (idempotently), then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# vLLM's own environment, for tests/test_vllm.py; where it cannot be set up those tests skip, saying why.
bash scripts/setup_vllm.sh || echo "[test] vLLM's environment could not be set up: tests/test_vllm.py skips its vLLM tests" >&2
exec "${LLDSLIGHT_VENV:-.venv}/bin/python" -m pytest -q "$@"
