"""Run one collapse-lab training run and append its row to the sweep log.

    python benchmarks/lab/run.py NAME [--arm grpo|llds|none] [--seed S] [--config EXTRA.yaml ...] [-- FIT OVERRIDES]

Runs ``lldslight fit --config configs/lab/base.yaml --config configs/<arm>.yaml [--config EXTRA ...]``
single-threaded (OMP_NUM_THREADS=1, as benchmarks/collapse.py runs its arms), with CSV logs in
runs/lab/NAME/version_0 and the output in runs/lab/NAME.log; then evaluates the collapse criteria
(benchmarks/collapse.py's summarise_run, the same criteria as the collapse report) and appends one JSON line to runs/lab/sweep.jsonl: the exact command,
wall and CPU seconds (CPU seconds mean something on a shared machine; wall seconds do not), steps,
steps per hour of wall and of CPU time, and the criteria.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ARMS = {"grpo": "configs/grpo.yaml", "llds": "configs/llds.yaml", "none": None}


def main(argv=None) -> int:
    from benchmarks.collapse import Criteria, summarise_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("--arm", choices=list(ARMS), default="grpo")
    parser.add_argument("--base", default="configs/lab/base.yaml")
    parser.add_argument("--config", action="append", default=[], help="extra configs after the arm's (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and data.seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="", help="free text kept in the sweep log")
    args, overrides = parser.parse_known_args(argv)
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", args.base]
    if ARMS[args.arm]:
        cmd += ["--config", ARMS[args.arm]]
    for c in args.config:
        cmd += ["--config", c]
    cmd += ["--seed_everything", str(args.seed), "--data.seed", str(args.seed),
            "--trainer.logger.init_args.save_dir", "runs/lab", "--trainer.logger.init_args.name", args.name,
            "--trainer.logger.init_args.version", "0", *overrides]
    run_dir = ROOT / "runs/lab" / args.name / "version_0"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: pick another name or delete it")
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
    log = ROOT / "runs/lab" / f"{args.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(" ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    row = {"name": args.name, "arm": args.arm, "seed": args.seed, "configs": args.config, "overrides": overrides, "note": args.note,
           "command": "lldslight " + " ".join(cmd[3:]), "exit": code, "wall_s": round(wall), "cpu_s": round(cpu)}
    if (run_dir / "metrics.csv").is_file():
        verdict = summarise_run(run_dir, Criteria())
        row.update(verdict)
        steps = verdict["steps"]
        row["steps_per_hour_wall"] = round(steps * 3600 / wall) if wall else None
        row["steps_per_hour_cpu"] = round(steps * 3600 / cpu) if cpu else None
        print(f"{steps} steps; decay from {verdict['decay_start']}; reward fall {verdict['reward_fall']} (any: "
              f"{verdict['reward_fall_any']}); collapsed: {verdict['collapse_cause'] or 'no'}", flush=True)
    with open(ROOT / "runs/lab/sweep.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"exit {code}, wall {wall:.0f} s, cpu {cpu:.0f} s; log {log}", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
