"""The registered analyses of lab/archive/collapse/CONFIRMATORY.md: C1 (does LLDS prevent the collapse
at 5e-4?) and C2's goal (does a drift bound keep every starting rate from collapsing?).

    python lab/confirmatory.py                 # C1: prints the analysis, writes lab/archive/collapse/c1_5e-4/c1.json
    python lab/confirmatory.py --c2            # C2: writes lab/archive/collapse/c2.json (and, complete, c2.png)

Everything is recomputed from the archived per-step metrics with the registered rule
(``lldslight.science.collapse``: hold 30, horizon 1,100), nothing from the runner's report. Until all 20
runs (seeds 20-29, GRPO and LLDS) are archived the set is *partial*: the runs are listed and no
test is computed, as registered. Then:

- **the one primary test**: collapsed-by-H, GRPO vs LLDS, one-sided at 0.05: Fisher's exact test if
  every seed ran on one machine kind, else the exact stratified test with machine kind as the
  stratum (``collapse.fisher_stratified_one_sided``). A machine kind is a CPU model with its SIMD
  flags (each run's ``machine_kind`` in collapse.json) and the digests of the inits built on it;
  runs of one CPU kind whose inits differ (another machine of the same kind) are another stratum;
- **the horizon rule**: GRPO's median time to collapse (held runs counted at H) <= H / 2 = 550,
  else "horizon too short" whatever the test says;
- **secondaries** (values, no claim): RMST difference LLDS - GRPO with a 2,000-resample paired
  bootstrap interval; the exact paired permutation test on the last-100 reward; the paired sign test
  on times to collapse; the hold-20 counts and test; per arm the median over runs of each run's
  median ``drift/kl_k3_last``.

The verdict's words are the registration's: "LLDS prevented the collapse within 1,100 steps" only
if the primary test passes and the horizon rule holds.

C2 has no primary test. Its goal, per starting rate (5e-4, 1e-3): (i) the bound arm collapses by H
in 0 of its 5 seeds (20-24), and (ii) the mean paired difference in last-100 reward, bound arm minus
GRPO at 2.5e-4, is >= 0 (reported with its 95% t interval, 4 degrees of freedom); met only if both
hold at both rates. Beside it: plain GRPO at the same rate (at 5e-4, C1's GRPO runs) with a
descriptive one-sided Fisher p, and the bound arms' rate, updates per batch and drift.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from lldslight.science import collapse as C

if __package__:  # lab.confirmatory: imported (tests), or run as python -m lab.confirmatory
    from .collapse import _median
else:  # python lab/confirmatory.py: the script's own folder is on sys.path
    from collapse import _median

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "lab" / "archive" / "collapse"
SET = LAB / "c1_5e-4"
SEEDS = tuple(range(20, 30))
ARMS = ("grpo", "llds")
HORIZON = 1100
HOLD = 30
RATE = 5e-4  # C1's learning rate (CONFIRMATORY.md)
ALPHA = 0.05
C2_SEEDS = tuple(range(20, 25))
# C2's archives per (arm, starting rate), as registered: GRPO at 5e-4 is C1's GRPO column.
C2_SETS = {("bound", "5e-4"): ("c2_5e-4", "bound"), ("bound", "1e-3"): ("c2_1e-3", "bound"),
           ("grpo", "5e-4"): ("c1_5e-4", "grpo"), ("grpo", "1e-3"): ("c2_1e-3", "grpo"), ("grpo", "2.5e-4"): ("c2_2.5e-4", "grpo")}
T975_DF4 = 2.776  # Student's t, two-sided 95%, 4 degrees of freedom (tables; scipy is not needed for one number)


def training_rows(run: Path):
    """One archived run's training rows up to the horizon (read once, summarised under each hold)."""
    train = C.training_rows(C.read_metrics(run))
    return train[train.index < HORIZON]


def run_outcome(train, hold: int) -> dict:
    """One run's training rows: time to collapse (censored at H), collapsed by H, last-100 reward,
    and the medians over steps of its drift, rate and updates applied."""
    summary = C.summarise(train, C.CollapseCriteria(hold=hold))
    time, collapsed = C.time_to_collapse(summary, HORIZON)
    return {"time": time, "collapsed": collapsed, "final_reward": summary["final_reward"],
            **{name: _median(C.column(train, key) or []) for key, name in
               (("drift/kl_k3_last", "drift_kl_k3_median"), ("train/lr", "lr_median"), ("drift/updates", "updates_median"))}}


