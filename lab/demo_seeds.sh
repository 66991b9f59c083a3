#!/usr/bin/env bash
# One arm of lab/archive/demo/PLAN_light_warmstart.md: the demo's recipe with seed SEED and a warm start on
# the first N training trajectories, evaluated greedily on a knowledge base's test split before and
# after GRPO. Run after `bash scripts/demo.sh` has set up.
#   bash lab/demo_seeds.sh SEED [N=32] [KB=0] -> runs/demo_seeds[_kb1]/n{N}_seed{SEED}/version_0/
# KB 0: the demo's knowledge base and steps as configs/demo.yaml has them now (the first test ran
# them at synthesis seed 0 and 14 steps; since PLAN_shipped_demo.md: seed 2, 30 steps). KB 1: a fresh knowledge base
# (synthesis seed 1) and 30 steps (lab/configs/demo_fresh_kb.yaml). The plan's arms:
#   first test:  for s in 0 1 2 3; do bash lab/demo_seeds.sh $s 32; done; bash lab/demo_seeds.sh 0 64
#   second test: for s in 0 1 2; do bash lab/demo_seeds.sh $s 32 1; done
# then python lab/demo_seeds.py runs/demo_seeds --archive lab/archive/demo/light_warmstart and
#      python lab/demo_seeds.py runs/demo_seeds_kb1 --rule majority --archive lab/archive/demo/light_warmstart_kb1.
set -euo pipefail
cd "$(dirname "$0")/.."
seed="$1"; n="${2:-32}"; kb="${3:-0}"
bin="${LLDSLIGHT_VENV:-.venv}/bin"
if [ "$kb" = 0 ]; then
  data=.lldslight/demo_data; overlay=(); runs=runs/demo_seeds
  "$bin/lldslight" data synth --config configs/demo.yaml
else
  [ "$kb" = 1 ] || { echo "lab/demo_seeds.sh: KB must be 0 or 1, got '$kb'" >&2; exit 2; }
  data=.lldslight/demo_data_kb1; overlay=(--config lab/configs/demo_fresh_kb.yaml); runs=runs/demo_seeds_kb1
  "$bin/lldslight" data synth --config lab/configs/demo_fresh_kb.yaml
fi
ws=".lldslight/demo_seeds/warmstart_kb${kb}_n${n}_seed${seed}"
# The demo's warm-start arguments (scripts/demo.sh) but --limit and --seed.
"$bin/lldslight" sft --data "$data/train.jsonl" --corpus "$data/corpus.jsonl" \
  --out "$ws" --limit "$n" --topk 2 --max-obs-tokens 120 --max-searches 1 \
  --over-budget truncate --keep-unanswerable --seed "$seed"
exec "$bin/lldslight" fit --config configs/demo.yaml "${overlay[@]}" --model.policy.model "$ws" --seed_everything "$seed" \
  --data.val_files "[$data/test.parquet]" \
  --trainer.logger.init_args.save_dir "$runs" --trainer.logger.init_args.name "n${n}_seed${seed}"
