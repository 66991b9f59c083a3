#!/usr/bin/env bash
# The embedded demo: sets up (idempotently), synthesises the knowledge base, warm-starts
# SmolLM2-135M-Instruct on gold search trajectories (cached after the first run), then trains it with
# GRPO to search that knowledge base. Extra arguments go to `lldslight fit` (e.g. --trainer.max_steps 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# configs/vllm.yaml samples with vLLM, which runs from its own environment: set it up (once) when named.
case " $* " in *vllm*) bash scripts/setup_vllm.sh ;; esac
# The run summary counts the demo's time from here (data, warm start, training, both evaluations).
export LLDSLIGHT_STARTED_AT="$(date +%s)"
bin="${LLDSLIGHT_VENV:-.venv}/bin"
# The knowledge base configs/demo.yaml trains on (its data.synthesize, out_dir .lldslight/demo_data);
# skipped when already there.
"$bin/lldslight" data synth --config configs/demo.yaml
# By itself the 135M model never writes <search>/<answer>: EM reward 0 everywhere, no GRPO signal.
# ~1 min of supervised warm start on the gold trajectories among the first 60 training questions
# that one search answers (~30, all one-hop), laid out as the demo's rollouts (top-2 passages,
# observations cut at 120 tokens): the format and copying an answer from a passage, not yet
# answering reliably, which is what GRPO then learns. Questions that need two searches are left
# out: cut after one search, their gold answer is not in the context, and training on them taught
# the model to write unsupported answers (docs/lab/demo_studies.md). Skipped when already done.
"$bin/lldslight" sft --data .lldslight/demo_data/train.jsonl --corpus .lldslight/demo_data/corpus.jsonl \
  --out .lldslight/demo_warmstart --limit 60 --topk 2 --max-obs-tokens 120 --max-searches 1 \
  --over-budget skip --keep-unanswerable
exec "$bin/lldslight" fit --config configs/demo.yaml --model.policy.model .lldslight/demo_warmstart "$@"
