"""The collapse lab: N seeds x arms of `lldslight fit` side by side, then per run whether and when GRPO
collapsed, how early LLDMonitor warned, and what LLDS changed (docs/collapse_lab.md).

    python benchmarks/collapse.py                         # 3 seeds x 3 arms, 2 runs at a time, one thread each
    python benchmarks/collapse.py --recipe configs/lab/base.yaml --lab-policy --config configs/lab/schedule.yaml
    python benchmarks/collapse.py --smoke                 # a tiny model, 1 seed x 3 arms, a few minutes
    python benchmarks/collapse.py --report-only           # redo collapse.{json,md,png} from finished runs

Each run is one `lldslight fit` child process (one thread; ``--jobs`` of them at a time) of the
recipe composed with its arm's config, with ``seed_everything`` and the data seed set to the seed:
    grpo: RECIPE + configs/grpo.yaml    llds: RECIPE + configs/llds.yaml (action gate)
    llds_response: RECIPE + configs/llds_response.yaml
RECIPE is ``--recipe`` (default benchmarks/collapse.yaml; benchmarks/collapse_smoke.yaml with
--smoke); it must log LLDMonitor's lld/* columns (have the LLDMonitor callback). Unless
``--no-warm-start`` or ``--lab-policy``, every run starts from one supervised warm start (`lldslight
sft`, WARM_START or ``--sft-args``; cached in OUT/warmstart) that replaces the recipe's model;
``--lab-policy`` builds the collapse lab's own small policy instead (benchmarks/lab/make_policy.py).

A run COLLAPSED (the lab's criteria; ``Criteria`` holds the numbers) when LLDMonitor's phase
detector was in decay (lld/phase >= 2: steady decay or the acceleration that follows it) for
``decay_steps`` (10) consecutive measured steps (steps with a finite lld/logp_pos; unmeasured steps
in between neither count nor break the run), and, from that decay's first step on, either
- the reward fell: its trailing mean over ``reward_smooth`` (20) steps (a lab step's reward is a
  mean of 32 rollouts: noisy) stayed <= ``fall_fraction``
  (0.5) x its running peak for ``fall_steps`` (10) consecutive steps (the fall's step is the first
  of them), or
- the gradient exploded: a step the GradientSpikeGuard would veto, i.e. its largest pre-clip grad
  norm (train/grad_norm_max) is non-finite or > ``explode_factor`` (10) x the median of the per-step
  mean norms (train/grad_norm) of the previous ``explode_window`` (50) steps with a non-zero
  gradient and no explosion, once ``explode_warmup`` (10) such steps are in; a step with a vetoed
  update (train/vetoed_updates > 0, when the guard is on) counts too.
The collapse step is the first such event; ``collapsed_by_fall`` says whether the reward fell
(a lone gradient spike after a decay, reward intact, meets the letter of the criteria only). Lead time = collapse step - the first lld/warning (the
detector entering acceleration; negative = it came late; none = missed). False alarms = warnings
in runs that did not collapse. The mechanism check: steps with Delta < 0 (lld/delta_correct, the
step's own updates lowered the likelihood of its correct responses) before the collapse (or the
end), out of the steps where Delta was measured, and over the ``delta_window`` (100) steps before
the collapse vs the steps before those (is the displacement concentrated before the fall?).

Output in OUT (default runs/collapse[_smoke]): OUT/<arm>/seed<S>/version_0/ (metrics.csv, lld.png,
summary.json), OUT/logs/<arm>_seed<S>.log, and collapse.json (every run, every number, the commands,
the machine), collapse.md (one row per run; per arm: collapses out of N, mean final dev EM, mean
lead time, false alarms) and collapse.png (arms side by side: reward, correct-response log-prob
and grad norm, one colour per seed, decay / acceleration strips, warnings dotted, collapses solid).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lldslight.plots import PHASE_COLOURS, phase_spans, read_run  # noqa: E402

ARMS = {
    "grpo": ("GRPO", "configs/grpo.yaml"),
    "llds": ("LLDS action gate", "configs/llds.yaml"),
    "llds_response": ("LLDS response gate", "configs/llds_response.yaml"),
}
RECIPES = {"full": "benchmarks/collapse.yaml", "smoke": "benchmarks/collapse_smoke.yaml"}


@dataclass
class Criteria:
    """The numbers of the collapse criteria (see the module docstring)."""

    decay_steps: int = 10
    reward_smooth: int = 20
    fall_fraction: float = 0.5
    fall_steps: int = 10
    explode_factor: float = 10.0
    explode_window: int = 50
    explode_warmup: int = 10
    delta_window: int = 100


# --------------------------------------------------------------------------- detection (pure)


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def decay_run(steps: Sequence[int], phase: Sequence[float], measured: Sequence[bool], min_steps: int) -> Optional[tuple[int, int]]:
    """(first step, confirming step) of the first run of ``min_steps`` consecutive measured steps in
    decay (phase >= 2), skipping unmeasured steps; None if there is none."""
    start, count = None, 0
    for step, p, m in zip(steps, phase, measured):
        if not m:
            continue
        if _finite(p) and p >= 2:
            start = step if count == 0 else start
            count += 1
            if count == min_steps:
                return start, step
        else:
            count = 0
    return None


def smoothed_reward(reward: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (NaN until ``window`` values are in; NaNs skipped)."""
    out = []
    for i in range(len(reward)):
        values = [r for r in reward[max(0, i - window + 1) : i + 1] if _finite(r)]
        out.append(sum(values) / len(values) if i + 1 >= window and values else float("nan"))
    return out


