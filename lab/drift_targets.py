"""The rate controller's target from archived runs, steps without signal left out; and the candidate
targets of every archived set, side by side.

    python -m lab.drift_targets --pilot lab/archive/collapse/<set>/<arm> --seeds 0 1    # one target
    python -m lab.drift_targets --pilot lab/archive/demo/warmstart_1hop --run-name n60_seed{} --seeds 0 1 2 --first 2
    python -m lab.drift_targets --describe [--json out.json]                           # the table

AdaptiveRate's ``log_pi`` rule (lldslight/callbacks/drift.py) stops moving the rate where the clipped
error has mean 0 over the rollout batches with signal: at T with sum_i clip(ln(KL_i / T), -c, c) = 0.
This script computes that T (:func:`log_pi_fixed_point`) over a run's steps with signal, so a target
read off a run is the drift the rule would hold there. A step has signal when ``drift/signal`` is 1
(logged since that metric); in older archives, when not every group tied (``train/zero_var_groups``
< 1) and an update had a gradient (``train/grad_norm_max`` > 0): the same steps for plain GRPO, whose
tied batches have a zero gradient. The registered C2 calibration counted every step (17-23% of its
pilot's steps were tied, KL ~1e-5 from the optimiser's momentum alone), which halved its target:
lab/calibrate_target_kl.py, kept as registered.

The candidate forms, per step with signal (``--describe``):

- ``kl``: ``drift/kl_k3_last``, nats per token (what the update's early stop and AdaptiveRate read);
- ``kl/H``: the same over the step's mean token entropy (``train/entropy``): a drift relative to how
  spread the policy is;
- ``rms/eps``: sqrt(``drift/log_ratio_m2_last``) / ``clip_eps``: the typical token's log importance
  ratio as a share of PPO's clip range (KL ~ (rms)^2 / 2 for small ratios);
- ``clip``: ``drift/clip_frac_last``, the share of the last mini-batch's tokens the clip acted on.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from lldslight.errors import script_main
from lldslight.run.writes import check_out_file
from lldslight.science import collapse as C

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "lab" / "archive" / "collapse"
DEMO = ROOT / "lab" / "archive" / "demo"
ERROR_CLIP = 1.0  # AdaptiveRate's default error_clip
CLIP_EPS = 0.2  # the update's default clip_eps, the lab's and the demo's


@dataclass(frozen=True)
class Group:
    """Archived runs read together: a label, the run directories' glob, the first step read (after
    the warm-up), and whether to stop each run at its collapse (hold 30)."""

    label: str
    pattern: str
    first: int
    to_collapse: bool = False


# Every archived set that logged the drift metrics, and the demo runs that did.
GROUPS = (
    Group("C2 pilot: GRPO 2.5e-4, seeds 0-1", "c2_pilot_2.5e-4/grpo/seed*", 30),
    Group("C2: GRPO 2.5e-4 (best fixed rate)", "c2_2.5e-4/grpo/seed*", 30),
    Group("C2: bound from 5e-4", "c2_5e-4/bound/seed*", 30),
    Group("C2: bound from 1e-3", "c2_1e-3/bound/seed*", 30),
    Group("C1: GRPO 5e-4, to collapse", "c1_5e-4/grpo/seed*", 30, True),
    Group("C2: GRPO 1e-3, to collapse", "c2_1e-3/grpo/seed*", 0, True),
    Group("C1: GRPO+LLDS 5e-4, to collapse", "c1_5e-4/llds/seed*", 30, True),
    Group("demo: SmolLM2 LoRA 5e-4, shipped", "../demo/shipped/n32_seed*", 2),
    Group("demo: SmolLM2 LoRA 5e-4, 1-hop warm start", "../demo/warmstart_1hop/n60_seed*", 2),
)


def has_signal(frame) -> list[bool]:
    """Per step: whether its last drift measures its updates (``drift/signal``, else the proxy)."""
    flag = C.column(frame, "drift/signal")
    if flag is not None:
        return [v == 1.0 for v in flag]
    tied = C.column(frame, "train/zero_var_groups")
    norm = C.column(frame, "train/grad_norm_max")
    if tied is None or norm is None:
        raise SystemExit("drift_targets: a run logged neither drift/signal nor train/zero_var_groups and train/grad_norm_max")
    return [t < 1.0 and n > 0 for t, n in zip(tied, norm)]


def log_pi_fixed_point(values: Sequence[float], clip: float = ERROR_CLIP) -> float:
    """The T with sum clip(ln(v / T), -clip, clip) = 0 over ``values`` (> 0; a non-finite value counts
    +clip, as AdaptiveRate reads it): the drift the ``log_pi`` rule holds on these batches. The sum
    falls as T rises; bisection on ln T to 1e-12 (no closed form: the clip makes it a Huber-like
    location estimate, between the median (clip -> 0) and the geometric mean (clip -> inf))."""
    if any(v <= 0 for v in values if math.isfinite(v)) or not any(math.isfinite(v) for v in values):
        raise ValueError("log_pi_fixed_point: needs values > 0, at least one finite (a KL of 0 is a held batch: leave it out)")
    finite = [math.log(v) for v in values if math.isfinite(v)]
    over = len(values) - len(finite)

    def total(x: float) -> float:
        return sum(min(max(v - x, -clip), clip) for v in finite) + over * clip

    lo, hi = min(finite) - clip, max(finite) + clip  # total(lo) >= 0 >= total(hi)
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) > 0 else (lo, mid)
    return math.exp((lo + hi) / 2)


def steps_read(frame, first: int, to_collapse: bool) -> list[int]:
    """Positions of the steps read: from step ``first``, up to the run's collapse (hold 30) when asked."""
    end = len(frame)
    if to_collapse:
        found = C.find_collapse(C.column(frame, "train/reward"), C.column(frame, "train/answered_rate"), C.CollapseCriteria(hold=30))
        end = found.index if found.collapsed else end
    return [i for i, s in enumerate(frame.index) if first <= s and i < end]


