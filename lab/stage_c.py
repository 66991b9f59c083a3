"""Stage C of the real-model lab, analysed exactly as lab/archive/collapse/PREREGISTRATION_real_lm_C.md registers it.

    python lab/stage_c.py            # prints the analysis, writes lab/archive/collapse/real_lm_C/stage_c.json

The set: ``lab/collapse.py --name real_lm_C`` (SmolLM2-135M, the real-model recipe, H = 80, hold 30),
seeds 20-31, four arms: plain GRPO at 2e-3 (``grpo_2e-3``), + LLDS (``llds_2e-3``), the preset with its
start phase and ceiling 2e-3 (``slowstart_skip_2e-3``) and plain GRPO at the best fixed rate (``grpo_5e-4``).
Everything is recomputed from the archived per-step metrics (``lldslight.science.collapse``), nothing
from the runner's report. Until all 48 runs are archived the report holds counts only (registered: no
test on a partial set). Then:

- **P1** (LLDS) and **P2** (the preset): collapsed by H against GRPO at 2e-3, one-sided exact tests
  (Fisher; stratified by machine kind if the seeds ran on more than one), Holm over the two at 0.05;
  the horizon rule (GRPO's median time to collapse <= H / 2) for the word "prevented";
- **P3**, its own test at one-sided 0.05: per seed d = the preset's last-20 reward minus the best fixed
  rate's; exact Wilcoxon signed-rank test that the median of d + 0.05 is above 0 (zeros dropped);
- **secondaries**: paired RMST differences to H (2,000-resample bootstrap), last-20 reward differences
  (95% t interval, two-sided paired permutation p), last-20 answered and tool-call rates;
- **the paper's signals before each death** (descriptive, every arm): the means of lld/delta_correct,
  lld/delta_incorrect, the drift, entropy, answered and tool-call rates over the 10 steps before the
  death step (the first step of the unbroken run of zero-reward steps holding the collapse step; the
  collapse step if its reward is not 0) and over the run's first 10 steps; the step of the most negative lld/delta_correct and
  of the largest drift in those 10; the phase detector's first warning (lld/warning) and the collapse
  alarm replayed offline (``replay_alarm``) with the registered short baseline (``ALARM``): its first
  firing and lead, and its firings in runs that held (false alarms);
- **post hoc** (added after seeds 20-26 were seen; descriptive, never a test: ``at_horizon``): where each
  run stood when H ended it: the longer unbroken stretch, ending at its last step, on which one of the
  rule's two conditions held, and its trailing-20 reward's peak. A run that held by the rule
  with a long stretch there was dying, not kept alive, when the horizon stopped it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Optional

from lldslight.errors import UserError, script_main
from lldslight.science import collapse as C
from lldslight.science.alarm import AlarmConfig, replay_alarm
from lldslight.run.writes import check_out_file

if __package__:  # lab.stage_c: imported (tests), or run as python -m lab.stage_c
    from .confirmatory import (ALPHA, HOLD, LAB, collect, final_rates, kind_label, pairs_across_machines, paired_secondaries,
                               prevention_claims, shown)
else:  # python lab/stage_c.py: the script's own folder is on sys.path
    from confirmatory import (ALPHA, HOLD, LAB, collect, final_rates, kind_label, pairs_across_machines, paired_secondaries,
                              prevention_claims, shown)

NAME = "real_lm_C"
SEEDS = tuple(range(20, 32))
HORIZON = 80
FINAL = 20  # the last-20 reward: steps 60-79
MARGIN = 0.05  # P3's non-inferiority margin, in reward
BEFORE = 10  # the signals' window before each collapse
# role -> (rate, the arm's folder): the roles the registration names; collect() keys on (role, rate).
ROLES = {"grpo": ("2e-3", "grpo_2e-3"), "llds": ("2e-3", "llds_2e-3"), "preset": ("2e-3", "slowstart_skip_2e-3"),
         "best": ("5e-4", "grpo_5e-4")}
SETS = {(role, rate): (NAME, folder, SEEDS) for role, (rate, folder) in ROLES.items()}
SIGNALS = ("lld/delta_correct", "lld/delta_incorrect", "drift/kl_k3_last", "train/entropy", "train/answered_rate",
           "diag/tool_call_rate")
# The alarm's shipped baseline (steps 40-140) ends after Stage A's collapses at 2e-3 (step 19): the
# registered replay uses a baseline that fits 80 steps; everything else is AlarmConfig's default.
ALARM = AlarmConfig(baseline_start=2, baseline_end=12, baseline_min=8, share_window=10, share_min=5, reward_window=10)


def _mean(values: list[float]) -> Optional[float]:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


def _extreme(steps: list[int], values: list[float], pick) -> Optional[list]:
    """[step, value] of the smallest (pick=min) or largest value among the finite ones, else None."""
    pairs = [(v, s) for s, v in zip(steps, values) if math.isfinite(v)]
    if not pairs:
        return None
    v, s = pick(pairs)
    return [s, v]


def death_step(steps: list[int], reward: list[float], collapse: int) -> int:
    """Where the signals' window ends: the first step of the unbroken run of zero-reward steps that holds
    the collapse step (the rule's step lags a sudden death by up to its 20-step trailing mean: Stage A's
    GRPO at 2e-3 earned nothing from step 6 and the rule named step 19); the collapse step itself when
    its reward is not 0."""
    at = {s: r for s, r in zip(steps, reward)}
    if at.get(collapse) != 0:
        return collapse
    death = collapse
    while at.get(death - 1) == 0:
        death -= 1
    return death


def signals(train, outcome: dict) -> dict:
    """One run's descriptive figures (the registration's "paper's signals before each death"): its
    collapse step under the registered rule; the first 10 steps' and, if it collapsed, the 10 steps
    before its death step's (``death_step``) mean of each signal, with the steps of the most negative Delta correct
    and of the largest drift there; the first lld/warning; the replayed alarm's firings."""
    time, collapsed = outcome["time"], outcome["collapsed"]  # collect's run_outcome under the registered rule
    steps = [int(s) for s in train.index]
    cols = {key: C.column(train, key) or [math.nan] * len(steps) for key in SIGNALS}
    first = {key: _mean(cols[key][:BEFORE]) for key in SIGNALS}
    out: dict = {"signals_first10": first, "signals_before": None, "death_step": None}
    if collapsed:
        death = death_step(steps, C.column(train, "train/reward") or [], int(time))
        out["death_step"] = death
        inside = [i for i, s in enumerate(steps) if death - BEFORE <= s < death]
        window = {key: [cols[key][i] for i in inside] for key in SIGNALS}
        at = [steps[i] for i in inside]
        out["signals_before"] = {key: _mean(window[key]) for key in SIGNALS} | {
            "most_negative_delta_correct": _extreme(at, window["lld/delta_correct"], min),
            "largest_drift": _extreme(at, window["drift/kl_k3_last"], max)}
    warning = C.column(train, "lld/warning") or []
    out["first_lld_warning"] = next((s for s, w in zip(steps, warning) if math.isfinite(w) and w > 0), None)
    replay = replay_alarm(train, ALARM)
    fired = [int(s) for s, f in zip(replay["step"], replay.get("alarm/fired", [])) if math.isfinite(f) and f > 0]
    out["alarm_firings"] = fired
    out["alarm_lead"] = (time - fired[0]) if collapsed and fired and fired[0] <= time else None
    out["alarm_false"] = None if collapsed else len(fired)
    return out