def reward_fall(steps: Sequence[int], reward: Sequence[float], crit: Criteria, after: Optional[int] = None) -> Optional[int]:
    """The first step (>= ``after``) that starts ``fall_steps`` consecutive steps whose smoothed
    reward is <= ``fall_fraction`` x its running peak (a positive peak); None if none."""
    smooth = smoothed_reward(reward, crit.reward_smooth)
    peak, below = float("-inf"), []
    for r in smooth:
        if _finite(r):
            peak = max(peak, r)
        low = _finite(r) and peak > 0 and r <= crit.fall_fraction * peak
        below.append(low)
    for i in range(len(steps) - crit.fall_steps + 1):
        if (after is None or steps[i] >= after) and all(below[i : i + crit.fall_steps]):
            return steps[i]
    return None


def explosions(steps: Sequence[int], grad_mean: Sequence[float], grad_max: Sequence[float], vetoed: Sequence[float], crit: Criteria) -> list[int]:
    """Steps the gradient-spike guard would veto (see the module docstring)."""
    history: list[float] = []
    out = []
    for step, mean, peak, veto in zip(steps, grad_mean, grad_max, vetoed):
        median = statistics.median(history[-crit.explode_window :]) if len(history) >= crit.explode_warmup else None
        exploded = (_finite(veto) and veto > 0) or not _finite(peak) or (median is not None and peak > crit.explode_factor * median)
        if exploded:
            out.append(step)
        elif _finite(mean) and mean > 0:
            history.append(mean)
    return out


def replay_phases(frame, phases: dict):
    """``frame`` with lld/phase and lld/warning recomputed by LLDMonitor's detector under other
    PhaseConfig settings, fed exactly what the monitor fed it each step (lld/logp_pos, NaN when
    unmeasured; train/grad_norm; train/entropy): judges runs logged with other settings alike."""
    from lldslight.diagnostics import PhaseConfig, PhaseDetector

    detector = PhaseDetector(PhaseConfig(**phases))
    nan = [float("nan")] * len(frame)
    signal, grad, entropy = (frame[c].tolist() if c in frame.columns else nan for c in ("lld/logp_pos", "train/grad_norm", "train/entropy"))
    updates = [detector.update(float(x), float(g), float(e)) for x, g, e in zip(signal, grad, entropy)]
    frame = frame.copy()
    frame["lld/phase"] = [float(u.phase) for u in updates]
    frame["lld/warning"] = [float(u.warning) for u in updates]
    return frame