def run_values(frame, first: int, to_collapse: bool = False, clip_eps: float = CLIP_EPS) -> dict[str, list[float]]:
    """One run's per-step values of every candidate form, on its steps with signal (``kl_all``: every step read)."""
    rows = steps_read(frame, first, to_collapse)
    signal = has_signal(frame)
    col = {k: C.column(frame, k) for k in ("drift/kl_k3_last", "drift/kl_k3", "train/entropy", "drift/log_ratio_m2_last",
                                           "drift/clip_frac_last", "train/lr")}
    kept = [i for i in rows if signal[i]]
    return {
        "kl_all": [col["drift/kl_k3_last"][i] for i in rows],
        "kl": [col["drift/kl_k3_last"][i] for i in kept],
        "kl_mean": [col["drift/kl_k3"][i] for i in kept],
        "kl_per_entropy": [col["drift/kl_k3_last"][i] / col["train/entropy"][i] for i in kept],
        "rms_per_eps": [math.sqrt(col["drift/log_ratio_m2_last"][i]) / clip_eps for i in kept],
        "clip": [col["drift/clip_frac_last"][i] for i in kept],
        "lr": [col["train/lr"][i] for i in rows],
        "steps": [float(len(rows))],
    }


@dataclass
class Candidates:
    """One group's candidate targets: per run, then the median over its runs."""

    label: str
    runs: int
    steps: float  # steps read per run
    signal_share: float  # of them, with signal
    kl_all_median: float  # C2's registered statistic: every step
    kl_median: float  # steps with signal
    kl_fixed_point: float  # log_pi's fixed point (error_clip 1), steps with signal
    kl_spread: float  # sd of ln KL over steps with signal (the noise the controller averages)
    kl_mean_spread: float  # the same for the mean over the step's updates (drift/kl_k3)
    kl_per_entropy: float
    entropy: float
    rms_per_eps: float
    clip_mean: float
    clip_zero_share: float  # steps with signal whose last mini-batch had no clipped token
    rate: float  # median train/lr


def _spread(values: list[float]) -> float:
    logs = [math.log(v) for v in values if v > 0 and math.isfinite(v)]
    return statistics.pstdev(logs) if len(logs) > 1 else float("nan")


