"""Stage C's calibration read as lab/archive/collapse/CALIBRATION_real_lm_C.md fixed it, from the archives.

    python lab/calib_c.py              # round 3 (the preset as shipped): tables, verdict, calibration_round3.json
    python lab/calib_c.py --round 2    # round 2 (tied batches past the target cut the rate): calibration_round2.json
    python lab/calib_c.py --round 1    # round 1 (tied batches held): calibration.json

Real model (lab/archive/collapse/real_lm_C_calib/<arm>/seed<S>/; round 1's arms slowstart_*, round 2's
slowstart_cut_*, round 3's slowstart_skip_*): a run holds if the runner's collapse rule (horizon 80, hold 30: its summary's
``collapse``) did not fire over its 80 steps. Demo (lab/archive/demo/c_calib/<arm>/seed<S>/, round 2's
preset runs under c_calib/round2/ and round3/; the shipped demo's runs serve both rounds): a run is lost if its dev
EM after training is 0 or its training answered rate over its last 10 steps is under 0.5. The preset
is calibrated if every real-model run at 2e-3 and 4e-3 holds on seeds 1-3, no demo run at 4x or 8x is
lost on seeds 6-8, and from the demo's own rate the dev EM change minus the shipped demo's (paired by
seed) has a 95% t interval that contains 0 or lies above it. Missing runs are listed, and the verdict
waits for them, unless a run already failed (a lost run or a collapse decides: "not calibrated").
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import statistics
from pathlib import Path

from lldslight.errors import script_main
from lldslight.run.writes import check_out_file

if __package__:  # lab.calib_c: imported (tests)
    from .demo_seeds import T975
else:  # python lab/calib_c.py: the script's own folder is on sys.path
    from demo_seeds import T975

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "lab" / "archive" / "collapse" / "real_lm_C_calib"
DEMO = ROOT / "lab" / "archive" / "demo" / "c_calib"
REAL_SEEDS, DEMO_SEEDS = (1, 2, 3), (6, 7, 8)
PRESET_ARMS = ("stable_5.0e-4", "stable_2.0e-3", "stable_4.0e-3")  # the demo's rate, 4x, 8x
# Each round of the calibration: its real-model arms and where its demo preset runs are archived (the
# shipped demo's runs, DEMO/shipped, serve every round: the shipped demo did not change).
ROUNDS = {1: {"real_arms": ("slowstart_2e-3", "slowstart_4e-3"), "demo": DEMO, "json": REAL / "calibration.json"},
          2: {"real_arms": ("slowstart_cut_2e-3", "slowstart_cut_4e-3"), "demo": DEMO / "round2",
              "json": REAL / "calibration_round2.json"},
          3: {"real_arms": ("slowstart_skip_2e-3", "slowstart_skip_4e-3"), "demo": DEMO / "round3",
              "json": REAL / "calibration_round3.json"}}


def column(run: Path, key: str) -> dict[int, float]:
    """{step: value} of one metric from a run's archived metrics.csv.gz (rows without it skipped)."""
    with gzip.open(run / "metrics.csv.gz", "rt", newline="") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key) not in (None, "")}


def real_run(arm: str, seed: int) -> dict | None:
    run = REAL / arm / f"seed{seed}"
    if not (run / "summary.json").is_file():
        return None
    summary = json.loads((run / "summary.json").read_text())
    reward, lr = column(run, "train/reward"), column(run, "train/lr")
    return {"steps": summary["steps"], "collapsed": bool(summary["collapse"]["collapsed"]),
            "holds": summary["steps"] >= 80 and not summary["collapse"]["collapsed"],
            "median_lr": statistics.median(lr.values()), "reward_last10": statistics.fmean(reward[s] for s in sorted(reward)[-10:])}