def delta_share(delta: list[tuple[int, float]], start: float, end: float) -> dict:
    """Steps with Delta < 0, steps measured and mean Delta over training steps in [start, end)."""
    values = [d for s, d in delta if start <= s < end]
    return {"negative": sum(d < 0 for d in values), "measured": len(values), "mean": sum(values) / len(values) if values else None}


def detect(frame, crit: Criteria) -> dict:
    """The collapse events of one run's per-step metrics (a read_run frame of training steps)."""
    steps = [int(s) for s in frame.index]

    def column(name: str, default: float = float("nan")) -> list[float]:
        return [float(v) for v in frame[name]] if name in frame.columns else [default] * len(steps)

    measured = [_finite(v) for v in column("lld/logp_pos")]
    decay = decay_run(steps, column("lld/phase"), measured, crit.decay_steps)
    grad_max = column("train/grad_norm_max" if "train/grad_norm_max" in frame.columns else "train/grad_norm")
    exploded = explosions(steps, column("train/grad_norm"), grad_max, column("train/vetoed_updates", 0.0), crit)
    out = {
        "decay_start": decay[0] if decay else None,
        "decay_confirmed": decay[1] if decay else None,
        "reward_fall_any": reward_fall(steps, column("train/reward"), crit),
        "explosion_steps": exploded,
        "reward_fall": None,
        "explosion": None,
    }
    if decay:
        out["reward_fall"] = reward_fall(steps, column("train/reward"), crit, after=decay[0])
        out["explosion"] = next((s for s in exploded if s >= decay[0]), None)
    events = [(s, cause) for s, cause in ((out["reward_fall"], "reward fall"), (out["explosion"], "gradient explosion")) if s is not None]
    out["collapsed"] = bool(events)
    out["collapse_step"], out["collapse_cause"] = min(events) if events else (None, None)
    # Strict: the reward itself fell after the decay. A lone gradient spike after a decay meets the
    # letter of the criteria, but a run whose reward never fell did not collapse in the paper's sense.
    out["collapsed_by_fall"] = out["reward_fall"] is not None
    warnings = [s for s, w in zip(steps, column("lld/warning", 0.0)) if _finite(w) and w > 0]
    out["warnings"] = warnings
    out["first_warning"] = warnings[0] if warnings else None
    out["lead_time"] = out["collapse_step"] - warnings[0] if out["collapsed"] and warnings else None
    out["false_alarms"] = 0 if out["collapsed"] else len(warnings)
    end = out["collapse_step"] if out["collapsed"] else steps[-1] + 1 if steps else 0
    delta = [(s, d) for s, d in zip(steps, column("lld/delta_correct")) if _finite(d)]
    before = delta_share(delta, -math.inf, end)
    out["delta_negative_before"], out["delta_measured_before"] = before["negative"], before["measured"]
    # Concentration (docs/algorithm.md §3: the displacement builds up before the fall): Delta over the
    # ``delta_window`` steps before the reference step vs over the steps before those. Reference:
    # the collapse, else a reward fall without decay, else the end of the run.
    reference = out["collapse_step"] if out["collapsed"] else out["reward_fall_any"] if out["reward_fall_any"] is not None else end
    out["delta_reference"] = reference
    out["delta_window"] = delta_share(delta, reference - crit.delta_window, reference)
    out["delta_earlier"] = delta_share(delta, -math.inf, reference - crit.delta_window)
    return out


# --------------------------------------------------------------------------- one run's numbers


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed{seed}" / "version_0"