def machine_kinds(meta_runs: dict) -> dict[str, tuple]:
    """run name ("grpo/seed20") -> its stratum: (CPU model, SIMD flags, the inits' digests on that
    machine). Inits are built per machine, so a CPU kind whose runs show two digests for one init
    path ran on two machines: the digest map splits it."""
    by_cpu: dict[tuple, dict[str, set]] = {}
    for name, r in meta_runs.items():
        k = r.get("machine_kind") or {}
        cpu = (k.get("cpu_model"), tuple(k.get("cpu_flags_simd") or ()))
        by_cpu.setdefault(cpu, {}).setdefault(k.get("init"), set()).add(k.get("init_digest"))
    out = {}
    for name, r in meta_runs.items():
        k = r.get("machine_kind") or {}
        cpu = (k.get("cpu_model"), tuple(k.get("cpu_flags_simd") or ()))
        split = any(len(d) > 1 for d in by_cpu[cpu].values())
        out[name] = cpu + ((k.get("init"), k.get("init_digest")) if split else ())
    return out


def primary(outcomes: dict[str, dict[int, dict]], kinds: dict[int, tuple]) -> dict:
    """The registered primary test on complete, paired outcomes (arm -> seed -> outcome)."""
    strata: dict[tuple, list[int]] = {}
    for seed in sorted(outcomes["grpo"]):
        strata.setdefault(kinds[seed], []).append(seed)
    cells = [(sum(outcomes["grpo"][s]["collapsed"] for s in seeds), len(seeds),
              sum(outcomes["llds"][s]["collapsed"] for s in seeds), len(seeds)) for seeds in strata.values()]
    stratified = len(cells) > 1
    p = C.fisher_stratified_one_sided(cells) if stratified else C.fisher_one_sided(*cells[0])
    return {"test": "exact stratified (machine kind)" if stratified else "Fisher exact", "one_sided": True,
            "strata": [{"kind": list(map(str, k)), "seeds": s, "grpo_collapsed": c[0], "llds_collapsed": c[2], "n": c[1]}
                       for (k, s), c in zip(strata.items(), cells)],
            "p": p, "alpha": ALPHA, "passes": p <= ALPHA}


def analyse(outcomes: dict[str, dict[int, dict]], kinds: dict[int, tuple], hold20: Optional[dict[str, dict[int, dict]]] = None) -> dict:
    """The registered analysis of complete outcomes (arm -> seed -> run_outcome), seed -> stratum."""
    seeds = sorted(outcomes["grpo"])
    g, l = outcomes["grpo"], outcomes["llds"]
    grpo_median = statistics.median(g[s]["time"] for s in seeds)
    test = primary(outcomes, kinds)
    horizon_ok = grpo_median <= HORIZON / 2
    if test["passes"] and horizon_ok:
        verdict = "LLDS prevented the collapse within 1,100 steps"
    elif test["passes"]:
        verdict = "horizon too short: no prevention claimed"
    else:
        verdict = "not supported: the primary test did not pass"
    out = {
        "seeds": seeds, "horizon": HORIZON, "hold": HOLD,
        "collapsed": {arm: sum(outcomes[arm][s]["collapsed"] for s in seeds) for arm in ARMS},
        "primary": test,
        "grpo_median_time": grpo_median, "horizon_rule_holds": horizon_ok,
        "verdict": verdict,
        "secondary": {
            "rmst_difference": C.rmst_difference([(g[s]["time"], g[s]["collapsed"]) for s in seeds],
                                                 [(l[s]["time"], l[s]["collapsed"]) for s in seeds], HORIZON, n_boot=2000),
            "final_reward_permutation": C.paired_permutation([g[s]["final_reward"] or 0.0 for s in seeds],
                                                             [l[s]["final_reward"] or 0.0 for s in seeds]),
            "sign_test": C.sign_test([(g[s]["time"], l[s]["time"]) for s in seeds]),
            "drift_kl_k3_median": {arm: _median([outcomes[arm][s]["drift_kl_k3_median"] for s in seeds]) for arm in ARMS},
        },
    }
    if hold20 is not None:
        out["secondary"]["hold20"] = {"collapsed": {arm: sum(hold20[arm][s]["collapsed"] for s in seeds) for arm in ARMS},
                                      "p": primary(hold20, kinds)["p"]}
    return out


