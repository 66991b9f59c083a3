"""The sweep table of benchmarks/lab/SWEEP.md from runs/lab/sweep.jsonl (benchmarks/lab/run.py writes
one line per run); the criteria (benchmarks/collapse.py's, as in the collapse report) are re-evaluated from each run's metrics.csv, and the one-line
verdicts come from benchmarks/lab/verdicts.yaml (run name -> text). The phase detector is replayed
with the recipe's settings (configs/lab/base.yaml: window 100, min_t 2) on every run, so runs made
before that setting are judged alike (the replay reproduces the logged lld/phase exactly when the
settings match).

    python benchmarks/lab/sweep_table.py > /tmp/table.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


RECIPE_PHASES = {"window": 100, "min_t": 2.0, "patience": 4}


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    import yaml

    from benchmarks.collapse import Criteria, summarise_run

    verdicts = yaml.safe_load((ROOT / "benchmarks/lab/verdicts.yaml").read_text()) or {}
    rows = [json.loads(x) for x in (ROOT / "runs/lab/sweep.jsonl").read_text().splitlines() if x.strip()]
    print("| run | arm, seed | settings (besides configs/lab/base.yaml) | steps | wall min | CPU min | steps/h (CPU) "
          "| decay from | reward fall | grad explosion | collapse (by) | Delta<0 steps / measured, before | train reward first -> last third | dev EM | verdict |")
    print("|" + "---|" * 15)
    for row in rows:
        run_dir = ROOT / "runs/lab" / row["name"] / "version_0"
        if not (run_dir / "metrics.csv").is_file():
            continue
        c = summarise_run(run_dir, Criteria(), phases=RECIPE_PHASES)
        settings = " ".join(row.get("configs", []) + row.get("overrides", [])).replace("--model.policy.model ", "policy=").replace("--model.", "").replace("--trainer.", "").replace("--data.", "data.")
        steps = c["steps"]
        explosion_any = c["explosion_steps"][0] if c["explosion_steps"] else None
        cpu = row.get("cpu_s") or 0
        print(f"| {row['name']} | {row['arm']}, {row['seed']} | `{settings}` | {steps} | {row['wall_s'] / 60:.0f} | {cpu / 60:.0f} "
              f"| {round(steps * 3600 / cpu) if cpu else '-'} | {_f(c['decay_start'], 'd')} | {_f(c['reward_fall'], 'd')} (any: {_f(c['reward_fall_any'], 'd')}) "
              f"| {_f(c['explosion'], 'd')} (any: {_f(explosion_any, 'd')}) | **{c['collapse_cause'] or 'no'}** "
              f"| {c['delta_negative_before']} / {c['delta_measured_before']} | {_f(c['reward_first_third'])} -> {_f(c['reward_last_third'])} "
              f"| {_f(c['dev_em_before'])} -> {_f(c['dev_em_after'])} | {verdicts.get(row['name'], '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