def summarise_run(path: Path, crit: Criteria, phases: Optional[dict] = None) -> dict:
    """Every number of one finished run: collapse events (``detect``; with ``phases``, on the phase
    detector replayed with those PhaseConfig settings), dev EM, trends, wall time."""
    frame = read_run(path)
    summary_json = path / "summary.json"
    summary = json.loads(summary_json.read_text()) if summary_json.exists() else {}

    def dev_em(when: str) -> Optional[float]:
        column = f"val_{when}/em"
        if column in frame.columns and frame[column].notna().any():
            return float(frame[column].dropna().iloc[-1])
        return (summary.get(f"dev_{when}") or {}).get("em")

    result: dict = {"run_dir": str(path), "dev_em_before": dev_em("before"), "dev_em_after": dev_em("after")}
    frame = frame[frame["train/reward"].notna()]  # training steps only (evaluation rows are logged apart)
    result["steps"] = int(len(frame))
    result["signal_steps"] = int((frame["lld/n_pos"].fillna(0) > 0).sum()) if "lld/n_pos" in frame.columns else int(frame["lld/logp_pos"].notna().sum())
    result.update(detect(replay_phases(frame, phases) if phases else frame, crit))
    third = max(1, len(frame) // 3)
    for name, col in (("reward", "train/reward"), ("logp_pos", "lld/logp_pos"), ("entropy", "train/entropy"),
                      ("zero_var_groups", "train/zero_var_groups"), ("gate_open_actions", "lld/gate_open_actions")):
        values = frame[col] if col in frame.columns else frame["train/reward"].iloc[:0]
        head, tail = values.iloc[:third].dropna(), values.iloc[-third:].dropna()
        result[f"{name}_first_third"] = float(head.mean()) if len(head) else None
        result[f"{name}_last_third"] = float(tail.mean()) if len(tail) else None
    peak = frame["train/grad_norm_max"] if "train/grad_norm_max" in frame.columns else frame["train/grad_norm"]
    result["grad_norm_peak"] = float(peak.max()) if peak.notna().any() else None
    result["wall_time_s"] = summary.get("wall_time_s")
    return result


def _mean(values) -> Optional[float]:
    values = [v for v in values if _finite(v)]
    return sum(values) / len(values) if values else None


def per_arm(runs: list[dict]) -> dict[str, dict]:
    """Collapses out of N, mean final dev EM, mean lead time, false alarms, per arm."""
    out: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm and "error" not in r]
        out[arm] = {
            "runs": len(mine),
            "failed": sum(1 for r in runs if r["arm"] == arm and "error" in r),
            "collapses": sum(r["collapsed"] for r in mine),
            "mean_dev_em_after": _mean(r["dev_em_after"] for r in mine),
            "mean_lead_time": _mean(r["lead_time"] for r in mine),
            "warned_collapses": sum(1 for r in mine if r["collapsed"] and r["first_warning"] is not None and r["lead_time"] >= 0),
            "false_alarm_runs": sum(1 for r in mine if r["false_alarms"] > 0),
            "false_alarms": sum(r["false_alarms"] for r in mine),
        }
    return out


# --------------------------------------------------------------------------- report


