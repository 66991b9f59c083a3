#!/usr/bin/env bash
# The test suite: sets up (idempotently), then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${LLDSLIGHT_VENV:-.venv}/bin/python" -m pytest -q "$@"
