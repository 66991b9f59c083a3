"""What a step of the real-model lab costs, with the frozen bottom layers computed once per rollout
batch (``model.update.frozen_prefix``, lldslight/update/frozen_prefix.py) and without.

    python benchmarks/lab_step.py --json benchmarks/results/lab_step.json     # 2 rounds, 1 thread
    python benchmarks/lab_step.py --threads 2 --rounds 3 --steps 6

Each side is a whole ``lldslight fit`` of the lab's recipe (lab/configs/real_lm.yaml: SmolLM2-135M,
LoRA on the top 8 of 30 layers, 16 rollouts a step, 4 updates per rollout batch, multi-turn BM25
search, LLDMonitor's after-step forward), run in its own process for ``--steps`` steps; sides
alternate A B A B for ``--rounds`` rounds. The first step of a run is a warm-up and is not counted;
per run, the median over its other steps of each phase the run logs (``time/*`` in metrics.csv:
rollout, log-probs, updates, monitor). Reported per side: medians over rounds with [min-max], and
the ratio on / off of the step and of each phase. Before each run the machine is waited on until
other processes use less than ``--quiet-threshold`` of a core (benchmarks/harness.py), and the load
average and the CPU's SIMD flags are recorded with the figures.

Both sides run the same seed, so they sample the same rollouts at step 1 and train on the same
tokens; the log-probs and gradients are equal (tests/test_frozen_prefix.py), so later steps match
too up to fp32 rounding.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if __package__:
    from . import harness
else:
    import harness

PHASES = ("rollout_s", "logprob_s", "frozen_prefix_s", "update_s", "lld_monitor_s")
SIDES = {"frozen-prefix": "true", "every-layer": "false"}
RECIPE = "lab/configs/real_lm.yaml"
ARM = "lab/configs/arms_real/grpo_2e-3.yaml"
POLICY = ".lldslight/demo_warmstart"  # the warm start (scripts/demo.sh makes it)


def fit_args(recipe: str, arm: str, policy: str, frozen_prefix: bool, steps: int, seed: int) -> list[str]:
    """The lab's run as ``lldslight fit`` arguments (after ``fit``): the recipe and an arm, the warm
    start, the step count and seed, ``model.update.frozen_prefix`` on or off. benchmarks/step.py's
    lab workload builds its lldslight side from the same arguments (in its own process, through
    the same CLI), so both benchmarks time the one recipe."""
    return ["--config", recipe, "--config", arm, "--trainer.max_steps", str(steps), "--seed_everything", str(seed),
            "--model.update.frozen_prefix", "true" if frozen_prefix else "false", "--model.policy.model", policy]


def cpu_flags() -> dict:
    """The CPU model and the SIMD flags that decide bf16's speed (recorded with every figure)."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    keep = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return {"model": model, "simd": keep, "cores": os.cpu_count()}


def one_run(side: str, args, work: Path, round_: int) -> dict:
    out = work / f"{side}_{round_}"
    cmd = [sys.executable, "-m", "lldslight.cli", "fit",
           *fit_args(args.recipe, args.arm, args.policy, SIDES[side] == "true", args.steps, args.seed),
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.version", "0"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = list(csv.DictReader(open(next(out.rglob("metrics.csv")))))
    per_step: dict[str, list[float]] = {p: [] for p in PHASES}
    for row in rows:
        if row.get("step") in (None, "") or int(float(row["step"])) < 1:  # step 0: warm-up
            continue
        for p in PHASES:
            value = row.get(f"time/{p}", "")
            if value not in ("", "nan"):
                per_step[p].append(float(value))
    medians = {p: statistics.median(v) for p, v in per_step.items() if v}
    # the step: rollout + the update's phases + the monitor (log-probs include the boundary's pass)
    medians["step_s"] = sum(medians.get(p, 0.0) for p in ("rollout_s", "logprob_s", "update_s", "lld_monitor_s"))
    return {"side": side, "round": round_, "load_before": load, "wall_s": wall, "steps_counted": len(per_step["update_s"]), **medians}


def summarise(runs: list[dict]) -> dict:
    keys = ["step_s", *[p for p in PHASES if any(p in r for r in runs)]]
    out: dict = {"sides": {}, "ratio_on_off": {}}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        out["sides"][side] = {k: {"median": statistics.median(r[k] for r in mine), "min": min(r[k] for r in mine),
                                  "max": max(r[k] for r in mine)} for k in keys if all(k in r for r in mine)}
    for k in keys:
        on, off = out["sides"]["frozen-prefix"].get(k), out["sides"]["every-layer"].get(k)
        if on and off and off["median"] > 1e-3:  # a phase one side does not run (the boundary pass) has no ratio
            rounds = sorted({r["round"] for r in runs})
            per_round = []
            for i in rounds:
                a = [r[k] for r in runs if r["round"] == i and r["side"] == "frozen-prefix" and k in r]
                b = [r[k] for r in runs if r["round"] == i and r["side"] == "every-layer" and k in r]
                if a and b and b[0] > 0:
                    per_round.append(a[0] / b[0])
            out["ratio_on_off"][k] = {"ratio_of_medians": on["median"] / off["median"], "per_round": per_round}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=RECIPE)
    p.add_argument("--arm", default=ARM)
    p.add_argument("--policy", default=POLICY, help="the warm start (scripts/demo.sh makes it)")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is a warm-up")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=99, help="a seed no lab set uses")
    p.add_argument("--quiet-threshold", type=float, default=harness.QUIET_THRESHOLD)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not (ROOT / args.policy).exists():
        print(f"lab_step: no warm start at {args.policy}: run scripts/demo.sh once (it makes it)", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory(prefix="lldslight-lab-step-") as tmp:
        for i in range(args.rounds):
            for side in SIDES:
                quiet = harness.wait_for_quiet(args.quiet_threshold, timeout_s=600)
                run = one_run(side, args, Path(tmp), i)
                run["quiet_before"] = quiet
                runs.append(run)
                print(f"round {i} {side:13s} step {run['step_s']:.2f}s  update {run.get('update_s', float('nan')):.2f}s  "
                      f"load {run['load_before']:.2f}", flush=True)
    result = {"command": " ".join(["python", "benchmarks/lab_step.py", *(argv if argv is not None else sys.argv[1:])]),
              "recipe": args.recipe, "arm": args.arm, "threads": args.threads, "steps": args.steps,
              "cpu": cpu_flags(), "torch": __import__("torch").__version__, "runs": runs, **summarise(runs)}
    print(f"\n{'phase':18s} {'frozen-prefix':>22s} {'every-layer':>22s} {'on/off':>8s}  per round")
    for k, ratio in result["ratio_on_off"].items():
        a, b = result["sides"]["frozen-prefix"][k], result["sides"]["every-layer"][k]
        print(f"{k:18s} {a['median']:8.2f} [{a['min']:.2f}-{a['max']:.2f}] {b['median']:8.2f} [{b['min']:.2f}-{b['max']:.2f}] "
              f"{ratio['ratio_of_medians']:8.2f}  {', '.join(f'{x:.2f}' for x in ratio['per_round'])}")
    print(f"CPU: {result['cpu']['model']}; {' '.join(result['cpu']['simd'])}; {args.threads} thread(s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