def _fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def table(runs: list[dict], arms: dict[str, dict]) -> str:
    lines = [
        "| arm | seed | collapsed (cause) | decay: start, 10th step | reward fall | first explosion | first warning | lead (steps) "
        "| false alarms | Delta<0 before collapse / measured | dev EM before -> after | steps | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        name = ARMS.get(r["arm"], (r["arm"],))[0]
        if "error" in r:
            lines.append(f"| {name} | {r['seed']} | FAILED: {r['error']} |" + " |" * 10)
            continue
        collapsed = f"yes, step {r['collapse_step']} ({r['collapse_cause']})" if r["collapsed"] else "no"
        decay = f"{r['decay_start']}, {r['decay_confirmed']}" if r["decay_start"] is not None else "none"
        fall = r["reward_fall"] if r["reward_fall"] is not None else (f"none ({r['reward_fall_any']} without decay)" if r["reward_fall_any"] is not None else "none")
        boom = r["explosion_steps"][0] if r["explosion_steps"] else "none"
        wall = f"{r['wall_s'] / 60:.0f} min" if _finite(r.get("wall_s")) else "n/a"
        lines.append(
            f"| {name} | {r['seed']} | {collapsed} | {decay} | {fall} | {boom} | {_fmt(r['first_warning'], 'd') if r['first_warning'] is not None else 'none'} "
            f"| {_fmt(r['lead_time'], 'd') if r['lead_time'] is not None else 'n/a'} | {r['false_alarms']} "
            f"| {r['delta_negative_before']} / {r['delta_measured_before']} | {_fmt(r['dev_em_before'])} -> {_fmt(r['dev_em_after'])} "
            f"| {r['steps']} | {wall} |"
        )
    lines += ["", "| arm | collapses | mean dev EM after | mean lead time (steps) | collapses warned in time | runs with false alarms |", "|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        failed = f" ({a['failed']} failed)" if a["failed"] else ""
        lines.append(
            f"| {ARMS.get(arm, (arm,))[0]} | {a['collapses']} of {a['runs']}{failed} | {_fmt(a['mean_dev_em_after'])} "
            f"| {_fmt(a['mean_lead_time'], '.1f')} | {a['warned_collapses']} of {a['collapses']} | {a['false_alarm_runs']} of {a['runs'] - a['collapses']} |"
        )
    return "\n".join(lines) + "\n"


def figure(runs: list[dict], crit: Criteria, path: Path) -> Path:
    """Arms side by side (columns); reward (trailing mean), correct-response log-prob, grad norm (rows);
    one colour per seed; decay / acceleration strips per seed; warnings dotted, collapses solid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    arms = list(dict.fromkeys(r["arm"] for r in runs))
    seeds = sorted({r["seed"] for r in runs})
    rows = [("train reward\n(trailing mean)", "train/reward"), ("log-prob / token of\ncorrect (A>0), pi_old", "lld/logp_pos"), ("grad norm (pre-clip,\nmax over updates)", "train/grad_norm_max")]
    fig, axes = plt.subplots(len(rows), len(arms), figsize=(4.2 * len(arms) + 0.8, 7.5), sharex=True, sharey="row", squeeze=False, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, arm in enumerate(arms):
        axes[0][j].set_title(ARMS.get(arm, (arm,))[0], fontsize=10)
        for r in (r for r in runs if r["arm"] == arm and "error" not in r):
            frame = read_run(Path(r["run_dir"]))
            frame = frame[frame["train/reward"].notna()]
            colour = colours[seeds.index(r["seed"]) % len(colours)]
            steps = frame.index.to_numpy(dtype=float)
            k = seeds.index(r["seed"])
            spans = phase_spans(steps, frame["lld/phase"].tolist()) if "lld/phase" in frame.columns else []
            for i, (_, column) in enumerate(rows):
                ax = axes[i][j]
                if column not in frame.columns:
                    column = "train/grad_norm"
                y = frame[column]
                if column == "train/reward":
                    y = y.__class__(smoothed_reward(y.tolist(), crit.reward_smooth), index=y.index)  # as the criterion sees it
                ok = y.notna().to_numpy()
                ax.plot(steps[ok], y[ok], color=colour, lw=1.2)
                for start, end, phase in spans:
                    ax.axvspan(start, end, ymin=k * 0.04, ymax=(k + 1) * 0.04, color=PHASE_COLOURS[phase], alpha=0.7, lw=0)
                for step in r["warnings"]:
                    ax.axvline(step, color=colour, ls=":", lw=1.0)
                if r["collapsed"]:
                    ax.axvline(r["collapse_step"], color=colour, ls="-", lw=1.6, alpha=0.8)
    for i, (name, column) in enumerate(rows):
        axes[i][0].set_ylabel(name, fontsize=9)
        for ax in axes[i]:
            ax.grid(alpha=0.3)
            if column == "train/grad_norm_max":
                ax.set_yscale("log")
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    handles = [plt.Line2D([], [], color=colours[k % len(colours)], lw=2, label=f"seed {s}") for k, s in enumerate(seeds)]
    handles += [Patch(color=PHASE_COLOURS[2], label="steady decay"), Patch(color=PHASE_COLOURS[3], label="acceleration"),
                plt.Line2D([], [], color="grey", ls=":", label="LLD warning"), plt.Line2D([], [], color="grey", ls="-", label="collapse")]
    fig.legend(handles=handles, loc="outside upper center", ncol=len(handles), fontsize=8, frameon=False,
               title="phase strips: one per seed, bottom-up", title_fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out: Path, jobs: list[tuple[str, int]], crit: Criteria, meta: dict) -> dict:
    """Summarise every finished run in ``out`` and write collapse.json, collapse.md and collapse.png."""
    runs = []
    for arm, seed in jobs:
        info = meta.get("runs", {}).get(f"{arm}/seed{seed}", {})
        entry = {"arm": arm, "seed": seed, "command": info.get("command"), "wall_s": info.get("wall_s")}
        if info.get("error"):
            entry["error"] = info["error"]
        else:
            try:
                entry.update(summarise_run(run_dir(out, arm, seed), crit))
            except (OSError, ValueError) as err:  # PlotInputError is a ValueError
                entry["error"] = str(err)
        if entry.get("wall_s") is None:
            entry["wall_s"] = entry.get("wall_time_s")
        runs.append(entry)
    arms = per_arm(runs)
    text = table(runs, arms)
    png = figure(runs, crit, out / "collapse.png") if any("error" not in r for r in runs) else None
    silent = [f"{ARMS.get(r['arm'], (r['arm'],))[0]} seed {r['seed']}" for r in runs if r.get("signal_steps") == 0]
    if silent:
        text += (
            f"\nNO LEARNING SIGNAL in {', '.join(silent)}: no step had a response with positive advantage (every "
            "group's rewards were equal), so GRPO did nothing and LLD cannot show. Warm-start the policy so that it "
            "earns some reward, or turn on dynamic sampling (configs/dynamic_sampling.yaml).\n"
        )
    crit_text = ", ".join(f"{k}={v}" for k, v in asdict(crit).items())
    (out / "collapse.md").write_text(
        f"# The collapse lab (benchmarks/collapse.py)\n\nRecipe `{meta.get('recipe')}`; criteria: {crit_text} "
        "(definitions: the docstring of benchmarks/collapse.py).\n\n" + text + (f"\nFigure: {png.name}\n" if png else "")
    )
    payload = {"meta": meta, "criteria": asdict(crit), "arms": arms, "runs": runs, "figure": str(png) if png else None}
    (out / "collapse.json").write_text(json.dumps(payload, indent=2))
    print("\n" + text + f"\nfigure: {png}\ntable:  {out / 'collapse.md'}\njson:   {out / 'collapse.json'}", flush=True)
    return payload


# --------------------------------------------------------------------------- running


def fit_command(arm: str, recipe: str, out: Path, seed: int, steps: Optional[int], extra_configs: list[str], overrides: list[str]) -> list[str]:
    """The `lldslight fit` command line of one run (configs compose left to right)."""
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", recipe, "--config", ARMS[arm][1]]
    for config in extra_configs:
        cmd += ["--config", config]
    cmd += [
        "--seed_everything", str(seed),
        "--data.seed", str(seed),
        "--trainer.logger.init_args.save_dir", str(out / arm),
        "--trainer.logger.init_args.name", f"seed{seed}",
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


def run_child(name: str, cmd: list[str], log_path: Path, threads: Optional[int] = None) -> tuple[float, float]:
    """Run one child process, its output teed to ``log_path``; its [lldslight] lines are echoed.
    Returns (wall seconds, CPU seconds of the child: user + system); raises RuntimeError when it fails.
    CPU seconds are what a run costs on a shared machine, where wall seconds mean little."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n=== {name}: {' '.join(cmd[1:])}\n    log: {log_path}", flush=True)
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
                    print(f"    {name}| " + line.rstrip(), flush=True)
            # wait4 instead of wait: the child's own resource usage (Popen keeps none)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
            cpu = usage.ru_utime + usage.ru_stime
        finally:
            _RUNNING.discard(proc)
            if proc.poll() is None:  # interrupted: never leave an orphaned training run behind
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        sys.stdout.write("".join(tail))
        raise RuntimeError(f"exit {code}; log: {log_path}")
    print(f"    {name} done in {wall / 60:.1f} min ({cpu / 60:.1f} CPU min)", flush=True)
    return wall, cpu


# The supervised warm start every run begins from (lldslight/sft.py): SmolLM2-135M-Instruct never
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
    """Synthesise the recipe's knowledge base and run ``lldslight sft`` on it; returns the model directory."""
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
    try:
        run_child("warm start", cmd, out / "logs" / "warmstart.log")
    except RuntimeError as err:
        raise SystemExit(f"collapse: the warm start failed ({err})") from None
    return model_dir


def build_lab_policy(recipe: str, out: Path) -> Path:
    """Build the recipe's own small policy (``model.policy.model``) with benchmarks/lab/make_policy.py:
    a BPE tokenizer and a ~1M-weight Llama warm-started from scratch on the recipe's knowledge base;
    deterministic and cached (a second call only checks the cache)."""
    import yaml

    model = yaml.safe_load((ROOT / recipe).read_text())["model"]["policy"]["model"]
    cmd = [sys.executable, str(ROOT / "benchmarks/lab/make_policy.py"), "--config", recipe, "--out", model]
    try:
        run_child("lab policy", cmd, out / "logs" / "lab_policy.log", threads=1)
    except RuntimeError as err:
        raise SystemExit(f"collapse: building the lab policy failed ({err})") from None
    return ROOT / model


def run_all(commands: dict[tuple[str, int], list[str]], out: Path, jobs: int, threads: int) -> dict[str, dict]:
    """Every run, ``jobs`` at a time with ``threads`` threads each; a failed run is recorded, not fatal."""
    results: dict[str, dict] = {}

    def one(key: tuple[str, int]) -> None:
        arm, seed = key
        name = f"{arm}/seed{seed}"
        entry = results[name] = {"command": " ".join(shlex.quote(a) for a in commands[key][1:])}
        try:
            entry["wall_s"], entry["cpu_s"] = run_child(name, commands[key], out / "logs" / f"{arm}_seed{seed}.log", threads)
        except RuntimeError as err:
            entry["error"] = str(err)

    pool = ThreadPoolExecutor(max(1, jobs))
    futures = [pool.submit(one, key) for key in commands]
    try:
        while not all(f.done() for f in futures):
            time.sleep(1.0)  # a bounded wait, so Ctrl-C and SIGTERM reach this thread
        for f in futures:
            f.result()
    finally:
        _kill_children()
        pool.shutdown(wait=False, cancel_futures=True)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Arguments after `--` go to every `lldslight fit`.")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 1 seed, 3 steps per run: proves the pipeline")
    parser.add_argument("--recipe", default=None, help="base config (default benchmarks/collapse.yaml, or collapse_smoke.yaml with --smoke)")
    parser.add_argument("--out", default=None, help="output directory (default runs/collapse or runs/collapse_smoke)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seed_everything and data seed per run (default 0 1 2; 0 with --smoke)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2: one per core on 2 cores)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--config", dest="extra_configs", action="append", default=[], help="extra config composed after the arm's (repeatable), e.g. configs/guard.yaml")
    parser.add_argument("--report-only", action="store_true", help="only redo collapse.{json,md,png} from the runs in OUT")
    parser.add_argument("--force", action="store_true", help="delete a run's previous output in OUT first")
    parser.add_argument("--no-warm-start", action="store_true", help="train the recipe's model as is (no supervised warm start)")
    parser.add_argument("--lab-policy", action="store_true",
                        help="build the recipe's model with benchmarks/lab/make_policy.py first (cached; no sft warm start), as configs/lab/base.yaml needs")
    parser.add_argument("--sft-args", default=None, help="arguments of `lldslight sft` for the warm start, one string (default: WARM_START)")
    for field, value in asdict(Criteria()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value, help=f"collapse criterion (default {value})")
    args, overrides = parser.parse_known_args(argv)
    signal.signal(signal.SIGTERM, _stop_children)  # a scheduler's kill unwinds like Ctrl-C, children too
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]
    crit = Criteria(**{f: getattr(args, f) for f in asdict(Criteria())})
    recipe = args.recipe or RECIPES["smoke" if args.smoke else "full"]
    seeds = args.seeds if args.seeds is not None else ([0] if args.smoke else [0, 1, 2])
    out = (ROOT / (args.out or ("runs/collapse_smoke" if args.smoke else "runs/collapse"))).resolve()
    jobs = [(arm, seed) for seed in seeds for arm in args.arms]
    for path in [recipe] + [ARMS[a][1] for a in args.arms] + args.extra_configs:
        if not (ROOT / path).is_file():
            raise SystemExit(f"collapse: config not found: {path} (relative to {ROOT})")
    if args.no_warm_start or args.lab_policy:
        warm_start = None
    else:
        warm_start = shlex.split(args.sft_args) if args.sft_args is not None else WARM_START["smoke" if args.smoke else "full"]
    meta = {
        "invocation": "python benchmarks/collapse.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "recipe": recipe, "warm_start": warm_start, "seeds": seeds, "arms": args.arms, "jobs": args.jobs, "threads": args.threads,
        "steps": args.steps, "extra_configs": args.extra_configs, "overrides": overrides, "runs": {},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(), "processor": platform.processor()},
    }
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "collapse.json"
    if args.report_only:
        if previous.is_file():
            meta = json.loads(previous.read_text()).get("meta", meta)  # the commands and wall times of the runs
        found = [(arm, seed) for seed in meta.get("seeds", seeds) for arm in meta.get("arms", args.arms) if run_dir(out, arm, seed).is_dir()]
        if not found:
            raise SystemExit(f"collapse: no finished run in {out} (expected {out}/<arm>/seed<S>/version_0)")
        report(out, found, crit, meta)
        return 0
    for arm, seed in jobs:
        previous_run = out / arm / f"seed{seed}"
        if previous_run.exists():
            if not args.force:
                raise SystemExit(f"collapse: {previous_run} exists; pass --force to redo it or --report-only to reuse it")
            shutil.rmtree(previous_run)
    t0 = time.perf_counter()
    meta["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.lab_policy:
        meta["lab_policy"] = str(build_lab_policy(recipe, out))
    if warm_start is not None:
        # the warm-started weights replace the recipe's model (and its random init, in the smoke run)
        model_dir = prepare_warm_start(recipe, out, warm_start)
        overrides = ["--model.policy.model", str(model_dir), "--model.policy.random_init", "null"] + overrides
    commands = {(arm, seed): fit_command(arm, recipe, out, seed, args.steps, args.extra_configs, overrides) for arm, seed in jobs}
    meta["runs"] = run_all(commands, out, args.jobs, args.threads)
    meta["wall_s"] = time.perf_counter() - t0
    report(out, jobs, crit, meta)
    failed = [name for name, r in meta["runs"].items() if "error" in r]
    if failed:
        print(f"collapse: {len(failed)} run(s) failed: {', '.join(failed)} (see collapse.md)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
