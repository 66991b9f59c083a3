#!/usr/bin/env bash
# The demo half of lab/archive/collapse/CALIBRATION_real_lm_C.md: for each seed given, the shipped
# demo and the preset (configs/stable.yaml, its start phase included) from 1x, 4x and 8x the demo's
# rate, one run at a time, each archived as it ends (a run already archived is skipped, so an
# interrupted sweep goes on where it stopped). The preset's runs are its third round (round3/: no
# optimiser step on a zero gradient); round 1's (tied batches held) are archived beside shipped/,
# round 2's (tied batches past the target cut the rate) under round2/. ARMS picks and orders the arms.
#   bash lab/demo_calib.sh 6 7 8   -> lab/archive/demo/c_calib/shipped/seed<S>/, c_calib/round3/<arm>/seed<S>/
#   ARMS="stable_2.0e-3 stable_4.0e-3" bash lab/demo_calib.sh 6 8
set -euo pipefail
cd "$(dirname "$0")/.."
archive=lab/archive/demo/c_calib
for seed in "$@"; do
  for arm in ${ARMS:-shipped stable_5.0e-4 stable_2.0e-3 stable_4.0e-3}; do
    dest="$archive/$arm/seed$seed"
    [ "$arm" = shipped ] || dest="$archive/round3/$arm/seed$seed"
    if [ -f "$dest/summary.json" ]; then echo "[demo_calib] $arm seed $seed: archived already, skipped"; continue; fi
    version="${arm}_seed$seed"
    rm -rf "runs/demo/$version"
    extra=()
    [ "$arm" = shipped ] || extra=(--config configs/stable.yaml --model.optim.lr "${arm#stable_}")
    echo "[demo_calib] $arm seed $seed -> runs/demo/$version ($(date -u +%H:%M:%S))"
    bash scripts/demo.sh "${extra[@]}" --seed_everything "$seed" --trainer.logger.init_args.version "$version"
    src="runs/demo/$version"
    mkdir -p "$dest"
    cp "$src/config.yaml" "$src/summary.json" "$dest/"
    gzip -n -c "$src/metrics.csv" > "$dest/metrics.csv.gz"
    for f in "$src"/val_*.json; do gzip -n -c "$f" > "$dest/$(basename "$f").gz"; done
  done
done
