#!/usr/bin/env bash
# One arm of docs/demo/PLAN_light_warmstart.md: the demo's recipe with seed S and a warm start on the
# first N training trajectories, evaluated greedily on the knowledge base's test split before and
# after the demo's 14 GRPO steps. Run after `bash scripts/demo.sh` has set up and synthesised the data.
#   bash benchmarks/demo_seeds.sh SEED [N=32]     -> runs/demo_seeds/n{N}_seed{SEED}/version_0/
# The plan's arms: seeds 0-3 with N = 32 (R0-R3), seed 0 with N = 64 (C0); then
#   python benchmarks/demo_seeds.py runs/demo_seeds --archive docs/demo/light_warmstart
set -euo pipefail
cd "$(dirname "$0")/.."
seed="$1"; n="${2:-32}"
bin="${LLDSLIGHT_VENV:-.venv}/bin"
ws=".lldslight/demo_seeds/warmstart_n${n}_seed${seed}"
# The demo's warm-start arguments (scripts/demo.sh) but --limit and --seed.
"$bin/lldslight" sft --data .lldslight/demo_data/train.jsonl --corpus .lldslight/demo_data/corpus.jsonl \
  --out "$ws" --limit "$n" --topk 2 --max-obs-tokens 120 --max-searches 1 \
  --over-budget truncate --keep-unanswerable --seed "$seed"
exec "$bin/lldslight" fit --config configs/demo.yaml --model.policy.model "$ws" --seed_everything "$seed" \
  --data.val_files '[.lldslight/demo_data/test.parquet]' \
  --trainer.logger.init_args.save_dir runs/demo_seeds --trainer.logger.init_args.name "n${n}_seed${seed}"
