"""GRPO vs GRPO+LLDS from the same seed and data on the synthetic task: does vanilla GRPO show lazy
likelihood displacement, and does LLDS prevent it? (PAPER.md §3-4)

    .venv/bin/python benchmarks/collapse.py --parallel      # full run: 100 steps per arm, arms side by side (~1 h)
    .venv/bin/python benchmarks/collapse.py --smoke         # 3 steps of a tiny model per arm (~2-4 min)
    .venv/bin/python benchmarks/collapse.py --report-only   # redo table and figure from finished runs

First a supervised warm start (`lldslight sft`, see WARM_START; cached in OUT/warmstart) that both
arms start from. Each arm is then one `lldslight fit` (a child process) of the recipe composed with
the arm's config:
    grpo: RECIPE + configs/grpo.yaml      llds: RECIPE + configs/llds.yaml
(RECIPE = benchmarks/collapse.yaml, or benchmarks/collapse_smoke.yaml with --smoke), with the same
seed_everything and data seed. Both record lld/* diagnostics (LLDMonitor is in the recipe).

Output in OUT (default runs/collapse[_smoke]): OUT/<arm>/version_0/ (metrics.csv, lld.png,
summary.json, config.yaml), OUT/<arm>.log, and the comparison: collapse.png (overlaid diagnostics),
collapse.md (table) and collapse.json. Table columns: dev EM before -> after training (greedy, the
recipe's dev split); the minimum per-step log-prob of correct (A>0) responses and its step; Delta,
the per-step change of correct responses' log-prob caused by the step's own updates (mean, and the
number of steps where it was negative = LLD seen directly); steps with a vetoed update
(train/vetoed_updates > 0) or an exploding gradient (pre-clip grad norm non-finite or above
--explode-factor x the run's median over steps with a positive-advantage response) and the
largest pre-clip grad norm; the step of the first LLD early warning; the mean
train reward of the last 5 steps; wall time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lldslight.plots import plot_runs, read_run  # noqa: E402

ARMS = {"grpo": ("GRPO", "configs/grpo.yaml"), "llds": ("GRPO+LLDS", "configs/llds.yaml")}
RECIPES = {"full": "benchmarks/collapse.yaml", "smoke": "benchmarks/collapse_smoke.yaml"}


# --------------------------------------------------------------------------- running the arms


def fit_command(arm: str, recipe: str, out: Path, seed: int, steps: Optional[int], extra_configs: list[str], overrides: list[str]) -> list[str]:
    """The `lldslight fit` command line of one arm (configs compose left to right)."""
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", recipe, "--config", ARMS[arm][1]]
    for config in extra_configs:
        cmd += ["--config", config]
    cmd += [
        "--seed_everything", str(seed),
        "--data.seed", str(seed),
        "--trainer.logger.init_args.save_dir", str(out),
        "--trainer.logger.init_args.name", arm,
        "--trainer.logger.init_args.version", "0",
    ]
    if steps is not None:
        cmd += ["--trainer.max_steps", str(steps)]
    return cmd + overrides


_RUNNING: set[subprocess.Popen] = set()  # every live child, so an interrupt can stop them all


def _kill_children() -> None:
    for proc in list(_RUNNING):
        proc.kill()


def _stop_children(*_) -> None:
    _kill_children()
    sys.exit(143)


def run_arm(arm: str, cmd: list[str], out: Path, threads: Optional[int] = None) -> float:
    """Run one arm, its output teed to OUT/<arm>.log; the run's own [lldslight] lines are echoed."""
    log_path = out / f"{arm}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    print(f"\n=== {ARMS.get(arm, (arm,))[0]}: {' '.join(cmd[1:])}\n    log: {log_path}", flush=True)
    t0 = time.perf_counter()
    tail: list[str] = []
    with open(log_path, "w") as log, subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        _RUNNING.add(proc)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()  # the log is what one watches during an hour-long run
                tail = (tail + [line])[-40:]
                if line.startswith("[lldslight]") or "Error" in line:
                    print(f"    {arm}| " + line.rstrip(), flush=True)
            code = proc.wait()
        finally:
            _RUNNING.discard(proc)
            if proc.poll() is None:  # interrupted: never leave an orphaned training run behind
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        sys.stdout.write("".join(tail))
        raise SystemExit(f"collapse: arm {arm!r} failed (exit {code}); full log: {log_path}")
    print(f"    done in {wall / 60:.1f} min", flush=True)
    return wall