def not_readable(run: Path, key: str, kind_of: dict, unit: str, prefix: str = "") -> Optional[str]:
    """Why run ``key`` (``arm/seedN``) cannot be analysed yet, or None: its metrics are not
    archived, or its ``unit`` (a C1 pair, a C2 set) still runs: the runner records a run's machine
    in collapse.json only when the whole unit ends, and a run without its machine kind has no stratum."""
    if not any(run.glob("metrics.csv*")):
        return f"{prefix}{key}"
    if key not in kind_of:
        return f"{prefix}{key} ({unit} unfinished)"
    return None


def set_rate(meta: dict) -> Optional[float]:
    """The learning rate a set's runs trained at: the last ``--model.optim.lr`` (or the deprecated
    ``--model.lr``) of its fit overrides, else its recipe's ``model.optim.lr``; None when unknown."""
    overrides = [str(o) for o in meta.get("overrides") or []]
    given = [overrides[i + 1] for i, o in enumerate(overrides[:-1]) if o in ("--model.optim.lr", "--model.lr")]
    if given:
        return float(given[-1])
    recipe = ROOT / str(meta.get("recipe") or "")
    if not recipe.is_file():
        return None
    import yaml

    model = (yaml.safe_load(recipe.read_text()) or {}).get("model") or {}
    lr = (model.get("optim") or {}).get("lr", model.get("lr"))
    return None if lr is None else float(lr)


def rate_text(rate: float) -> str:
    """A rate as the sets are named: 5e-4, 2.5e-4, 1e-3."""
    mantissa, exponent = f"{rate:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def not_c1(meta: dict, archived: set[tuple[str, int]]) -> list[str]:
    """How a set differs from C1's registered design (arms grpo and llds, seeds 20-29, lr 5e-4,
    horizon 1,100), from its recorded runs, its archived ones and its meta; empty for C1's set."""
    runs = archived | {(name.split("/")[0], int(name.split("/seed")[1])) for name in meta.get("runs", {}) if "/seed" in name}
    problems = [f"arm {a}" for a in sorted({a for a, _ in runs} - set(ARMS))]
    other_seeds = sorted({s for _, s in runs} - set(SEEDS))
    problems += [f"seeds {', '.join(map(str, other_seeds))}"] if other_seeds else []
    rate = set_rate(meta)
    if rate is not None and rate != RATE:
        problems.append(f"lr {rate_text(rate)}")
    if meta.get("horizon") not in (None, HORIZON):
        problems.append(f"horizon {meta['horizon']}")
    return problems


def load(path: Path = SET) -> tuple[dict, dict, dict, list[str]]:
    """(outcomes at hold 30, outcomes at hold 20, seed -> stratum, missing runs) from the archive."""
    if not (path / "collapse.json").is_file():
        raise SystemExit(f"confirmatory: {path / 'collapse.json'} not found: --set must be a set's archive "
                         "(lab/archive/collapse/<name>, written by lab/collapse.py)")
    meta = json.loads((path / "collapse.json").read_text())["meta"]
    archived = {(p.parent.name, int(p.name[4:])) for p in path.glob("*/seed*") if p.name[4:].isdigit() and any(p.glob("metrics.csv*"))}
    problems = not_c1(meta, archived)
    if problems:
        raise SystemExit(f"confirmatory: {shown(path)} is not C1's set ({', '.join(problems)}; C1 registers arms "
                         f"{' and '.join(ARMS)}, seeds {SEEDS[0]}-{SEEDS[-1]}, lr {rate_text(RATE)}, horizon {HORIZON}): --set "
                         "names C1's archive (default lab/archive/collapse/c1_5e-4); --c2 reports C2")
    meta_runs = meta.get("runs", {})
    kind_of = machine_kinds(meta_runs)
    outcomes: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    hold20: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    missing, kinds = [], {}
    for arm in ARMS:
        for seed in SEEDS:
            run = path / arm / f"seed{seed}"
            gap = not_readable(run, f"{arm}/seed{seed}", kind_of, "pair")
            if gap:
                missing.append(gap)
                continue
            train = training_rows(run)
            outcomes[arm][seed] = run_outcome(train, HOLD)
            hold20[arm][seed] = run_outcome(train, 20)
            kinds.setdefault(seed, set()).add(kind_of.get(f"{arm}/seed{seed}"))
    for seed, k in kinds.items():
        if len(k) != 1:
            raise SystemExit(f"confirmatory: seed {seed}'s arms ran on different machine kinds {sorted(map(str, k))}: "
                             "the registration pairs a seed's arms on one machine")
    return outcomes, hold20, {s: next(iter(k)) for s, k in kinds.items()}, missing


