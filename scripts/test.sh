#!/usr/bin/env bash
# The test suite: sets up (idempotently), then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# vLLM's own environment (.venv-vllm, made once, cached like the main one) for tests/test_vllm.py and
# tests/test_bench_vllm.py, which run a real vLLM server and vllm.LLM on this CPU: ~3 minutes to set
# up the first time, ~6 minutes of tests on one worker beside the rest. LLDSLIGHT_TEST_VLLM=0 leaves
# it out; where it cannot be set up (or vLLM cannot run on this CPU) those tests skip, saying why.
if [ "${LLDSLIGHT_TEST_VLLM:-1}" != 0 ]; then
  bash scripts/setup_vllm.sh || echo "[test] vLLM's environment could not be set up: tests/test_vllm.py skips its vLLM tests" >&2
fi
# Test files run in parallel (pytest-xdist, a file's tests on one worker so its fixtures are built
# once), one worker per core up to 4, the cores shared out as torch threads (2 workers x 1 thread beat 1 x 2
# on 2 cores: ~18 min instead of ~30); LLDSLIGHT_TEST_WORKERS=0 runs them in this process, in order.
# The 20 slowest tests are listed at the end: the suite must stay well inside CI's half hour.
cores="$(nproc 2>/dev/null || echo 2)"
workers="${LLDSLIGHT_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
per=$(( workers > 0 ? cores / workers : cores )); export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( per > 0 ? per : 1 ))}"
exec "${LLDSLIGHT_VENV:-.venv}/bin/python" -m pytest -q -n "$workers" --dist loadfile --durations=20 "$@"
