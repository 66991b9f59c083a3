#!/usr/bin/env bash
# The embedded demo: sets up (idempotently), synthesises the knowledge base, warm-starts
# SmolLM2-135M-Instruct on gold search trajectories (cached after the first run), then trains it with
# GRPO to search that knowledge base. Extra arguments go to `lldslight fit` (e.g. --trainer.max_steps 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bin="${LLDSLIGHT_VENV:-.venv}/bin"
# The knowledge base configs/demo.yaml trains on (its data.synthesize, out_dir .lldslight/demo_data);
# skipped when already there.
"$bin/lldslight" data synth --config configs/demo.yaml
# By itself the 135M model never writes <search>/<answer>: EM reward 0 everywhere, no GRPO signal.
# ~2 min of supervised warm start on 1-search gold trajectories, laid out as the demo's rollouts
# (top-2 passages, observations cut at 120 tokens); questions that need two searches are kept with
# one, so the model guesses there and GRPO groups get mixed rewards. Skipped when already done.
"$bin/lldslight" sft --data .lldslight/demo_data/train.jsonl --corpus .lldslight/demo_data/corpus.jsonl \
  --out .lldslight/demo_warmstart --limit 64 --topk 2 --max-obs-tokens 120 --max-searches 1 \
  --over-budget truncate --keep-unanswerable
exec "$bin/lldslight" fit --config configs/demo.yaml --model.policy.model .lldslight/demo_warmstart "$@"
