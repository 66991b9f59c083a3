"""The registered analyses of lab/archive/collapse/CONFIRMATORY.md and C3.md: C1 (does LLDS prevent the
collapse at 5e-4?), C2's goal (does a drift bound keep every starting rate from collapsing?) and C3's
(does the preset match the best fixed rate without a rate search?); and the real-model lab's Stage B
(PREREGISTRATION_real_lm_B.md: do LLDS and the drift bound prevent GRPO's collapse on SmolLM2-135M?).

    python lab/confirmatory.py                 # C1: prints the analysis, writes lab/archive/collapse/c1_5e-4/c1.json
    python lab/confirmatory.py --c2            # C2: writes lab/archive/collapse/c2.json (and, complete, c2.png)
    python lab/confirmatory.py --c3            # C3: writes lab/archive/collapse/c3.json
    python lab/confirmatory.py --controller lab/archive/collapse/c3_pilot_1e-3   # the controller's figures per run
    python lab/confirmatory.py --real-lm-b     # Stage B: writes lab/archive/collapse/real_lm_B/stage_b.json

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

C3 (C3.md), from the sets c3_1e-3 (the preset, arm ``stable``, seeds 30-39), c3_5e-4 and c3_2e-3 (seeds
30-34) and c3_2.5e-4 (plain GRPO, seeds 30-39): (i) 0 collapses by H (hold 30) in every preset arm and
(ii) the primary, the mean paired difference in last-100 reward, preset from 1e-3 minus GRPO at 2.5e-4,
>= 0 with its 95% t interval's (9 df) lower bound above -0.03; met only if both hold. Beside it
(descriptive): the paired differences from 5e-4 and 2e-3 (4 df), GRPO's collapses at 2.5e-4, per preset
run the rate's range, the shares of steps held and below 2.5e-4, the updates applied, the stopped steps
and the median drift over the steps with signal; the optional preset + LLDS arm (c3_llds_1e-3, arm
``stable`` composed with arms/llds.yaml); the demo transfer check (lab/archive/demo/c3_transfer/<arm>/
seed<S>/summary.json, arms shipped, stable_5e-4, stable_2e-3, seeds 3-5: dev EM changes and paired
differences with 2-df t intervals). Until all 30 registered runs are archived the report holds counts
only: "partial: no test computed", as registered.

Stage B (seeds 10-15, GRPO at 1e-3 vs + LLDS vs + configs/stable.yaml, H = 100, hold 30): counts only
until all 18 runs are archived; then P1 (LLDS) and P2 (the bound), each a one-sided exact test that the
arm collapses less than GRPO (stratified by machine kind if they differ), Holm over the two at 0.05,
C1's horizon rule (GRPO's median time to collapse <= H / 2) for the word "prevented"; secondaries the
paired RMST difference (2,000-resample bootstrap) and the last-20 reward's paired difference (95% t
interval, two-sided paired permutation p); per run the first-20 and last-20 means of the paper's
signals and the drift (descriptive).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from lldslight.errors import UserError, script_main
from lldslight.science import collapse as C
from lldslight.run.writes import check_out_file

if __package__:  # lab.confirmatory: imported (tests), or run as python -m lab.confirmatory
    from .collapse import _median
    from .demo_seeds import T975
    from .drift_targets import has_signal
else:  # python lab/confirmatory.py: the script's own folder is on sys.path
    from collapse import _median
    from demo_seeds import T975
    from drift_targets import has_signal

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
# C3's archives (C3.md), (arm, starting rate) -> (set folder, arm folder, seeds): the preset (arm file
# ``stable``) from three starting rates and plain GRPO at the best fixed rate. Every run of these is
# registered; the goal is computed only when all 30 are archived.
C3_SEEDS = tuple(range(30, 40))
C3_SETS = {("stable", "1e-3"): ("c3_1e-3", "stable", C3_SEEDS), ("grpo", "2.5e-4"): ("c3_2.5e-4", "grpo", C3_SEEDS),
           ("stable", "5e-4"): ("c3_5e-4", "stable", C3_SEEDS[:5]), ("stable", "2e-3"): ("c3_2e-3", "stable", C3_SEEDS[:5])}
# The optional arm (the preset + LLDS from 1e-3, seeds 30-34; descriptive only): the runner names a run
# by its arm file, so this set runs ``--arms stable --config lab/configs/arms/llds.yaml`` under its own name.
C3_LLDS = {("stable+llds", "1e-3"): ("c3_llds_1e-3", "stable", C3_SEEDS[:5])}
C3_LLDS_CONFIG = "lab/configs/arms/llds.yaml"
C3_PRIMARY, C3_CONTROL = ("stable", "1e-3"), ("grpo", "2.5e-4")
C3_FLOOR = -0.03  # (ii): the primary interval's lower bound must be above this
C3_SAFE_RATE = 2.5e-4  # the best fixed rate: the share of a preset run's steps below it is reported
# The demo transfer check (C3.md, "Transfer check on the demo"): per arm, seed<S>/summary.json as
# scripts/demo.sh's RunSummary writes it; its dev_em_change is the outcome (dev EM after minus before).
C3_DEMO = ROOT / "lab" / "archive" / "demo" / "c3_transfer"
C3_DEMO_ARMS = ("shipped", "stable_5e-4", "stable_2e-3")  # (a), (b), (c)
C3_DEMO_SEEDS = (3, 4, 5)
# The real-model lab's Stage B (PREREGISTRATION_real_lm_B.md): rate and H fixed by Stage A's table.
B_NAME = "real_lm_B"
B_SEEDS = tuple(range(10, 16))
B_RATE = "1e-3"
B_HORIZON = 100
B_FINAL = 20  # the last-20 reward (steps H-20 .. H-1)
B_ARMS = ("grpo", "llds", "stable")
B_SETS = {(arm, B_RATE): (B_NAME, f"{arm}_{B_RATE}", B_SEEDS) for arm in B_ARMS}
B_SIGNALS = ("lld/logp_pos", "lld/logp_neg", "lld/neg_shared_share", "train/entropy", "drift/kl_k3_last",
             "train/zero_var_groups", "train/lr", "drift/updates")


def training_rows(run: Path, horizon: int = HORIZON):
    """One archived run's training rows up to the horizon (read once, summarised under each hold)."""
    train = C.training_rows(C.read_metrics(run))
    return train[train.index < horizon]