def report(path: Path = SET) -> dict:
    outcomes, hold20, kinds, missing = load(path)
    runs = [{"arm": arm, "seed": s, **o, "machine_kind": list(map(str, kinds[s]))} for arm in ARMS for s, o in sorted(outcomes[arm].items())]
    if missing:
        return {"status": "partial", "archived": len(runs), "registered": len(ARMS) * len(SEEDS), "missing": missing,
                "runs": runs, "note": "no test is computed on a partial set (CONFIRMATORY.md)"}
    return {"status": "complete", "runs": runs, **analyse(outcomes, kinds, hold20)}


def kind_label(kind: list) -> str:
    """A machine kind as the tables print it: "AMD EPYC, avx512_bf16" / "AMD EPYC, avx2 only"."""
    flags = kind[1] if len(kind) > 1 else ""
    return f"{kind[0]}, {'avx512_bf16' if 'avx512_bf16' in flags else 'avx2 only' if 'avx2' in flags else flags}"


def text(rep: dict) -> str:
    lines = ["| arm | seed | collapsed by H (hold 30) | time | last-100 reward | median drift k3 | machine kind |", "|---|---|---|---|---|---|---|"]
    for r in rep["runs"]:
        lines.append(f"| {r['arm']} | {r['seed']} | {'yes' if r['collapsed'] else 'no'} | {r['time']:.0f} | "
                     f"{r['final_reward']:.3f} | {r['drift_kl_k3_median'] if r['drift_kl_k3_median'] is None else format(r['drift_kl_k3_median'], '.4f')} "
                     f"| {kind_label(r['machine_kind'])} |")
    if rep["status"] == "partial":
        lines.append(f"\nPartial: {rep['archived']} of {rep['registered']} runs archived; {rep['note']}.")
        return "\n".join(lines) + "\n"
    p, s = rep["primary"], rep["secondary"]
    rd, perm = s["rmst_difference"], s["final_reward_permutation"]
    lines += ["", f"Collapsed by H: GRPO {rep['collapsed']['grpo']} of 10, LLDS {rep['collapsed']['llds']} of 10.",
              f"Primary ({p['test']}, one-sided): p = {p['p']:.4f} at {p['alpha']} -> {'passes' if p['passes'] else 'does not pass'}.",
              f"Horizon rule: GRPO median time {rep['grpo_median_time']:.0f} vs H / 2 = {HORIZON / 2:.0f}: "
              f"{'holds' if rep['horizon_rule_holds'] else 'broken'}.",
              f"Verdict: {rep['verdict']}.",
              f"Secondary: RMST difference {rd['diff']:+.0f} steps [{rd['low']:+.0f}, {rd['high']:+.0f}] (paired bootstrap); "
              f"last-100 reward LLDS - GRPO {perm['mean_diff']:+.3f}, paired permutation p = {perm['p']:.3f}; "
              f"sign test {s['sign_test']['wins']}-{s['sign_test']['losses']}, p = {s['sign_test']['p']:.3f}"
              + (f"; hold 20: {s['hold20']['collapsed']['grpo']} vs {s['hold20']['collapsed']['llds']}, p = {s['hold20']['p']:.4f}" if "hold20" in s else "")
              + "."]
    return "\n".join(lines) + "\n"


def c2_goal(outcomes: dict[tuple[str, str], dict[int, dict]]) -> dict:
    """C2's registered goal from complete outcomes: (arm, rate) -> seed -> run_outcome."""
    seeds = sorted(outcomes[("grpo", "2.5e-4")])
    safe = outcomes[("grpo", "2.5e-4")]
    rates = {}
    for rate in ("5e-4", "1e-3"):
        bound, plain = outcomes[("bound", rate)], outcomes[("grpo", rate)]
        diffs = [(bound[s]["final_reward"] or 0.0) - (safe[s]["final_reward"] or 0.0) for s in seeds]
        mean = statistics.fmean(diffs)
        half = T975_DF4 * statistics.stdev(diffs) / len(diffs) ** 0.5
        collapsed = sum(bound[s]["collapsed"] for s in seeds)
        rates[rate] = {
            "bound_collapsed": collapsed, "n": len(seeds), "held_all": collapsed == 0,
            "reward_vs_2.5e-4": {"mean_diff": mean, "low": mean - half, "high": mean + half, "at_least_safe_rate": mean >= 0},
            "grpo_collapsed": sum(plain[s]["collapsed"] for s in seeds),
            "fisher_p_grpo_vs_bound": C.fisher_one_sided(sum(plain[s]["collapsed"] for s in seeds), len(seeds), collapsed, len(seeds)),
            **{f"bound_{name}": _median([bound[s][key] for s in seeds])
               for key, name in (("lr_median", "lr_median"), ("updates_median", "updates_median"), ("drift_kl_k3_median", "drift_median"))},
        }
    met = all(r["held_all"] and r["reward_vs_2.5e-4"]["at_least_safe_rate"] for r in rates.values())
    return {"seeds": seeds, "horizon": HORIZON, "hold": HOLD, "rates": rates, "goal_met": met,
            "safe_rate_collapsed": sum(safe[s]["collapsed"] for s in seeds)}