def _final_stretch(flags: list[bool]) -> int:
    """How many consecutive flags, ending at the last one, are True."""
    stretch = 0
    for flagged in reversed(flags):
        if not flagged:
            break
        stretch += 1
    return stretch


def at_horizon(train) -> dict:
    """Post hoc, descriptive (added after seeds 20-26, stated beside P1): the collapse rule's own flags
    (``reward_low`` and ``answered_low`` under ``CollapseCriteria(hold=HOLD)``), read at the horizon.
    ``flagged_at_h``: the longer of the two conditions' unbroken stretches ending at the run's last
    step; each condition counts on its own, as ``find_collapse`` holds each on its own, so a run held
    by the rule has fewer than HOLD (a stretch of steps flagged by either condition in turn could be
    longer without being a collapse); ``trailing_peak`` / ``trailing_at_h``: the trailing-20 reward's
    running peak and its value at the last step (None when never finite)."""
    crit = C.CollapseCriteria(hold=HOLD)
    reward = C.column(train, "train/reward") or []
    answered = C.column(train, "train/answered_rate")
    stretch = max(_final_stretch(C.reward_low(reward, crit)),
                  _final_stretch(C.answered_low(answered, crit)) if answered is not None else 0)
    smooth = C.trailing_mean(reward, crit.smooth)
    peak = C.running_peak(smooth)
    last = lambda values: values[-1] if values and math.isfinite(values[-1]) else None  # noqa: E731
    return {"flagged_at_h": stretch, "trailing_peak": last(peak), "trailing_at_h": last(smooth)}