def demo_run(arm: str, seed: int, root: Path = DEMO) -> dict | None:
    run = root / arm / f"seed{seed}"
    if not (run / "summary.json").is_file():
        return None
    summary = json.loads((run / "summary.json").read_text())
    answered = column(run, "train/answered_rate")
    last10 = statistics.fmean(answered[s] for s in sorted(answered)[-10:])
    em_after = summary["dev_after"]["em"]
    return {"em_before": summary["dev_before"]["em"], "em_after": em_after, "em_change": summary["dev_em_change"]["change"],
            "answered_last10": last10, "lost": em_after == 0 or last10 < 0.5}


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(xs)
    half = T975[len(xs) - 1] * statistics.stdev(xs) / len(xs) ** 0.5
    return mean, mean - half, mean + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round", type=int, choices=sorted(ROUNDS), default=max(ROUNDS),
                        help=f"the calibration round (default {max(ROUNDS)}, the preset as shipped now)")
    parser.add_argument("--json", type=Path, default=None, help="default: the round's calibration json beside the real-model runs")
    args = parser.parse_args()
    this = ROUNDS[args.round]
    args.json = args.json or this["json"]
    check_out_file(args.json, "--json")  # refused now, not after the work
    real = {f"{a}/seed{s}": real_run(a, s) for a in this["real_arms"] for s in REAL_SEEDS}
    demo = {f"shipped/seed{s}": demo_run("shipped", s) for s in DEMO_SEEDS}
    demo |= {f"{a}/seed{s}": demo_run(a, s, this["demo"]) for a in PRESET_ARMS for s in DEMO_SEEDS}
    missing = [k for k, v in {**real, **demo}.items() if v is None]
    print("| real-model run | steps | holds | median rate | reward, last 10 |\n|---|---|---|---|---|")
    for k, v in real.items():
        print(f"| {k} | " + (" | ".join([str(v["steps"]), "yes" if v["holds"] else "no", f"{v['median_lr']:.2e}", f"{v['reward_last10']:.3f}"]) if v else "missing | | | ") + " |")
    print("\n| demo run | dev EM before -> after | change | answered, last 10 | lost |\n|---|---|---|---|---|")
    for k, v in demo.items():
        print(f"| {k} | " + (f"{v['em_before']:.3f} -> {v['em_after']:.3f} | {v['em_change']:+.3f} | {v['answered_last10']:.2f} | {'yes' if v['lost'] else 'no'}" if v else "missing | | | ") + " |")
    checks = {
        "real_holds": all(v["holds"] for v in real.values() if v),
        "demo_4x_8x_not_lost": all(not v["lost"] for k, v in demo.items() if v and not k.startswith(("shipped", "stable_5.0e-4"))),
    }
    pairs = [demo[f"stable_5.0e-4/seed{s}"]["em_change"] - demo[f"shipped/seed{s}"]["em_change"]
             for s in DEMO_SEEDS if demo[f"stable_5.0e-4/seed{s}"] and demo[f"shipped/seed{s}"]]
    own = None
    if len(pairs) >= 2:
        mean, low, high = t_interval(pairs)
        own = {"pairs": pairs, "mean": mean, "low": low, "high": high}
        checks["own_rate_learns"] = high >= 0
        print(f"\nown rate: dev EM change, preset minus shipped, {mean:+.3f} (95% t interval {low:+.3f} to {high:+.3f}; {len(pairs)} seeds)")
    # A check that already failed decides: no missing run can make a lost run or a failed one hold.
    failed = [k for k, ok in checks.items() if not ok and k != "own_rate_learns"]
    verdict = ("not calibrated" if failed else ("waiting for " + ", ".join(missing)) if missing
               else "calibrated" if all(checks.values()) else "not calibrated")
    print(f"\nchecks so far: {checks}\nverdict: {verdict}")
    args.json.write_text(json.dumps({"round": args.round, "real": real, "demo": demo, "own_rate": own, "checks": checks, "missing": missing,
                                     "verdict": verdict}, indent=1) + "\n")
    print(f"json: {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}")


if __name__ == "__main__":
    raise SystemExit(script_main(main))
