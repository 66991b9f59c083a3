"""Did a lab run collapse? The criteria of issue 15, item 2, read from a run's metrics.csv.

    python benchmarks/lab/criteria.py runs/lab/<name>/version_0 [...] [--json out.json]

A run collapses when
1. decay: the correct-response log-prob decays over >= ``--decay-steps`` (10) consecutive measured
   steps: LLDMonitor's phase detector (lld/phase) reads steady decay or acceleration (>= 2) on 10
   consecutive steps that have a response with A > 0 (the steps where lld/logp_pos is measured);
2. and then, from the decay's first step on, either
   - fall: train reward, as a rolling mean over ``--reward-window`` (20) steps, stays at or below
     half its running peak for >= 10 consecutive steps; or
   - explosion: a step whose largest pre-clip update gradient norm is non-finite or > 10 x the
     median of the same per-step maxima over the last 50 earlier steps with a signal (A > 0
     present): GradientSpikeGuard's test (factor 10, window 50), on per-step maxima since the
     module logs no per-update norms.
Also reported: how the phase detector's decay and the fall relate to Delta (lld/delta_correct, the
change of the correct responses' log-prob caused by each step's own updates): the share of
measured steps with Delta < 0 and mean Delta, over the whole run and over the 100 steps before the
fall (or explosion). Per-step reward is noisy at 32 rollouts a step, hence the rolling mean.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def first_run(flags: list[bool], length: int, start: int = 0) -> Optional[int]:
    """Index of the first position >= start that begins ``length`` consecutive True values."""
    count = 0
    for i in range(start, len(flags)):
        count = count + 1 if flags[i] else 0
        if count >= length:
            return i - length + 1
    return None


def replay_phases(frame, phases: dict):
    """lld/phase recomputed with other PhaseConfig settings: LLDMonitor's detector fed the run's
    logged signal, grad norm and entropy, step by step, exactly as the monitor fed it."""
    from lldslight.diagnostics import PhaseConfig, PhaseDetector

    detector = PhaseDetector(PhaseConfig(**phases))
    out = []
    for _, row in frame.iterrows():
        update = detector.update(float(row["lld/logp_pos"]), float(row.get("train/grad_norm", float("nan"))),
                                 float(row.get("train/entropy", float("nan"))))
        out.append(float(update.phase))
    frame = frame.copy()
    frame["lld/phase"] = out
    return frame


def evaluate(run_dir: Path, decay_steps: int = 10, reward_window: int = 20, fall_steps: int = 10,
             explode_factor: float = 10.0, explode_window: int = 50, phases: Optional[dict] = None) -> dict:
    from lldslight.plots import read_run

    frame = read_run(run_dir)
    frame = frame[frame["train/reward"].notna()].sort_index()
    if phases:
        frame = replay_phases(frame, phases)
    steps = frame.index.tolist()
    out: dict = {"run_dir": str(run_dir), "steps": len(frame)}
    if not len(frame):
        return out
    measured = frame["lld/logp_pos"].notna() & (frame.get("lld/n_pos", frame["lld/logp_pos"] * 0 + 1).fillna(0) > 0)
    phase = frame["lld/phase"].where(measured)
    m_steps = [s for s, m in zip(steps, measured) if m]
    m_decay = [bool(p >= 2) for p, m in zip(phase, measured) if m]
    i = first_run(m_decay, decay_steps)
    decay_step = m_steps[i] if i is not None else None
    out["decay_step"] = decay_step
    out["measured_steps"] = len(m_steps)
    out["steps_in_decay"] = int(sum(m_decay))

    reward = frame["train/reward"]
    ma = reward.rolling(reward_window, min_periods=reward_window).mean()
    peak = ma.cummax()
    low = ((ma <= 0.5 * peak) & ma.notna() & (peak > 0)).tolist()
    j = first_run(low, fall_steps, steps.index(decay_step)) if decay_step is not None else None
    out["fall_step"] = steps[j] if j is not None else None
    # the same test without requiring decay first (a fall that the likelihood did not announce)
    j0 = first_run(low, fall_steps)
    out["fall_step_any"] = steps[j0] if j0 is not None else None
    out["reward_peak_ma"] = float(peak.max()) if peak.notna().any() else None

    # Like with like: a step's largest update norm against the same statistic of earlier steps
    # (the module logs per-step mean and max over updates, not each update's norm).
    gmax = frame["train/grad_norm_max"] if "train/grad_norm_max" in frame.columns else frame["train/grad_norm"]
    history: list[float] = []
    explode = None
    explode_any = None
    for k, s in enumerate(steps):
        g = float(gmax.iloc[k]) if gmax.iloc[k] == gmax.iloc[k] else float("nan")
        if len(history) >= 10:
            recent = history[-explode_window:]
            med = sorted(recent)[len(recent) // 2]
            bad = (not math.isfinite(g)) or g > explode_factor * med
            if bad and explode_any is None:
                explode_any = s
            if bad and explode is None and decay_step is not None and s >= decay_step:
                explode = s
        if bool(measured.iloc[k]) and math.isfinite(g) and g > 0:
            history.append(g)
    out["explode_step"] = explode
    out["explode_step_any"] = explode_any
    ends = [x for x in (out["fall_step"], explode) if x is not None]
    out["collapsed"] = decay_step is not None and bool(ends)
    out["collapsed_by"] = "+".join(k for k, v in (("fall", out["fall_step"]), ("spike", explode)) if v is not None) or None
    out["collapse_step"] = min(ends) if ends else None

    if "lld/delta_correct" in frame.columns:
        delta = frame["lld/delta_correct"].where(measured).dropna()
        out["delta_mean"] = float(delta.mean()) if len(delta) else None
        out["delta_neg_share"] = float((delta < 0).mean()) if len(delta) else None
        if out["collapse_step"] is not None:
            before = delta[(delta.index < out["collapse_step"]) & (delta.index >= out["collapse_step"] - 100)]
            out["delta_mean_before"] = float(before.mean()) if len(before) else None
            out["delta_neg_share_before"] = float((before < 0).mean()) if len(before) else None
    for name, col in (("reward", "train/reward"), ("logp_pos", "lld/logp_pos"), ("entropy", "train/entropy"),
                      ("zero_var", "train/zero_var_groups"), ("answered", "train/answered_rate")):
        if col in frame.columns:
            v = frame[col].dropna()
            out[f"{name}_first50"] = float(v.iloc[:50].mean()) if len(v) else None
            out[f"{name}_last50"] = float(v.iloc[-50:].mean()) if len(v) else None
    for col in ("val_before/em", "val_after/em"):
        full = read_run(run_dir)
        if col in full.columns and full[col].notna().any():
            out[col.split("/")[0]] = float(full[col].dropna().iloc[-1])
    summary = run_dir / "summary.json"
    if summary.is_file():
        out["wall_s"] = json.loads(summary.read_text()).get("wall_time_s")
    return out


def line(r: dict) -> str:
    def f(x, spec=".3f"):
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)
    return (f"{r['run_dir']}: steps {r['steps']} (measured {r.get('measured_steps')}), decay@{f(r.get('decay_step'), 'd')} "
            f"fall@{f(r.get('fall_step'), 'd')} (any {f(r.get('fall_step_any'), 'd')}) explode@{f(r.get('explode_step'), 'd')} "
            f"(any {f(r.get('explode_step_any'), 'd')}) COLLAPSED={r.get('collapsed')}; reward {f(r.get('reward_first50'))}->{f(r.get('reward_last50'))} "
            f"peak_ma {f(r.get('reward_peak_ma'))}; logp+ {f(r.get('logp_pos_first50'))}->{f(r.get('logp_pos_last50'))}; "
            f"entropy {f(r.get('entropy_first50'))}->{f(r.get('entropy_last50'))}; zero-var {f(r.get('zero_var_first50'))}->{f(r.get('zero_var_last50'))}; "
            f"Delta mean {f(r.get('delta_mean'), '+.4f')} neg {f(r.get('delta_neg_share'), '.2f')} (before fall: {f(r.get('delta_mean_before'), '+.4f')}, "
            f"{f(r.get('delta_neg_share_before'), '.2f')}); dev EM {f(r.get('val_before'))}->{f(r.get('val_after'))}; wall {f(r.get('wall_s'), '.0f')} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--json", default=None)
    parser.add_argument("--phases", type=json.loads, default=None,
                        help="replay the phase detector with these PhaseConfig settings (JSON) instead of the logged lld/phase")
    args = parser.parse_args(argv)
    results = [evaluate(Path(r), phases=args.phases) for r in args.runs]
    for r in results:
        print(line(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