def held_at_horizon(outcomes: dict[str, dict[int, dict]], seeds: list[int]) -> dict:
    """Per arm, its runs that held by the rule, and among them those still inside the collapse
    condition at H (``flagged_at_h`` > 0), with each stretch (post hoc, descriptive)."""
    out = {}
    for role in ROLES:
        held = [s for s in seeds if not outcomes[role][s]["collapsed"]]
        inside = {s: outcomes[role][s]["flagged_at_h"] for s in held if outcomes[role][s]["flagged_at_h"] > 0}
        peaks = [outcomes[role][s]["trailing_peak"] for s in seeds if outcomes[role][s]["trailing_peak"] is not None]
        out[role] = {"held": len(held), "inside_at_h": len(inside), "stretches": inside,
                     "trailing_peak_range": [min(peaks), max(peaks)] if peaks else None}
    return out


def wilcoxon_p3(d: list[float]) -> dict:
    """P3: exact Wilcoxon signed-rank test that the median of d + MARGIN is above 0 (zeros dropped)."""
    from scipy.stats import wilcoxon

    shifted = [x + MARGIN for x in d]
    kept = [x for x in shifted if x != 0]
    res = wilcoxon(kept, alternative="greater", method="exact")
    return {"test": "exact Wilcoxon signed-rank, one-sided (median of d + margin > 0)", "margin": MARGIN,
            "n": len(kept), "statistic": float(res.statistic), "p": float(res.pvalue), "alpha": ALPHA,
            "passes": float(res.pvalue) <= ALPHA, "median_d": statistics.median(d)}


def analyse(outcomes: dict[str, dict[int, dict]], kinds: dict[int, tuple]) -> dict:
    """The registered tests and secondaries on complete outcomes (role -> seed -> outcome)."""
    seeds = sorted(outcomes["grpo"])
    g = outcomes["grpo"]
    grpo_median = statistics.median(g[s]["time"] for s in seeds)
    horizon_ok = grpo_median <= HORIZON / 2
    claims = prevention_claims(outcomes, kinds, {"llds": "LLDS", "preset": "the preset's drift bound"}, HORIZON, horizon_ok)
    preset, best = outcomes["preset"], outcomes["best"]
    d = [(preset[s]["final_reward"] or 0.0) - (best[s]["final_reward"] or 0.0) for s in seeds]
    p3 = wilcoxon_p3(d)
    p3["verdict"] = (f"the preset's last-20 reward is not worse than GRPO's at its best fixed rate by more than {MARGIN}"
                     if p3["passes"] else "not supported: P3 did not pass")
    secondary = {}
    for role, control in (("llds", "grpo"), ("preset", "grpo"), ("best", "grpo"), ("preset", "best")):
        secondary[f"{role}-{control}"] = paired_secondaries(outcomes[role], outcomes[control], seeds, HORIZON)
    means = {role: {k: _mean([outcomes[role][s][k] if outcomes[role][s][k] is not None else math.nan for s in seeds])
                    for k in ("final_reward", "final_answered", "final_tool_call")} for role in ROLES}
    return {"seeds": seeds, "horizon": HORIZON, "hold": HOLD, "alpha": ALPHA, "family": "Holm over P1, P2",
            "collapsed": {role: sum(outcomes[role][s]["collapsed"] for s in seeds) for role in ROLES},
            "grpo_median_time": grpo_median, "horizon_rule_holds": horizon_ok, "claims": claims, "p3": p3,
            "p3_differences": dict(zip(seeds, d)), "secondary": secondary, "last20_means": means,
            "post_hoc_at_horizon": held_at_horizon(outcomes, seeds)}