# The supervised warm start both arms begin from (lldslight/sft.py): SmolLM2-135M-Instruct never
# writes <search>/<answer> by itself, so without it EM is 0 for every rollout and GRPO has no signal.
# Gold trajectories of the first 128 training questions, laid out exactly as the recipe's rollouts
# (one search, top-1 passage, observations cut at 96 tokens); 1 epoch, LoRA r=16 merged after.
# --over-budget truncate --keep-unanswerable: 2-hop and comparison questions are kept with their first search only, so the
# model learns to guess where one search cannot tell (measured: trained on answerable 1-hop
# trajectories alone, it answered deterministically, entropy 0.008 nats/token at T=1, and every
# GRPO group was all right or all wrong: no signal).
WARM_START = {
    "full": ["--limit", "128", "--topk", "1", "--max-obs-tokens", "96", "--max-searches", "1", "--over-budget", "truncate",
             "--keep-unanswerable", "--epochs", "1", "--lr", "5e-4"],
    # the smoke recipe's random 2-layer model, every weight trained (LoRA alone cannot move it)
    "smoke": ["--limit", "16", "--topk", "1", "--max-obs-tokens", "32", "--max-searches", "1", "--over-budget", "truncate",
              "--keep-unanswerable", "--epochs", "1", "--lr", "3e-3", "--lora-r", "0"],
}


def prepare_warm_start(recipe: str, out: Path, sft_args: list[str]) -> Path:
    """Synthesise the recipe's knowledge base and run ``lldslight sft`` on it (skipped when OUT/warmstart
    already holds the same warm start); returns the model directory."""
    import yaml

    from lldslight.data.synth import synthesize

    config = yaml.safe_load((ROOT / recipe).read_text())
    synth = dict(config["data"]["synthesize"])
    synthesize(**synth)
    kb = ROOT / synth["out_dir"]
    model_dir = out / "warmstart"
    policy = config["model"]["policy"]
    cmd = [sys.executable, "-m", "lldslight.cli", "sft", "--data", str(kb / "train.jsonl"), "--corpus", str(kb / "corpus.jsonl"),
           "--model", policy["model"], "--out", str(model_dir), *sft_args]
    if policy.get("random_init"):
        cmd += ["--random-init", json.dumps(policy["random_init"])]
    run_arm("warmstart", cmd, out)
    return model_dir


