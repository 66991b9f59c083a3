"""The collapse alarm, validated: lead times and false alarms against the reward-only collapse.

    python lab/alarm_eval.py --calibrate lab/archive/collapse/stageA_* --test lab/archive/collapse/final \\
        --json lab/archive/collapse/alarm.json

Every run is an archived lab run (DIR/<arm>/seed<S>/metrics.csv.gz, lab/collapse.py). Its
collapse step comes from lldslight/science/collapse.py (reward and answered rate only), never from the
alarm. The alarm (lldslight/science/alarm.py, its form fixed before these runs) is replayed offline
(``replay_alarm``) for each threshold h of ``--h``:

- calibration: h = the smallest value of the grid whose false-alarm rate on the calibration runs
  that did not collapse is <= ``--target`` per 1,000 steps (default 0.5: one per 2,000 steps);
- on the test runs, per h: the share of collapses warned >= ``--lead`` (20) steps ahead, the median
  and minimum lead, and false alarms per 1,000 steps on the runs that did not collapse. A warning
  counts for a collapse when it comes at most ``--window`` (100) steps before it; a warning with
  no collapse within ``--window`` steps after it is a false alarm (on any run). Only the first
  firing of a run scores a lead.
- two naive baselines on the same test runs: "reward": the trailing-20 reward below 0.85 x its
  running peak (after step 40; each time the condition starts is a warning); "clock": one warning
  per run at the calibration runs' median collapse step (only if that median exists).

Output: a table on stdout, the JSON, and the delay / false-alarm curve over h (PNG beside it).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from lldslight.errors import script_main
from lldslight.run.writes import check_out_file
from lldslight.science import collapse as C
from lldslight.science.alarm import AlarmConfig, replay_alarm

GRID = [2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0]


def load_runs(dirs: list[str]) -> list[dict]:
    """Each archived run under the given directories: its training frame and collapse verdict.

    A run archived twice (the Xeon controls' GRPO column is the 7e-4 primary set's GRPO seeds
    10-12, copied) is scored once: runs are told apart by the bytes of their metrics."""
    import hashlib

    runs, seen = [], set()
    for d in dirs:
        for path in C.archived_runs(d, "*/seed*"):
            metrics = next(p for p in (path / "metrics.csv.gz", path / "metrics.csv") if p.is_file())
            digest = hashlib.sha256(metrics.read_bytes()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            frame = C.training_rows(C.read_metrics(path))
            s = C.summarise(frame)
            runs.append({"run": str(path), "frame": frame, "steps": len(frame), "collapsed": s["collapsed"], "collapse": s["step"]})
    return runs


def score(warnings: list[int], collapse: Optional[int], window: int, lead: int) -> dict:
    """One run's warnings against its collapse step: the lead of the first warning that counts, and
    the false alarms (warnings with no collapse within ``window`` steps after them)."""
    false = [w for w in warnings if collapse is None or not (0 <= collapse - w <= window)]
    counted = [w for w in warnings if collapse is not None and 0 <= collapse - w <= window]
    first = counted[0] if counted else None
    return {"false": len(false), "lead": collapse - first if first is not None else None,
            "warned": first is not None and collapse - first >= lead}


def alarm_warnings(run: dict, h: float) -> list[int]:
    out = replay_alarm(run["frame"], AlarmConfig(h=h))
    return [int(s) for s, f in zip(out["step"], out["alarm/fired"]) if f > 0]


def reward_warnings(run: dict, fraction: float = 0.85, start: int = 40) -> list[int]:
    reward = C.column(run["frame"], "train/reward") or []
    smooth = C.trailing_mean(reward, 20)
    peak = C.running_peak(smooth)
    steps = [int(s) for s in run["frame"].index]
    out, low = [], False
    for s, r, p in zip(steps, smooth, peak):
        now = s >= start and C.finite(r) and C.finite(p) and r < fraction * p
        if now and not low:
            out.append(s)
        low = now
    return out


def summarise(runs: list[dict], warnings_of, window: int, lead: int) -> dict:
    scores = [score(warnings_of(r), r["collapse"] if r["collapsed"] else None, window, lead) for r in runs]
    collapses = [s for s, r in zip(scores, runs) if r["collapsed"]]
    quiet = [(s, r) for s, r in zip(scores, runs) if not r["collapsed"]]
    leads = [s["lead"] for s in collapses if s["lead"] is not None]
    quiet_steps = sum(r["steps"] for _, r in quiet)
    return {
        "collapses": len(collapses), "warned_in_time": sum(s["warned"] for s in collapses),
        "share_warned": sum(s["warned"] for s in collapses) / len(collapses) if collapses else None,
        "median_lead": statistics.median(leads) if leads else None, "min_lead": min(leads) if leads else None,
        "quiet_runs": len(quiet), "quiet_steps": quiet_steps,
        "false_alarms_quiet": sum(s["false"] for s, _ in quiet),
        "false_per_1000": 1000 * sum(s["false"] for s, _ in quiet) / quiet_steps if quiet_steps else None,
        "false_alarms_all": sum(s["false"] for s in scores),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", nargs="+", required=True, help="archive directories of the calibration runs")
    parser.add_argument("--test", nargs="+", required=True, help="archive directories of the held-out runs")
    parser.add_argument("--h", nargs="+", type=float, default=GRID)
    parser.add_argument("--target", type=float, default=0.5, help="false alarms per 1,000 steps allowed on calibration (default 0.5)")
    parser.add_argument("--lead", type=int, default=20)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.json is not None:  # refused now, not after the work
        check_out_file(args.json, "--json")
    calib, test = load_runs(args.calibrate), load_runs(args.test)
    if not calib or not test:
        raise SystemExit(f"alarm_eval: no archived runs in {args.calibrate if not calib else args.test}")
    curve_calib = {h: summarise(calib, lambda r, h=h: alarm_warnings(r, h), args.window, args.lead) for h in args.h}
    ok = [h for h in args.h if curve_calib[h]["false_per_1000"] is not None and curve_calib[h]["false_per_1000"] <= args.target]
    chosen = min(ok) if ok else max(args.h)
    curve = {h: summarise(test, lambda r, h=h: alarm_warnings(r, h), args.window, args.lead) for h in args.h}
    falls = [r["collapse"] for r in calib if r["collapsed"]]
    clock = statistics.median(falls) if falls else None
    baselines = {"reward_0.85_peak": summarise(test, reward_warnings, args.window, args.lead)}
    if clock is not None:
        baselines["clock"] = summarise(test, lambda r: [int(clock)] if clock < r["steps"] else [], args.window, args.lead)
    result = {"chosen_h": chosen, "calibration_runs": [r["run"] for r in calib], "test_runs": [r["run"] for r in test],
              "calibration_curve": curve_calib, "test_curve": curve, "test_at_chosen_h": curve[chosen], "baselines": baselines,
              "clock_step": clock, "settings": {"target": args.target, "lead": args.lead, "window": args.window}}
    print(f"calibration: {len(calib)} runs ({sum(r['collapsed'] for r in calib)} collapsed); chosen h = {chosen}")
    print(f"test: {len(test)} runs ({sum(r['collapsed'] for r in test)} collapsed)\n")
    print("| rule | collapses warned >= %d steps ahead | median lead | min lead | false alarms / 1,000 steps (quiet runs) | false alarms (all runs) |" % args.lead)
    print("|---|---|---|---|---|---|")
    rows = [(f"alarm h={h:g}" + (" (chosen)" if h == chosen else ""), curve[h]) for h in args.h] + list(baselines.items())
    for name, s in rows:
        print(f"| {name} | {s['warned_in_time']} of {s['collapses']} | {s['median_lead']} | {s['min_lead']} "
              f"| {s['false_per_1000'] if s['false_per_1000'] is None else round(s['false_per_1000'], 2)} | {s['false_alarms_all']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        _curve_png(curve, Path(args.json).with_suffix(".png"))
    return 0


def _curve_png(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = sorted(curve)
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.plot([curve[h]["false_per_1000"] or 0 for h in hs], [curve[h]["median_lead"] or 0 for h in hs], "o-")
    for h in hs:
        ax.annotate(f"h={h:g}", (curve[h]["false_per_1000"] or 0, curve[h]["median_lead"] or 0), fontsize=7)
    ax.set_xlabel("false alarms per 1,000 steps (runs that did not collapse)")
    ax.set_ylabel("median lead (steps)")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(script_main(main))