def report(lab: Path = LAB) -> dict:
    """Stage C from its archive: counts only while a registered run is missing; complete, the analysis."""
    outcomes, kinds, missing, metas = collect(lab, SETS, more=lambda t, o: {**final_rates(t, FINAL), **signals(t, o), **at_horizon(t)},
                                              horizon=HORIZON, final_window=FINAL)
    meta = metas.get(NAME) or {}
    if meta and meta.get("horizon") not in (None, HORIZON):
        raise SystemExit(f"stage_c: {NAME}: horizon {meta['horizon']}, registered {HORIZON} (PREREGISTRATION_real_lm_C.md)")
    counts = {role: {"archived": len(outcomes[(role, rate)]), "registered": len(SEEDS)} for role, (rate, _) in ROLES.items()}
    runs = [{"role": role, "seed": s, **o, "machine_kind": kinds[(role, rate)][s]}
            for role, (rate, _) in ROLES.items() for s, o in sorted(outcomes[(role, rate)].items())]
    if missing:
        return {"status": "partial", "counts": counts, "missing": missing, "runs": runs,
                "note": "partial: no test computed (PREREGISTRATION_real_lm_C.md: none on a partial set; counts only)"}
    control = ("grpo", ROLES["grpo"][0])
    across = pairs_across_machines(kinds, control, [(r, rate) for r, (rate, _) in ROLES.items() if r != "grpo"])
    if across:
        raise SystemExit(f"stage_c: {NAME}: seeds {across} ran their arms on different machine kinds (registered: one kind per seed)")
    by_role = {role: outcomes[(role, rate)] for role, (rate, _) in ROLES.items()}
    seed_kind = {s: tuple(k) for s, k in kinds[control].items()}
    return {"status": "complete", "counts": counts, "runs": runs, **analyse(by_role, seed_kind)}


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def text(rep: dict) -> str:
    lines = ["| arm | runs archived of registered |", "|---|---|"]
    lines += [f"| {role} ({ROLES[role][1]}) | {c['archived']} of {c['registered']} |" for role, c in rep["counts"].items()]
    if rep["runs"]:
        lines += ["", "| arm | seed | collapsed by H | time | last-20 reward | answered | tool calls | alarm (lead) | machine kind "
                  "| flagged at H (post hoc) | trailing-20 peak |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rep["runs"]:
            alarm = (f"{r['alarm_firings'][0]} ({_num(r['alarm_lead'], '.0f')})" if r["alarm_firings"] else "none")
            lines.append(f"| {r['role']} | {r['seed']} | {'yes' if r['collapsed'] else 'no'} | {r['time']:.0f} "
                         f"| {_num(r['final_reward'], '.3f')} | {_num(r['final_answered'], '.2f')} | {_num(r['final_tool_call'], '.2f')} "
                         f"| {alarm} | {kind_label(r['machine_kind'])} | {r['flagged_at_h']} | {_num(r['trailing_peak'], '.3f')} |")
        dead = [r for r in rep["runs"] if r["signals_before"]]
        if dead:
            lines += ["", "Signals over the 10 steps before each death (first 10 steps in brackets):", "",
                      "| arm | seed | collapse (death) | Delta correct | Delta incorrect | drift | entropy | answered | tool calls | "
                      "most negative Delta correct (step) | largest drift (step) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in dead:
                b, f = r["signals_before"], r["signals_first10"]
                cells = " | ".join(f"{_num(b[k], '+.3f')} ({_num(f[k], '+.3f')})" for k in SIGNALS)
                neg, big = b["most_negative_delta_correct"], b["largest_drift"]
                lines.append(f"| {r['role']} | {r['seed']} | {r['time']:.0f} ({r['death_step']}) | {cells} | "
                             f"{'-' if neg is None else f'{neg[1]:+.3f} ({neg[0]})'} | {'-' if big is None else f'{big[1]:.4f} ({big[0]})'} |")
    if rep["status"] == "partial":
        return "\n".join(lines + ["", f"{rep['note']}."]) + "\n"
    n = len(rep["seeds"])
    c = rep["collapsed"]
    lines += ["", f"Collapsed by H = {HORIZON}: GRPO 2e-3 {c['grpo']} of {n}, LLDS {c['llds']} of {n}, preset {c['preset']} of {n}, "
              f"GRPO 5e-4 {c['best']} of {n}.",
              f"Horizon rule: GRPO's median time {rep['grpo_median_time']:.0f} vs H / 2 = {HORIZON / 2:.0f}: "
              f"{'holds' if rep['horizon_rule_holds'] else 'broken'}."]
    for role, cl in rep["claims"].items():
        lines.append(f"{'P1' if role == 'llds' else 'P2'} ({role} vs grpo, {cl['test']}, one-sided): p = {cl['p']:.4f}, "
                     f"Holm {cl['p_holm']:.4f} -> {cl['verdict']}.")
    p3 = rep["p3"]
    lines.append(f"P3 (preset - best, last-20 reward, margin {MARGIN}): median d {p3['median_d']:+.3f}, {p3['test']}, "
                 f"n {p3['n']}, p = {p3['p']:.4f} -> {p3['verdict']}.")
    lines.append(f"Post hoc (added after seeds 20-26 were seen; descriptive, not a test): runs held by the rule but inside "
                 f"the collapse condition when H ended them (unbroken flagged steps at H; hold {HOLD}):")
    for role, h in rep["post_hoc_at_horizon"].items():
        stretches = ", ".join(f"seed {s}: {n}" for s, n in h["stretches"].items()) or "none"
        peak = h["trailing_peak_range"]
        lines.append(f"- {role}: {h['inside_at_h']} of {h['held']} held ({stretches}); trailing-20 reward peak "
                     f"{'-' if peak is None else f'{peak[0]:.2f}-{peak[1]:.2f}'} over its {n} runs.")
    for pair, s in rep["secondary"].items():
        rd, fr = s["rmst_difference"], s["final_reward"]
        lines.append(f"{pair}: RMST {rd['diff']:+.1f} steps [{rd['low']:+.1f}, {rd['high']:+.1f}]; last-20 reward "
                     f"{fr['mean_diff']:+.3f} [{fr['low']:+.3f}, {fr['high']:+.3f}], paired permutation p = {fr['permutation_p']:.3f} (two-sided).")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lab", type=Path, default=LAB, help="the lab's archive (default lab/archive/collapse)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the analysis (default LAB/real_lm_C/stage_c.json)")
    args = parser.parse_args(argv)
    if args.json is not None:
        try:
            check_out_file(args.json, "--json")
        except UserError as err:
            raise SystemExit(f"stage_c: {err}") from None
    path = args.json or args.lab / NAME / "stage_c.json"
    if args.json is None and not path.parent.is_dir():
        raise SystemExit(f"stage_c: {shown(path.parent)}: no Stage C archive yet (lab/collapse.py --name {NAME} makes it)")
    try:
        rep = report(args.lab)
    except UserError as err:  # a damaged archived file (lldslight.science.collapse names it)
        raise SystemExit(f"stage_c: {err}") from None
    print(text(rep), end="")
    path.write_text(json.dumps(rep, indent=1) + "\n")
    print(f"json: {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