def c2_report(lab: Path = LAB) -> dict:
    """C2's runs from their archives, each with its machine kind (as registered: the goal's pairs,
    bound arm against GRPO at 2.5e-4, stay within a machine; the GRPO-at-5e-4 column may not)."""
    outcomes: dict[tuple[str, str], dict[int, dict]] = {}
    kinds: dict[tuple[str, str], dict[int, list]] = {}
    missing = []
    for key, (name, arm) in C2_SETS.items():
        outcomes[key], kinds[key] = {}, {}
        report_path = lab / name / "collapse.json"
        meta_runs = json.loads(report_path.read_text())["meta"].get("runs", {}) if report_path.is_file() else {}
        kind_of = machine_kinds(meta_runs)
        for seed in C2_SEEDS:
            run = lab / name / arm / f"seed{seed}"
            gap = not_readable(run, f"{arm}/seed{seed}", kind_of, "set", prefix=f"{name}/")
            if gap:
                missing.append(gap)
            else:
                outcomes[key][seed] = run_outcome(training_rows(run), HOLD)
                kinds[key][seed] = list(map(str, kind_of[f"{arm}/seed{seed}"]))
                cpu_s = meta_runs[f"{arm}/seed{seed}"].get("cpu_s")  # the run's process CPU time (registered: reported per run)
                outcomes[key][seed]["cpu_min"] = None if cpu_s is None else cpu_s / 60
    runs = [{"arm": a, "rate": r, "seed": s, **o, "machine_kind": kinds[(a, r)][s]}
            for (a, r), by_seed in outcomes.items() for s, o in sorted(by_seed.items())]
    # the goal's pairs: a seed's bound runs and its GRPO-at-2.5e-4 run on one machine kind
    across = sorted({s for (a, r), by_seed in kinds.items() if a == "bound" for s, k in by_seed.items()
                     if s in kinds[("grpo", "2.5e-4")] and k != kinds[("grpo", "2.5e-4")][s]})
    common = {"runs": runs, "goal_pairs_across_machines": across}
    if missing:
        return {"status": "partial", "archived": len(runs), "registered": len(C2_SETS) * len(C2_SEEDS), "missing": missing,
                **common, "note": "the goal is evaluated on the complete set only (CONFIRMATORY.md)"}
    return {"status": "complete", **common, **c2_goal(outcomes)}