def run_outcome(train, hold: int, horizon: int = HORIZON, final_window: int = 100) -> dict:
    """One run's training rows: time to collapse (censored at H), collapsed by H, the last
    ``final_window`` steps' reward, and the medians over steps of its drift, rate and updates applied."""
    summary = C.summarise(train, C.CollapseCriteria(hold=hold), final_window=final_window)
    time, collapsed = C.time_to_collapse(summary, horizon)
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


def primary(outcomes: dict[str, dict[int, dict]], kinds: dict[int, tuple], treated: str = "llds") -> dict:
    """The registered primary test on complete, paired outcomes (arm -> seed -> outcome): ``treated``
    collapses less often than "grpo" (one-sided, exact; stratified by machine kind when they differ)."""
    strata: dict[tuple, list[int]] = {}
    for seed in sorted(outcomes["grpo"]):
        strata.setdefault(kinds[seed], []).append(seed)
    cells = [(sum(outcomes["grpo"][s]["collapsed"] for s in seeds), len(seeds),
              sum(outcomes[treated][s]["collapsed"] for s in seeds), len(seeds)) for seeds in strata.values()]
    stratified = len(cells) > 1
    p = C.fisher_stratified_one_sided(cells) if stratified else C.fisher_one_sided(*cells[0])
    return {"test": "exact stratified (machine kind)" if stratified else "Fisher exact", "one_sided": True,
            "strata": [{"kind": list(map(str, k)), "seeds": s, "grpo_collapsed": c[0], f"{treated}_collapsed": c[2], "n": c[1]}
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
    meta = C.report_meta(path / "collapse.json")
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


def paired_difference(treated: dict[int, dict], control: dict[int, dict], seeds) -> dict:
    """The mean paired difference in last-100 reward, treated minus control over ``seeds``, with its
    95% t interval (len(seeds) - 1 degrees of freedom); a run without reward rows counts 0."""
    seeds = list(seeds)
    diffs = [(treated[s]["final_reward"] or 0.0) - (control[s]["final_reward"] or 0.0) for s in seeds]
    mean = statistics.fmean(diffs)
    half = T975[len(diffs) - 1] * statistics.stdev(diffs) / len(diffs) ** 0.5
    return {"mean_diff": mean, "low": mean - half, "high": mean + half, "n": len(diffs), "df": len(diffs) - 1}


def c2_goal(outcomes: dict[tuple[str, str], dict[int, dict]]) -> dict:
    """C2's registered goal from complete outcomes: (arm, rate) -> seed -> run_outcome."""
    seeds = sorted(outcomes[("grpo", "2.5e-4")])
    safe = outcomes[("grpo", "2.5e-4")]
    rates = {}
    for rate in ("5e-4", "1e-3"):
        bound, plain = outcomes[("bound", rate)], outcomes[("grpo", rate)]
        diff = paired_difference(bound, safe, seeds)
        collapsed = sum(bound[s]["collapsed"] for s in seeds)
        rates[rate] = {
            "bound_collapsed": collapsed, "n": len(seeds), "held_all": collapsed == 0,
            "reward_vs_2.5e-4": {k: diff[k] for k in ("mean_diff", "low", "high")} | {"at_least_safe_rate": diff["mean_diff"] >= 0},
            "grpo_collapsed": sum(plain[s]["collapsed"] for s in seeds),
            "fisher_p_grpo_vs_bound": C.fisher_one_sided(sum(plain[s]["collapsed"] for s in seeds), len(seeds), collapsed, len(seeds)),
            **{f"bound_{name}": _median([bound[s][key] for s in seeds])
               for key, name in (("lr_median", "lr_median"), ("updates_median", "updates_median"), ("drift_kl_k3_median", "drift_median"))},
        }
    met = all(r["held_all"] and r["reward_vs_2.5e-4"]["at_least_safe_rate"] for r in rates.values())
    return {"seeds": seeds, "horizon": HORIZON, "hold": HOLD, "rates": rates, "goal_met": met,
            "safe_rate_collapsed": sum(safe[s]["collapsed"] for s in seeds)}


def collect(lab: Path, sets: dict[tuple[str, str], tuple[str, str, tuple[int, ...]]], more=None, horizon: int = HORIZON,
            final_window: int = 100) -> tuple[dict, dict, list[str], dict]:
    """The archived runs of ``sets`` ((arm, rate) -> (set folder, arm folder, seeds)): per key, seed ->
    run_outcome (plus ``more(train, outcome)`` when given: it reads the outcome instead of recomputing it)
    with its CPU minutes; seed -> machine kind; the runs
    not readable yet; each set's recorded meta (empty when the set has no collapse.json)."""
    outcomes: dict[tuple[str, str], dict[int, dict]] = {}
    kinds: dict[tuple[str, str], dict[int, list]] = {}
    metas: dict[str, dict] = {}
    missing = []
    for key, (name, arm, seeds) in sets.items():
        outcomes[key], kinds[key] = {}, {}
        report_path = lab / name / "collapse.json"
        if name not in metas:
            metas[name] = C.report_meta(report_path) if report_path.is_file() else {}
        meta_runs = metas[name].get("runs", {})
        kind_of = machine_kinds(meta_runs)
        for seed in seeds:
            run = lab / name / arm / f"seed{seed}"
            gap = not_readable(run, f"{arm}/seed{seed}", kind_of, "set", prefix=f"{name}/")
            if gap:
                missing.append(gap)
                continue
            train = training_rows(run, horizon)
            outcome = run_outcome(train, HOLD, horizon, final_window)
            outcomes[key][seed] = {**outcome, **(more(train, outcome) if more else {})}
            kinds[key][seed] = list(map(str, kind_of[f"{arm}/seed{seed}"]))
            cpu_s = meta_runs[f"{arm}/seed{seed}"].get("cpu_s")  # the run's process CPU time (registered: reported per run)
            outcomes[key][seed]["cpu_min"] = None if cpu_s is None else cpu_s / 60
    return outcomes, kinds, missing, metas


def pairs_across_machines(kinds: dict[tuple[str, str], dict[int, list]], control: tuple[str, str], treated) -> list[int]:
    """Seeds whose ``treated`` runs and ``control`` run ran on different machine kinds (the registrations
    pair a seed's arms on one machine)."""
    return sorted({s for key in treated for s, k in kinds[key].items() if s in kinds[control] and k != kinds[control][s]})


def c2_report(lab: Path = LAB) -> dict:
    """C2's runs from their archives, each with its machine kind (as registered: the goal's pairs,
    bound arm against GRPO at 2.5e-4, stay within a machine; the GRPO-at-5e-4 column may not)."""
    outcomes, kinds, missing, _ = collect(lab, {key: (name, arm, C2_SEEDS) for key, (name, arm) in C2_SETS.items()})
    runs = [{"arm": a, "rate": r, "seed": s, **o, "machine_kind": kinds[(a, r)][s]}
            for (a, r), by_seed in outcomes.items() for s, o in sorted(by_seed.items())]
    # the goal's pairs: a seed's bound runs and its GRPO-at-2.5e-4 run on one machine kind
    across = pairs_across_machines(kinds, ("grpo", "2.5e-4"), [k for k in kinds if k[0] == "bound"])
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


# --------------------------------------------------------------------------- C3 (C3.md)


def controller_figures(train) -> dict:
    """What C3 reports of one preset run (its training rows up to H): the rate's range and median
    (``train/lr``), the share of steps below the best fixed rate, the share of steps the controller
    held (``drift/rate_held`` counts them cumulatively: its last value over the steps), the mean
    updates applied (``drift/updates``), the steps the early stop cut (``drift/stopped``), the median
    ``drift/kl_k3_last`` over the steps with signal and their share. None where a metric is not logged."""
    n = len(train)
    lr = [v for v in C.column(train, "train/lr") or [] if C.finite(v)]
    held = [v for v in C.column(train, "drift/rate_held") or [] if C.finite(v)]
    updates = [v for v in C.column(train, "drift/updates") or [] if C.finite(v)]
    stopped = C.column(train, "drift/stopped")
    kl = C.column(train, "drift/kl_k3_last")
    signal = has_signal(train) if n and kl is not None and "drift/signal" in train.columns else None
    kl_signal = [k for k, s in zip(kl, signal) if s and C.finite(k)] if signal is not None else []
    return {"lr_min": min(lr) if lr else None, "lr_median": _median(lr), "lr_max": max(lr) if lr else None,
            "below_safe_share": sum(v < C3_SAFE_RATE for v in lr) / len(lr) if lr else None,
            "held_share": held[-1] / n if held else None,
            "updates_mean": statistics.fmean(updates) if updates else None,
            "stopped_steps": None if stopped is None else int(sum(v == 1.0 for v in stopped)),
            "signal_share": None if signal is None else sum(signal) / n,
            "kl_signal_median": _median(kl_signal)}


def c3_checks(metas: dict[str, dict], sets: dict) -> list[str]:
    """How the archived C3 sets differ from the registration (their rate, horizon, the LLDS arm's
    config), from each set's recorded meta; empty when they match (or are not started)."""
    problems = []
    for (arm, rate), (name, _, _) in sets.items():
        meta = metas.get(name) or {}
        if not meta:
            continue
        recorded = set_rate(meta)
        if recorded is not None and rate_text(recorded) != rate:
            problems.append(f"{name}: lr {rate_text(recorded)}, registered {rate}")
        if meta.get("horizon") not in (None, HORIZON):
            problems.append(f"{name}: horizon {meta['horizon']}, registered {HORIZON}")
        if arm == "stable+llds" and C3_LLDS_CONFIG not in (meta.get("extra_configs") or []):
            problems.append(f"{name}: no --config {C3_LLDS_CONFIG} (the LLDS arm composes it after the preset)")
    return problems


def c3_goal(outcomes: dict[tuple[str, str], dict[int, dict]]) -> dict:
    """C3's registered goal from complete outcomes ((arm, rate) -> seed -> outcome): (i) no preset run
    collapsed by H, (ii) the primary: last-100 reward, preset from 1e-3 minus GRPO at 2.5e-4 over seeds
    30-39, mean >= 0 with the 95% t interval's lower bound above -0.03; met only if both hold. Beside
    it (descriptive): the other starts' paired differences (4 df), GRPO's collapses at 2.5e-4."""
    control = outcomes[C3_CONTROL]
    preset = {rate: outcomes[(arm, rate)] for (arm, rate) in C3_SETS if arm == "stable"}
    collapsed = {rate: {"collapsed": sum(o["collapsed"] for o in runs.values()), "n": len(runs)} for rate, runs in preset.items()}
    held_all = all(c["collapsed"] == 0 for c in collapsed.values())
    primary = paired_difference(outcomes[C3_PRIMARY], control, C3_SETS[C3_PRIMARY][2])
    primary_ok = primary["mean_diff"] >= 0 and primary["low"] > C3_FLOOR
    return {
        "horizon": HORIZON, "hold": HOLD,
        "preset_collapsed": collapsed, "held_all": held_all,
        "primary": {**primary, "floor": C3_FLOOR, "holds": primary_ok},
        "goal_met": held_all and primary_ok,
        "descriptive": {
            "reward_vs_2.5e-4": {rate: paired_difference(runs, control, sorted(runs)) for rate, runs in preset.items() if rate != "1e-3"},
            "grpo_2.5e-4_collapsed": {"collapsed": sum(o["collapsed"] for o in control.values()), "n": len(control)},
        },
    }


def c3_llds(outcomes: dict[int, dict], control: dict[int, dict]) -> dict:
    """The optional arm, descriptive: its collapses and last-100 reward (with its paired difference
    against GRPO at 2.5e-4 on the same seeds when those ran)."""
    seeds = sorted(outcomes)
    out = {"collapsed": sum(outcomes[s]["collapsed"] for s in seeds), "n": len(seeds),
           "mean_final_reward": statistics.fmean(outcomes[s]["final_reward"] or 0.0 for s in seeds)}
    if len(seeds) > 1 and all(s in control for s in seeds):
        out["reward_vs_2.5e-4"] = paired_difference(outcomes, control, seeds)
    return out


def c3_demo(root: Path = C3_DEMO) -> dict:
    """The demo transfer check: per arm and seed, dev EM after minus before and its paired SE (the run's
    ``dev_em_change``); with all three seeds of an arm and of the shipped arm, the mean paired
    difference against the shipped arm with its 95% t interval (2 df); partial arms give counts only."""
    changes: dict[str, dict[int, dict]] = {arm: {} for arm in C3_DEMO_ARMS}
    for arm in C3_DEMO_ARMS:
        for seed in C3_DEMO_SEEDS:
            summary = root / arm / f"seed{seed}" / "summary.json"
            if summary.is_file():
                record = json.loads(summary.read_text())
                change = record.get("dev_em_change")
                if not change:
                    raise SystemExit(f"confirmatory: {shown(summary)}: no dev_em_change (the demo's evaluations before and after training)")
                changes[arm][seed] = {"change": change["change"], "se": change["se"], "before": change["before"], "after": change["after"],
                                      "answered_after": (record.get("dev_after") or {}).get("answered")}
                metrics = summary.parent / "metrics.csv.gz"
                if metrics.is_file():
                    # The rate trajectory, the held share and the updates applied (C3.md), as for a lab run.
                    changes[arm][seed]["controller"] = controller_figures(C.training_rows(C.read_metrics(summary.parent)))
    archived = sum(map(len, changes.values()))
    out: dict = {"archived": archived, "registered": len(C3_DEMO_ARMS) * len(C3_DEMO_SEEDS), "changes": changes}
    if archived == 0:
        return {"status": "not run", **out}
    shipped = changes[C3_DEMO_ARMS[0]]
    differences = {}
    for arm in C3_DEMO_ARMS[1:]:
        if len(changes[arm]) == len(shipped) == len(C3_DEMO_SEEDS):
            as_outcome = lambda by_seed: {s: {"final_reward": c["change"]} for s, c in by_seed.items()}  # noqa: E731
            differences[arm] = paired_difference(as_outcome(changes[arm]), as_outcome(shipped), C3_DEMO_SEEDS)
    complete = len(differences) == len(C3_DEMO_ARMS) - 1
    return {"status": "complete" if complete else "partial", **out, "difference_vs_shipped": differences}


def c3_report(lab: Path = LAB, demo: Path = C3_DEMO) -> dict:
    """C3 from its archives: while any registered run is missing, counts only ("partial: no test
    computed", as registered); complete, the goal and the figures C3.md lists beside it."""
    sets = {**C3_SETS, **C3_LLDS}
    outcomes, kinds, missing, metas = collect(lab, sets, more=lambda train, _: controller_figures(train))
    problems = c3_checks(metas, sets)
    if problems:
        raise SystemExit(f"confirmatory: not C3's registered sets in {shown(lab)}: {'; '.join(problems)} (C3.md)")
    registered_missing = [m for m in missing if not m.startswith(C3_LLDS[("stable+llds", "1e-3")][0] + "/")]
    counts = {f"{arm} {rate}": {"archived": len(outcomes[(arm, rate)]), "registered": len(seeds)}
              for (arm, rate), (_, _, seeds) in sets.items()}
    demo_rep = c3_demo(demo)
    if registered_missing:
        registered = sum(len(seeds) for _, _, seeds in C3_SETS.values())
        return {"status": "partial", "counts": counts, "archived": registered - len(registered_missing), "registered": registered,
                "missing": missing, "demo": demo_rep if demo_rep["status"] == "complete" else {k: demo_rep[k] for k in ("status", "archived", "registered")},
                "note": "partial: no test computed (C3.md: none on a partial set; counts only)"}
    runs = [{"arm": a, "rate": r, "seed": s, **o, "machine_kind": kinds[(a, r)][s]}
            for (a, r), by_seed in outcomes.items() for s, o in sorted(by_seed.items())]
    across = pairs_across_machines(kinds, C3_CONTROL, [k for k in sets if k != C3_CONTROL])
    llds_key = ("stable+llds", "1e-3")
    llds = (c3_llds(outcomes[llds_key], outcomes[C3_CONTROL]) if len(outcomes[llds_key]) == len(C3_LLDS[llds_key][2])
            else {"status": "not run" if not outcomes[llds_key] else "partial", **counts["stable+llds 1e-3"]})
    if demo_rep["status"] != "complete":
        demo_rep = {k: demo_rep[k] for k in ("status", "archived", "registered")}
    return {"status": "complete", "counts": counts, "runs": runs, "goal_pairs_across_machines": across,
            **c3_goal({k: v for k, v in outcomes.items() if k in C3_SETS}), "llds": llds, "demo": demo_rep}


def controller_text(archive: Path) -> str:
    """Per archived run of one set (``<arm>/seed<S>`` under ``archive``): its steps, collapse (hold 30,
    judged over the set's own horizon) and controller_figures. Descriptive: a pilot decides nothing."""
    if not (archive / "collapse.json").is_file():
        raise SystemExit(f"confirmatory: {archive / 'collapse.json'} not found: --controller must be a set's archive "
                         "(lab/archive/collapse/<name>, written by lab/collapse.py)")
    horizon = C.report_meta(archive / "collapse.json").get("horizon") or HORIZON
    lines = ["| run | steps | collapsed (hold 30) | rate min / median / max | steps below 2.5e-4 | held | updates (mean) "
             "| stopped steps | with signal | drift k3, signal (median) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in sorted(p for p in archive.glob("*/seed*") if any(p.glob("metrics.csv*"))):
        train = C.training_rows(C.read_metrics(run))
        train = train[train.index < horizon]
        time, collapsed = C.time_to_collapse(C.summarise(train, C.CollapseCriteria(hold=HOLD)), horizon)
        f = controller_figures(train)
        lines.append(f"| {run.parent.name}/{run.name} | {len(train)} | {f'yes, step {time:.0f}' if collapsed else 'no'} "
                     f"| {_num(f['lr_min'], '.2e')} / {_num(f['lr_median'], '.2e')} / {_num(f['lr_max'], '.2e')} "
                     f"| {_num(f['below_safe_share'], '.2f')} | {_num(f['held_share'], '.2f')} | {_num(f['updates_mean'], '.2f')} "
                     f"| {f['stopped_steps']} | {_num(f['signal_share'], '.2f')} | {_num(f['kl_signal_median'], '.5f')} |")
    return "\n".join(lines) + "\n"


def _num(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _interval(d: dict) -> str:
    return f"{d['mean_diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] ({d['df']} df)"


def c3_text(rep: dict) -> str:
    lines = ["| arm | starting rate | runs archived of registered |", "|---|---|---|"]
    lines += [f"| {key.split()[0]} | {key.split()[1]} | {c['archived']} of {c['registered']} |" for key, c in rep["counts"].items()]
    lines.append(f"\nDemo transfer check: {rep['demo']['archived']} of {rep['demo']['registered']} runs archived.")
    if rep["status"] == "partial":
        lines.append(f"\n{rep['archived']} of the {rep['registered']} registered runs archived; {rep['note']}.")
        # The demo check is a registered set of its own (descriptive): complete, it is reported whole.
        if rep["demo"]["status"] == "complete":
            lines += ["", c3_demo_text(rep["demo"])]
        return "\n".join(lines) + "\n"
    lines += ["", "| arm | starting rate | seed | collapsed by H | time | last-100 reward | rate min / median / max | steps below 2.5e-4 "
              "| held | updates (mean) | stopped steps | drift k3, signal (median) | CPU min | machine kind |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["runs"]:
        preset = r["arm"] != "grpo"
        rates = f"{_num(r['lr_min'], '.2e')} / {_num(r['lr_median'], '.2e')} / {_num(r['lr_max'], '.2e')}"
        lines.append(f"| {r['arm']} | {r['rate']} | {r['seed']} | {'yes' if r['collapsed'] else 'no'} | {r['time']:.0f} | {_num(r['final_reward'], '.3f')} "
                     f"| {rates} | {_num(r['below_safe_share'], '.2f') if preset else ''} | {_num(r['held_share'], '.2f') if preset else ''} "
                     f"| {_num(r['updates_mean'], '.2f')} | {r['stopped_steps'] if preset else ''} | {_num(r['kl_signal_median'], '.5f')} "
                     f"| {_num(r.get('cpu_min'), '.0f')} | {kind_label(r['machine_kind'])} |")
    if rep["goal_pairs_across_machines"]:
        lines.append(f"\nNot as registered: seeds {rep['goal_pairs_across_machines']} ran a preset arm and GRPO at 2.5e-4 on different machine kinds.")
    c, p = rep["preset_collapsed"], rep["primary"]
    lines += ["", "(i) preset runs collapsed by H (hold 30): " + ", ".join(f"{v['collapsed']} of {v['n']} from {rate}" for rate, v in c.items())
              + f" -> {'holds' if rep['held_all'] else 'fails'}.",
              f"(ii) primary: last-100 reward, preset from 1e-3 minus GRPO at 2.5e-4: {_interval(p)}; needs mean >= 0 and "
              f"lower bound > {C3_FLOOR} -> {'holds' if p['holds'] else 'fails'}.",
              f"Goal: {'met' if rep['goal_met'] else 'not met'}.",
              "Descriptive: " + "; ".join(f"preset from {rate} minus GRPO at 2.5e-4: {_interval(d)}" for rate, d in rep["descriptive"]["reward_vs_2.5e-4"].items())
              + f"; GRPO at 2.5e-4 collapsed {rep['descriptive']['grpo_2.5e-4_collapsed']['collapsed']} of {rep['descriptive']['grpo_2.5e-4_collapsed']['n']}."]
    llds = rep["llds"]
    if "collapsed" in llds:
        lines.append(f"Optional LLDS arm (preset + LLDS from 1e-3): collapsed {llds['collapsed']} of {llds['n']}, mean last-100 reward "
                     f"{llds['mean_final_reward']:.3f}" + (f", minus GRPO at 2.5e-4 {_interval(llds['reward_vs_2.5e-4'])}" if "reward_vs_2.5e-4" in llds else "") + ".")
    else:
        lines.append(f"Optional LLDS arm: {llds['status']} ({llds['archived']} of {llds['registered']}).")
    if rep["demo"]["status"] == "complete":
        lines.append(c3_demo_text(rep["demo"]))
    return "\n".join(lines) + "\n"


def c3_demo_text(demo: dict) -> str:
    """The complete demo transfer check: per arm its three dev EM changes, the paired differences
    against the shipped demo (2 df), and per run the rate trajectory, held share and updates applied."""
    lines = [f"Demo {arm}: dev EM change " + ", ".join(f"seed {s} {c['change']:+.3f} (SE {c['se']:.3f})" for s, c in sorted(by_seed.items())) + "."
             for arm, by_seed in demo["changes"].items()]
    lines += [f"Demo {arm} minus shipped: {_interval(d)}." for arm, d in demo["difference_vs_shipped"].items()]
    lines += ["", "| demo arm | seed | dev EM before -> after | dev answered after | rate min / median / max | held | updates (mean) "
              "| stopped steps | with signal | drift k3, signal (median) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, by_seed in demo["changes"].items():
        for s, c in sorted(by_seed.items()):
            f = c.get("controller") or {}
            lines.append(f"| {arm} | {s} | {c['before']:.3f} -> {c['after']:.3f} | {_num(c.get('answered_after'), '.2f')} "
                         f"| {_num(f.get('lr_min'), '.2e')} / {_num(f.get('lr_median'), '.2e')} / "
                         f"{_num(f.get('lr_max'), '.2e')} | {_num(f.get('held_share'), '.2f')} | {_num(f.get('updates_mean'), '.2f')} "
                         f"| {_num(f.get('stopped_steps'), 'd')} | {_num(f.get('signal_share'), '.2f')} | {_num(f.get('kl_signal_median'), '.5f')} |")
    return "\n".join(lines)


def final_rates(train, window: int) -> dict:
    """One run's answered and tool-call rates over its last ``window`` steps."""
    n = len(train)
    return {f"final_{name}": C.mean_over(C.column(train, key), n - window, n)
            for key, name in (("train/answered_rate", "answered"), ("diag/tool_call_rate", "tool_call"))}


def b_signals(train, _outcome=None) -> dict:
    """Stage B's descriptive figures of one run: its last-20 answered and tool-call rates, and each
    signal's mean over the first and the last 20 steps (the paper's signals next to the drift)."""
    n = len(train)
    out = final_rates(train, B_FINAL)
    for key in B_SIGNALS:
        values = C.column(train, key)
        out[key] = [C.mean_over(values, 0, B_FINAL), C.mean_over(values, n - B_FINAL, n)]
    return out


def prevention_claims(outcomes: dict[str, dict[int, dict]], kinds: dict[int, tuple], words: dict[str, str], horizon: int,
                      horizon_ok: bool) -> dict[str, dict]:
    """The real-model stages' primary family: per arm of ``words`` (arm -> its name in the verdict), the
    one-sided exact test that it collapses less than "grpo", Holm over the family at ALPHA, and the
    registered verdict words (C1's horizon rule decides "prevented")."""
    seeds = sorted(outcomes["grpo"])
    tests = {arm: primary(outcomes, kinds, treated=arm) for arm in words}
    claims = {}
    for (arm, test), p_holm in zip(tests.items(), C.holm([t["p"] for t in tests.values()])):
        passes = p_holm <= ALPHA
        verdict = (f"{words[arm]} prevented the collapse within {horizon} steps" if passes and horizon_ok
                   else f"fewer runs collapsed within {horizon} steps with {words[arm]} (the horizon rule did not hold)" if passes
                   else "not supported: the primary test did not pass (Holm)")
        claims[arm] = {**test, "p_holm": p_holm, "passes": passes, "verdict": verdict,
                       "collapsed": sum(outcomes[arm][s]["collapsed"] for s in seeds)}
    return claims


def paired_secondaries(treated: dict[int, dict], control: dict[int, dict], seeds, horizon: int) -> dict:
    """The real-model stages' paired secondaries, treated minus control: the RMST difference to the
    horizon (2,000-resample paired bootstrap) and the final-window reward's mean difference with its 95%
    t interval and two-sided exact paired permutation p."""
    return {"rmst_difference": C.rmst_difference([(control[s]["time"], control[s]["collapsed"]) for s in seeds],
                                                 [(treated[s]["time"], treated[s]["collapsed"]) for s in seeds], horizon, n_boot=2000),
            "final_reward": paired_difference(treated, control, seeds) | {"permutation_p": C.paired_permutation(
                [control[s]["final_reward"] or 0.0 for s in seeds], [treated[s]["final_reward"] or 0.0 for s in seeds],
                alternative="two-sided")["p"]}}


def b_analyse(outcomes: dict[str, dict[int, dict]], kinds: dict[int, tuple]) -> dict:
    """Stage B's registered tests on complete outcomes (arm -> seed -> outcome): P1 (llds) and P2
    (stable) against grpo, Holm over the two at 0.05, C1's horizon rule; the secondaries."""
    seeds = sorted(outcomes["grpo"])
    g = outcomes["grpo"]
    grpo_median = statistics.median(g[s]["time"] for s in seeds)
    horizon_ok = grpo_median <= B_HORIZON / 2
    claims = prevention_claims(outcomes, kinds, {"llds": "LLDS", "stable": "the drift bound"}, B_HORIZON, horizon_ok)
    for arm, claim in claims.items():
        claim |= paired_secondaries(outcomes[arm], g, seeds, B_HORIZON)
    means = {arm: {k: statistics.fmean(outcomes[arm][s][k] or 0.0 for s in seeds) for k in ("final_reward", "final_answered", "final_tool_call")}
             for arm in B_ARMS}
    return {"seeds": seeds, "horizon": B_HORIZON, "hold": HOLD, "rate": B_RATE, "alpha": ALPHA, "family": "Holm over P1, P2",
            "collapsed": {"grpo": sum(g[s]["collapsed"] for s in seeds), **{a: claims[a]["collapsed"] for a in claims}},
            "grpo_median_time": grpo_median, "horizon_rule_holds": horizon_ok, "claims": claims, "last20_means": means}


def b_report(lab: Path = LAB) -> dict:
    """Stage B from its archive: counts only while a registered run is missing (no test on a partial
    set, as registered); complete, the tests and the secondaries."""
    outcomes, kinds, missing, metas = collect(lab, B_SETS, more=b_signals, horizon=B_HORIZON, final_window=B_FINAL)
    meta = metas.get(B_NAME) or {}
    if meta and meta.get("horizon") not in (None, B_HORIZON):
        raise SystemExit(f"confirmatory: {B_NAME}: horizon {meta['horizon']}, registered {B_HORIZON} (PREREGISTRATION_real_lm_B.md)")
    counts = {arm: {"archived": len(outcomes[(arm, B_RATE)]), "registered": len(B_SEEDS)} for arm in B_ARMS}
    if missing:
        return {"status": "partial", "counts": counts, "missing": missing,
                "note": "partial: no test computed (PREREGISTRATION_real_lm_B.md: none on a partial set; counts only)"}
    runs = [{"arm": a, "seed": s, **o, "machine_kind": kinds[(a, r)][s]} for (a, r), by in outcomes.items() for s, o in sorted(by.items())]
    across = pairs_across_machines(kinds, ("grpo", B_RATE), [("llds", B_RATE), ("stable", B_RATE)])
    if across:
        raise SystemExit(f"confirmatory: {B_NAME}: seeds {across} ran their arms on different machine kinds (registered: one kind per seed)")
    by_arm = {arm: outcomes[(arm, B_RATE)] for arm in B_ARMS}
    seed_kind = {s: tuple(k) for s, k in kinds[("grpo", B_RATE)].items()}
    return {"status": "complete", "counts": counts, "runs": runs, **b_analyse(by_arm, seed_kind)}


def b_text(rep: dict) -> str:
    lines = ["| arm | runs archived of registered |", "|---|---|"]
    lines += [f"| {arm} {B_RATE} | {c['archived']} of {c['registered']} |" for arm, c in rep["counts"].items()]
    if rep["status"] == "partial":
        return "\n".join(lines + ["", f"{rep['note']}."]) + "\n"
    lines += ["", "| arm | seed | collapsed by H (hold 30) | time | last-20 reward | answered | tool calls | machine kind |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arm']} | {r['seed']} | {'yes' if r['collapsed'] else 'no'} | {r['time']:.0f} | {_num(r['final_reward'], '.3f')} "
              f"| {_num(r['final_answered'], '.2f')} | {_num(r['final_tool_call'], '.2f')} | {kind_label(r['machine_kind'])} |" for r in rep["runs"]]
    n = len(rep["seeds"])
    lines += ["", f"Collapsed by H = {B_HORIZON}: GRPO {rep['collapsed']['grpo']} of {n}, LLDS {rep['collapsed']['llds']} of {n}, "
              f"drift bound {rep['collapsed']['stable']} of {n}.",
              f"Horizon rule: GRPO's median time {rep['grpo_median_time']:.0f} vs H / 2 = {B_HORIZON / 2:.0f}: "
              f"{'holds' if rep['horizon_rule_holds'] else 'broken'}."]
    for arm, c in rep["claims"].items():
        rd, fr = c["rmst_difference"], c["final_reward"]
        lines.append(f"{'P1' if arm == 'llds' else 'P2'} ({arm} vs grpo, {c['test']}, one-sided): p = {c['p']:.4f}, Holm {c['p_holm']:.4f} "
                     f"-> {c['verdict']}. RMST {arm} - grpo {rd['diff']:+.1f} steps [{rd['low']:+.1f}, {rd['high']:+.1f}]; "
                     f"last-20 reward {_interval(fr)}, paired permutation p = {fr['permutation_p']:.3f} (two-sided).")
    return "\n".join(lines) + "\n"


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def check_demo(demo: Path) -> None:
    """``--demo`` names the demo transfer check's archive: a folder with its arms' folders. A missing
    folder, a file or another archive counted as "0 of 9 runs archived" and exited 0."""
    what = f"the demo transfer check's archive (a folder of {', '.join(f'{a}/' for a in C3_DEMO_ARMS)})"
    if not demo.exists():
        raise SystemExit(f"confirmatory: --demo {demo}: no such directory; give {what}")
    if not demo.is_dir():
        raise SystemExit(f"confirmatory: --demo {demo}: a file, not {what}")
    if not any((demo / arm).is_dir() for arm in C3_DEMO_ARMS):
        raise SystemExit(f"confirmatory: --demo {demo} holds none of the demo transfer check's arms "
                         f"({', '.join(C3_DEMO_ARMS)}): not its archive")


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return _main(argv)
    except UserError as err:  # a damaged archived file or report (lldslight.science.collapse names it)
        raise SystemExit(f"confirmatory: {err}") from None


def _main(argv: Optional[list[str]]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", type=Path, default=SET, help="C1's archive (default lab/archive/collapse/c1_5e-4)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--c2", action="store_true", help="C2's goal instead, from lab/archive/collapse/c2_* and C1's GRPO runs")
    which.add_argument("--c3", action="store_true", help="C3's goal instead, from lab/archive/collapse/c3_* and the demo's c3_transfer")
    which.add_argument("--real-lm-b", action="store_true",
                       help="the real-model lab's Stage B (lab/archive/collapse/real_lm_B, PREREGISTRATION_real_lm_B.md)")
    which.add_argument("--controller", type=Path, default=None, metavar="ARCHIVE",
                       help="print the rate controller's figures C3 reports, per run of one set's archive (e.g. C3's pilot); no test")
    parser.add_argument("--demo", type=Path, default=None, help="with --c3: the demo transfer check's archive (default lab/archive/demo/c3_transfer)")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write the analysis (default SET/c1.json; with --c2 / --c3, c2.json / c3.json beside the sets)")
    args = parser.parse_args(argv)
    if args.controller is not None:
        print(controller_text(args.controller), end="")
        return 0
    if args.json is not None:  # before the analysis: a directory, a missing or read-only folder fails at the end otherwise
        try:
            check_out_file(args.json, "--json")
        except UserError as err:
            raise SystemExit(f"confirmatory: {err}") from None
    if args.demo is not None and args.c3:
        check_demo(args.demo)
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
    elif args.c3:
        lab = args.set.parent
        if not ((lab / "C3.md").is_file() or any((lab / name / "collapse.json").is_file() for name, _, _ in {**C3_SETS, **C3_LLDS}.values())):
            raise SystemExit(f"confirmatory: neither C3.md nor a C3 set (c3_*/collapse.json) in {lab}: with --c3, "
                             "--set must be a set inside the lab's archive (lab/archive/collapse/<name>)")
        rep = c3_report(lab, args.demo or C3_DEMO)
        print(c3_text(rep), end="")
        path = args.json or lab / "c3.json"
    elif args.real_lm_b:
        rep = b_report(args.set.parent)
        print(b_text(rep), end="")
        path = args.json or args.set.parent / B_NAME / "stage_b.json"
        if not path.parent.is_dir():
            raise SystemExit(f"confirmatory: {shown(path.parent)}: no Stage B archive yet (lab/collapse.py --name {B_NAME} makes it)")
    else:
        rep = report(args.set)
        print(text(rep), end="")
        path = args.json or args.set / "c1.json"
    path.write_text(json.dumps(rep, indent=1) + "\n")
    print(f"json: {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