# --------------------------------------------------------------------------- summarising


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def summarise_run(run_dir: Path, explode_factor: float = 5.0) -> dict:
    """The comparison numbers of one finished run (see the module docstring for definitions)."""
    frame = read_run(run_dir)
    summary_json = run_dir / "summary.json"
    summary = json.loads(summary_json.read_text()) if summary_json.exists() else {}

    def dev_em(when: str) -> Optional[float]:
        column = f"val_{when}/em"
        if column in frame.columns and frame[column].notna().any():
            return float(frame[column].dropna().iloc[-1])
        overall = summary.get(f"dev_{when}") or {}
        return overall.get("em")

    out: dict = {"run_dir": str(run_dir), "dev_em_before": dev_em("before"), "dev_em_after": dev_em("after")}
    frame = frame[frame["train/reward"].notna()]  # training steps only (evaluation rows logged apart)
    out["steps"] = int(len(frame))
    logp = frame["lld/logp_pos"].dropna()
    out["logp_pos_first"] = float(logp.iloc[0]) if len(logp) else None
    out["logp_pos_last"] = float(logp.iloc[-1]) if len(logp) else None
    out["logp_pos_min"] = float(logp.min()) if len(logp) else None
    out["logp_pos_min_step"] = int(logp.idxmin()) if len(logp) else None
    delta = frame["lld/delta_correct"].dropna() if "lld/delta_correct" in frame.columns else frame.iloc[:0, 0]
    out["signal_steps"] = int((frame["lld/n_pos"].fillna(0) > 0).sum()) if "lld/n_pos" in frame.columns else int(logp.notna().sum())
    out["delta_correct_mean"] = float(delta.mean()) if len(delta) else None
    out["delta_correct_negative_steps"] = int((delta < 0).sum())
    out["delta_correct_measured_steps"] = int(len(delta))
    # Trend, first vs last third of the run: a slow decay hides in per-step noise at this batch size.
    third = max(1, len(frame) // 3)
    for name, column in (("logp_pos", "lld/logp_pos"), ("logp_neg", "lld/logp_neg"), ("entropy", "train/entropy"),
                         ("delta_correct", "lld/delta_correct"), ("reward", "train/reward")):
        values = frame[column] if column in frame.columns else frame.iloc[:0, 0]
        head, tail = _finite(values.iloc[:third]), _finite(values.iloc[-third:])
        out[f"{name}_first_third"] = sum(head) / len(head) if head else None
        out[f"{name}_last_third"] = sum(tail) / len(tail) if tail else None

    grad = frame["train/grad_norm"]
    grad_max = frame["train/grad_norm_max"] if "train/grad_norm_max" in frame.columns else grad
    # The median over steps with a GRPO signal (a response with A>0): where every group tied, the
    # gradient is 0 (GRPO) or only the small LLDS pull, which would drag the median down and make
    # every ordinary step look "exploding".
    signal = frame["lld/n_pos"].fillna(0) > 0 if "lld/n_pos" in frame.columns else grad > 0
    finite = [g for g in _finite(grad_max[signal]) if g > 0]  # like with like: per-step max over updates
    median = sorted(finite)[len(finite) // 2] if finite else float("nan")
    exploding = [(not math.isfinite(g)) or g > explode_factor * median for g in grad_max.fillna(float("inf"))]
    vetoed = (frame["train/vetoed_updates"].fillna(0) > 0).tolist() if "train/vetoed_updates" in frame.columns else [False] * len(frame)
    out["grad_norm_median"] = median
    peak = grad_max.dropna()
    out["grad_norm_peak"] = float(peak.max()) if len(peak) else None
    out["grad_norm_peak_step"] = int(peak.idxmax()) if len(peak) else None
    out["exploding_steps"] = int(sum(exploding))
    out["vetoed_steps"] = int(sum(vetoed))
    out["vetoed_or_exploding_steps"] = int(sum(e or v for e, v in zip(exploding, vetoed)))
    warnings = frame.index[frame["lld/warning"].fillna(0) > 0].tolist() if "lld/warning" in frame.columns else []
    out["first_warning_step"] = int(warnings[0]) if warnings else None
    phases = frame["lld/phase"].dropna() if "lld/phase" in frame.columns else []
    out["final_phase"] = int(phases.iloc[-1]) if len(phases) else None
    out["steps_in_decay"] = int((phases == 2).sum()) if len(phases) else 0
    out["steps_in_acceleration"] = int((phases == 3).sum()) if len(phases) else 0
    reward = frame["train/reward"].dropna()
    out["train_reward_last5"] = float(reward.iloc[-5:].mean()) if len(reward) else None
    out["wall_time_s"] = summary.get("wall_time_s")
    return out


def _fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def table(results: dict[str, dict]) -> str:
    """The comparison as a markdown table, one row per arm."""
    header = (
        "| arm | dev EM before -> after | min log-prob of correct (step) | Delta correct: mean (neg. steps / measured) "
        "| steps vetoed or exploding | peak grad norm (step) | first LLD warning | train reward (last 5) | wall |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for arm, r in results.items():
        minimum = f"{_fmt(r['logp_pos_min'])} ({r['logp_pos_min_step']})" if r["logp_pos_min"] is not None else "n/a"
        delta = f"{_fmt(r['delta_correct_mean'], '+.4f')} ({r['delta_correct_negative_steps']} / {r['delta_correct_measured_steps']})"
        wall = f"{r['wall_time_s'] / 60:.0f} min" if r.get("wall_time_s") else "n/a"
        warning = "none" if r["first_warning_step"] is None else f"step {r['first_warning_step']}"
        rows.append(
            f"| {ARMS[arm][0]} | {_fmt(r['dev_em_before'])} -> {_fmt(r['dev_em_after'])} | {minimum} | {delta} "
            f"| {r['vetoed_or_exploding_steps']} of {r['steps']} | {_fmt(r.get('grad_norm_peak'), '.2f')} ({r.get('grad_norm_peak_step')}) | {warning} | {_fmt(r['train_reward_last5'])} | {wall} |"
        )
    trend = (
        "\n| arm | log-prob correct (A>0) | log-prob incorrect (A<0) | Delta correct | entropy | train reward |\n"
        "|---|---|---|---|---|---|\n"
    )
    for arm, r in results.items():
        cells = [f"{_fmt(r.get(f'{n}_first_third'))} -> {_fmt(r.get(f'{n}_last_third'))}"
                 for n in ("logp_pos", "logp_neg", "delta_correct", "entropy", "reward")]
        trend += f"| {ARMS[arm][0]} | " + " | ".join(cells) + " |\n"
    return header + "\n".join(rows) + "\n" + "\nMeans over the first third -> the last third of the training steps:\n" + trend


def report(out: Path, arms: list[str], explode_factor: float, smooth: int, meta: dict) -> dict:
    """Write collapse.png, collapse.md and collapse.json for the finished arms in ``out``."""
    run_dirs = [out / arm / "version_0" for arm in arms]
    results = {arm: summarise_run(d, explode_factor) for arm, d in zip(arms, run_dirs)}
    figure = plot_runs(
        run_dirs, out / "collapse.png", labels=[ARMS[a][0] for a in arms], smooth=smooth,
        title="GRPO vs GRPO+LLDS, same seed and data",
    )
    text = table(results)
    silent = [ARMS[a][0] for a, r in results.items() if r["signal_steps"] == 0]
    if silent:
        text += (
            f"\nNO LEARNING SIGNAL in {', '.join(silent)}: no step had a response with positive advantage "
            "(every group's rewards were equal), so GRPO did nothing and LLD cannot show. The policy never "
            "earned reward: use a model that follows the <search>/<answer> format (or warm-start it) first.\n"
        )
    (out / "collapse.md").write_text(
        "# GRPO vs GRPO+LLDS (benchmarks/collapse.py)\n\n" + text
        + f"\nExploding = pre-clip grad norm non-finite or > {explode_factor:g}x the run's median over steps with a "
        "response of positive advantage. Figure: collapse.png\n"
    )
    payload = {"meta": meta, "explode_factor": explode_factor, "arms": results, "figure": str(figure)}
    (out / "collapse.json").write_text(json.dumps(payload, indent=2))
    print("\n" + text + f"\nfigure: {figure}\ntable:  {out / 'collapse.md'}\njson:   {out / 'collapse.json'}", flush=True)
    return payload


# --------------------------------------------------------------------------- command line


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Arguments after `--` go to every `lldslight fit`.")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 3 steps per arm: proves the pipeline")
    parser.add_argument("--recipe", default=None, help="base config (default benchmarks/collapse.yaml, or collapse_smoke.yaml with --smoke)")
    parser.add_argument("--out", default=None, help="output directory (default runs/collapse or runs/collapse_smoke)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and data seed, the same for every arm")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--config", dest="extra_configs", action="append", default=[], help="extra config composed after the arm's (repeatable), e.g. configs/guard.yaml")
    parser.add_argument("--explode-factor", type=float, default=5.0)
    parser.add_argument("--smooth", type=int, default=None, help="rolling mean in the figure (default 3, 1 with --smoke)")
    parser.add_argument("--report-only", action="store_true", help="only redo the table and figure from OUT")
    parser.add_argument("--force", action="store_true", help="delete an arm's previous output in OUT first")
    parser.add_argument("--parallel", action="store_true", help="run the arms at the same time, one thread each")
    parser.add_argument("--no-warm-start", action="store_true", help="start RL from the recipe's model as is (no supervised warm start)")
    args, overrides = parser.parse_known_args(argv)
    # SIGTERM (e.g. a scheduler's kill) unwinds like Ctrl-C, so the running arm is stopped too.
    signal.signal(signal.SIGTERM, _stop_children)
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]
    recipe = args.recipe or RECIPES["smoke" if args.smoke else "full"]
    out = (ROOT / (args.out or ("runs/collapse_smoke" if args.smoke else "runs/collapse"))).resolve()
    smooth = args.smooth or (1 if args.smoke else 3)
    for path in [recipe] + [ARMS[a][1] for a in args.arms] + args.extra_configs:
        if not (ROOT / path).is_file():
            raise SystemExit(f"collapse: config not found: {path} (relative to {ROOT})")
    warm_start = None if args.no_warm_start else WARM_START["smoke" if args.smoke else "full"]
    meta = {"recipe": recipe, "warm_start": warm_start, "seed": args.seed, "steps": args.steps, "extra_configs": args.extra_configs, "overrides": overrides, "arms": {}}
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "collapse.json"
    if args.report_only and previous.is_file():
        meta = json.loads(previous.read_text()).get("meta", meta)  # keep the commands and wall times of the run
    if not args.report_only:
        for arm in args.arms:
            previous = out / arm
            if previous.exists():
                if not args.force:
                    raise SystemExit(f"collapse: {previous} exists; pass --force to redo it or --report-only to reuse it")
                shutil.rmtree(previous)
        if warm_start is not None:
            # the warm-started weights replace the recipe's model (and its random init, in the smoke run)
            model_dir = prepare_warm_start(recipe, out, warm_start)
            overrides = ["--model.policy.model", str(model_dir), "--model.policy.random_init", "null"] + overrides
        commands = {arm: fit_command(arm, recipe, out, args.seed, args.steps, args.extra_configs, overrides) for arm in args.arms}
        if args.parallel:
            # Side by side, one core each: the arms see the same machine load, and on 2 cores the
            # pair finishes sooner than one after the other with 2 threads each.
            pool = ThreadPoolExecutor(len(commands))
            futures = {arm: pool.submit(run_arm, arm, cmd, out, 1) for arm, cmd in commands.items()}
            try:
                while not all(f.done() for f in futures.values()):
                    time.sleep(1.0)  # a bounded wait, so Ctrl-C and SIGTERM reach this thread
                walls = {arm: f.result() for arm, f in futures.items()}
            finally:
                _kill_children()
                pool.shutdown(wait=False)
        else:
            walls = {arm: run_arm(arm, cmd, out) for arm, cmd in commands.items()}
        for arm, cmd in commands.items():
            meta["arms"][arm] = {"command": " ".join(cmd[1:]), "wall_s": walls[arm], "parallel": args.parallel}
    report(out, args.arms, args.explode_factor, smooth, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