def c2_text(rep: dict) -> str:
    lines = ["| arm | starting rate | seed | collapsed by H | time | last-100 reward | median lr | median updates | CPU min | machine kind |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["runs"]:
        lines.append(f"| {r['arm']} | {r['rate']} | {r['seed']} | {'yes' if r['collapsed'] else 'no'} | {r['time']:.0f} | {r['final_reward']:.3f} "
                     f"| {'n/a' if r['lr_median'] is None else format(r['lr_median'], '.2e')} | {'n/a' if r['updates_median'] is None else format(r['updates_median'], '.1f')} "
                     f"| {'n/a' if r.get('cpu_min') is None else format(r['cpu_min'], '.0f')} | {kind_label(r['machine_kind'])} |")
    if rep["goal_pairs_across_machines"]:
        lines.append(f"\nNot as registered: seeds {rep['goal_pairs_across_machines']} ran the bound arm and GRPO at 2.5e-4 on different machine kinds.")
    if rep["status"] == "partial":
        lines.append(f"\nPartial: {rep['archived']} of {rep['registered']} runs archived; {rep['note']}.")
        return "\n".join(lines) + "\n"
    lines.append("")
    for rate, r in rep["rates"].items():
        d = r["reward_vs_2.5e-4"]
        lines.append(f"Bound from {rate}: collapsed {r['bound_collapsed']} of {r['n']} (plain GRPO {r['grpo_collapsed']} of {r['n']}, "
                     f"Fisher p = {r['fisher_p_grpo_vs_bound']:.3f}, descriptive); last-100 reward minus GRPO at 2.5e-4: "
                     f"{d['mean_diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}].")
    lines.append(f"Goal (0 collapses and reward >= the safe rate's, at both starting rates): {'met' if rep['goal_met'] else 'not met'}.")
    return "\n".join(lines) + "\n"


def c2_figure(lab: Path, out: Path) -> dict:
    """C2's runs over steps, as registered ("the bound arms' rate trajectories"): the trailing-20
    reward of every run, the rate each bound run trained at (``train/lr``, its trailing-20 median:
    the rate moves by x1.5 from one step to the next; log scale, the fixed rates as lines) and the
    updates it applied per rollout batch (``drift/updates``, trailing 20). Returns, per panel, the runs drawn and their y values (what a test checks against the metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {("grpo", "5e-4"): "tab:red", ("grpo", "1e-3"): "tab:purple", ("grpo", "2.5e-4"): "tab:green",
               ("bound", "5e-4"): "tab:blue", ("bound", "1e-3"): "tab:cyan"}
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    drawn: dict[str, dict[str, list[float]]] = {"reward": {}, "lr": {}, "updates": {}}
    for (arm, rate), (name, folder) in C2_SETS.items():
        for seed in C2_SEEDS:
            run = lab / name / folder / f"seed{seed}"
            if not any(run.glob("metrics.csv*")):
                continue
            train = training_rows(run)
            label, steps = f"{arm} {rate} seed{seed}", list(train.index)
            panels = [("reward", axes[0], train["train/reward"].rolling(20, min_periods=1).mean())]
            if arm == "bound":
                panels += [("lr", axes[1], train["train/lr"].rolling(20, min_periods=1).median()),
                           ("updates", axes[2], train["drift/updates"].rolling(20, min_periods=1).mean())]
            for key, ax, values in panels:
                ax.plot(steps, values, color=colours[(arm, rate)], lw=0.8, alpha=0.8,
                        label=f"{arm} {rate}" if seed == min(C2_SEEDS) else None)
                drawn[key][label] = [float(v) for v in values]
    axes[0].set_ylabel("reward (trailing 20)")
    axes[1].set_yscale("log")
    for rate in (2.5e-4, 5e-4, 1e-3):
        axes[1].axhline(rate, color="grey", ls=":", lw=0.8)
    axes[1].set_ylabel("bound arms: train/lr\n(trailing-20 median)")
    axes[2].set_ylabel("bound arms: updates applied\nper rollout batch (trailing 20)")
    axes[2].set_xlabel("step")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[0].set_title(f"C2: plain GRPO at three rates and the drift bound started at two, seeds {C2_SEEDS[0]}-{C2_SEEDS[-1]}")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", type=Path, default=SET, help="C1's archive (default lab/archive/collapse/c1_5e-4)")
    parser.add_argument("--c2", action="store_true", help="C2's goal instead, from lab/archive/collapse/c2_* and C1's GRPO runs")
    parser.add_argument("--json", type=Path, default=None, help="where to write the analysis (default SET/c1.json; with --c2, c2.json beside the sets)")
    args = parser.parse_args(argv)
    if args.json is not None:  # before the analysis: a directory or a missing folder fails at the end otherwise
        if args.json.is_dir():
            raise SystemExit(f"confirmatory: --json {args.json}: is a directory; give the file to write (e.g. {args.json / 'c1.json'})")
        if not args.json.parent.is_dir():
            raise SystemExit(f"confirmatory: --json {args.json}: no such directory {args.json.parent}")
    if args.c2:
        if not any((args.set.parent / name / "collapse.json").is_file() for name, _ in C2_SETS.values()):
            raise SystemExit(f"confirmatory: no C2 set (c2_*/collapse.json, c1_5e-4/collapse.json) in {args.set.parent}: with --c2, "
                             "--set must be a set inside the lab's archive (lab/archive/collapse/<name>)")
        rep = c2_report(args.set.parent)
        print(c2_text(rep), end="")
        path = args.json or args.set.parent / "c2.json"
        if rep["status"] == "complete":
            c2_figure(args.set.parent, path.with_suffix(".png"))
            print(f"figure: {shown(path.with_suffix('.png'))}")
    else:
        rep = report(args.set)
        print(text(rep), end="")
        path = args.json or args.set / "c1.json"
    path.write_text(json.dumps(rep, indent=1) + "\n")
    print(f"json: {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
