"""C2's registered calibration of the drift bound: ``target_kl`` from the pilot runs, and the arm file.

    python lab/calibrate_target_kl.py                 # reads the pilot archive, writes lab/configs/arms/bound.yaml

The rule (lab/archive/collapse/CONFIRMATORY.md, "C2"): plain GRPO at 2.5e-4 (the fixed rate that
held), pilot seeds 0 and 1, 600 steps; ``target_kl`` = the median of ``drift/kl_k3_last`` over steps
30-599 of both runs pooled (the drift per rollout batch that a rate which held produces), rounded to
two significant figures. The arm file puts that target in both halves of the bound: the update's
early stop (``model.update.target_kl``, factor 1.5) and the AdaptiveRate callback (factor 1.5,
high 2, low 0.5, lr 1e-5 to 1e-3), as registered (named ``rule: bang_bang, signal_free: react`` since the
callback's defaults changed). Kept as registered: it counts every step, the tied ones too (KL ~1e-5,
the optimiser's momentum alone), which halved the target; lab/drift_targets.py leaves them out.
"""
from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Optional

from lldslight.errors import script_main
from lldslight.science import collapse as C

ROOT = Path(__file__).resolve().parents[1]
PILOT = ROOT / "lab" / "archive" / "collapse" / "c2_pilot_2.5e-4" / "grpo"
ARM = ROOT / "lab" / "configs" / "arms" / "bound.yaml"
SEEDS, FIRST, LAST = (0, 1), 30, 599  # the registered pilot seeds and step range (inclusive)
COLUMN = "drift/kl_k3_last"


def pooled_drift(pilot: Path) -> list[float]:
    """Every finite ``drift/kl_k3_last`` of steps FIRST..LAST of the pilot seeds' runs."""
    values = []
    for seed in SEEDS:
        run = pilot / f"seed{seed}"
        frame = C.training_rows(C.read_metrics(run))
        if frame.empty or int(frame.index.max()) < LAST:
            raise SystemExit(f"calibrate: {run} is not a finished pilot run (needs steps up to {LAST}; "
                             f"has {int(frame.index.max()) + 1 if not frame.empty else 0})")
        column = C.column(frame, COLUMN)
        if column is None:
            raise SystemExit(f"calibrate: {run} logged no {COLUMN} (a run from before the drift metrics?)")
        values += [v for s, v in zip(frame.index, column) if FIRST <= s <= LAST and C.finite(v)]
    return values


def two_significant(x: float) -> float:
    """``x`` rounded to two significant figures (0.0034567 -> 0.0035)."""
    if x <= 0 or not math.isfinite(x):
        raise SystemExit(f"calibrate: the pilot median drift is {x}, not a positive number")
    return round(x, 1 - int(math.floor(math.log10(x))))


def arm_text(target: float, median: float, n: int) -> str:
    return (f"# Drift bound: the update's early stop and AdaptiveRate at target_kl {target:g} (C2, calibrated).\n"
            f"# Written by lab/calibrate_target_kl.py from the pilot runs (lab/archive/collapse/c2_pilot_2.5e-4):\n"
            f"# the median of {COLUMN} over steps {FIRST}-{LAST} of seeds {SEEDS[0]} and {SEEDS[1]}, {median:.6g} over {n} steps,\n"
            f"# to two significant figures (lab/archive/collapse/CONFIRMATORY.md).\n"
            "model:\n"
            f"  update: {{target_kl: {target:g}, target_kl_factor: 1.5}}\n"
            "trainer:\n"
            "  callbacks+:\n"
            "    - class_path: lldslight.callbacks.AdaptiveRate\n"
            "      # rule and signal_free name C2's behaviour (the defaults changed after it ran; tests/test_rate_controller.py replays C2's runs)\n"
            f"      init_args: {{target_kl: {target:g}, rule: bang_bang, signal_free: react, factor: 1.5, high: 2.0, low: 0.5, "
            "lr_min: 1.0e-5, lr_max: 1.0e-3}\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pilot", type=Path, default=PILOT, help="the pilot arm's archive (default: C2's)")
    parser.add_argument("--out", type=Path, default=ARM, help="the arm file to write (default lab/configs/arms/bound.yaml)")
    args = parser.parse_args(argv)
    values = pooled_drift(args.pilot)
    median = statistics.median(values)
    target = two_significant(median)
    args.out.write_text(arm_text(target, median, len(values)))
    print(f"target_kl = {target:g} (median {median:.6g} of {len(values)} steps) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