def describe(group: Group, root: Path = LAB) -> Optional[Candidates]:
    """A group's candidates (None when none of its runs is archived)."""
    per_run = []
    for run in sorted((root / group.pattern).parent.glob(Path(group.pattern).name)):
        if not any((run / n).is_file() for n in ("metrics.csv.gz", "metrics.csv")):
            continue
        v = run_values(C.training_rows(C.read_metrics(run)), group.first, group.to_collapse)
        if not v["kl"]:
            continue
        entropy = [k / r for k, r in zip(v["kl"], v["kl_per_entropy"]) if r > 0]
        per_run.append({
            "steps": v["steps"][0], "signal_share": len(v["kl"]) / v["steps"][0],
            "kl_all_median": statistics.median(v["kl_all"]), "kl_median": statistics.median(v["kl"]),
            "kl_fixed_point": log_pi_fixed_point([k for k in v["kl"] if k != 0]),
            "kl_spread": _spread(v["kl"]), "kl_mean_spread": _spread(v["kl_mean"]),
            "kl_per_entropy": statistics.median(v["kl_per_entropy"]), "entropy": statistics.median(entropy) if entropy else float("nan"),
            "rms_per_eps": statistics.median(v["rms_per_eps"]), "clip_mean": statistics.fmean(v["clip"]),
            "clip_zero_share": sum(c == 0 for c in v["clip"]) / len(v["clip"]), "rate": statistics.median(v["lr"]),
        })
    if not per_run:
        return None
    med = {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}
    return Candidates(label=group.label, runs=len(per_run), **med)


def table(rows: list[Candidates]) -> str:
    head = ("| set | runs | steps read | with signal | KL median, all steps | KL median, signal | log_pi fixed point | "
            "sd ln KL (last / mean) | KL / H | H | rms log r / eps | clip share (mean; zero) | rate |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.label} | {r.runs} | {r.steps:.0f} | {r.signal_share:.2f} | {r.kl_all_median:.2g} | {r.kl_median:.2g} | "
                     f"{r.kl_fixed_point:.2g} | {r.kl_spread:.1f} / {r.kl_mean_spread:.1f} | {r.kl_per_entropy:.2g} | {r.entropy:.2g} | "
                     f"{r.rms_per_eps:.2f} | {r.clip_mean:.3f}; {r.clip_zero_share:.2f} | {r.rate:.2g} |")
    return "\n".join(lines)


def calibrate(pilot: Path, seeds: Sequence[int], first: int, last: Optional[int], run_name: str = "seed{}") -> dict:
    """The target from a pilot arm's runs (``run_name`` with the seed, under ``pilot``): log_pi's fixed point over
    their steps ``first``..``last`` with signal, pooled; with the other statistics beside it."""
    pooled: dict[str, list[float]] = {}
    for seed in seeds:
        run = pilot / run_name.format(seed)
        frame = C.training_rows(C.read_metrics(run))
        if last is not None:
            if frame.empty or int(frame.index.max()) < last:
                raise SystemExit(f"drift_targets: {run} is not a finished pilot run (needs steps up to {last})")
            frame = frame[frame.index <= last]
        for k, v in run_values(frame, first).items():
            pooled.setdefault(k, []).extend(v)
    kls = [k for k in pooled.get("kl", []) if k != 0]
    if not kls:
        raise SystemExit(f"drift_targets: no step with signal in {pilot} (seeds {list(seeds)}, from step {first})")
    return {"target_kl": log_pi_fixed_point(kls), "steps_with_signal": len(kls), "steps": len(pooled["kl_all"]),
            "kl_median": statistics.median(kls), "kl_all_median": statistics.median(pooled["kl_all"]),
            "rms_per_eps_median": statistics.median(pooled["rms_per_eps"]),
            "kl_per_entropy_median": statistics.median(pooled["kl_per_entropy"])}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--describe", action="store_true", help="the candidate targets of every archived set (a markdown table)")
    parser.add_argument("--json", type=Path, default=None, help="with --describe: also write the rows as JSON here")
    parser.add_argument("--pilot", type=Path, default=None, help="a pilot arm's archive (seed<S>/ under it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--run-name", default="seed{}", help="a run's directory under --pilot, {} the seed (default seed{}; the demo's archives: n60_seed{})")
    parser.add_argument("--first", type=int, default=30, help="the first step read (after the warm-up; default 30)")
    parser.add_argument("--last", type=int, default=None, help="the last step read (default: every step; a run short of it is refused)")
    args = parser.parse_args(argv)
    if args.json is not None:  # refused now, not after the work
        check_out_file(args.json, "--json")
    if args.describe:
        rows = [c for c in (describe(g) for g in GROUPS) if c is not None]
        print(table(rows))
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
        return 0
    if args.pilot is None:
        parser.error("give --describe or --pilot")
    out = calibrate(args.pilot, args.seeds, args.first, args.last, args.run_name)
    print(f"target_kl = {out['target_kl']:.3g} (log_pi's fixed point over {out['steps_with_signal']} of {out['steps']} steps with "
          f"signal; their median {out['kl_median']:.3g}; the median of every step, C2's rule, {out['kl_all_median']:.3g}; "
          f"rms log-ratio / clip_eps {out['rms_per_eps_median']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
