"""The committed lab evidence: every report under lab/archive/collapse/ is recomputed from its
archived per-step metrics (``lab/collapse.py --report-only``) and must equal the committed one, and
every figure that docs/results.md, the README's results table and docs/lab/demo_studies.md quote is
recomputed here from the archives with this file's own code (scipy's tests, the csv module), so no
number of the record can drift from the data it claims to summarise."""
from __future__ import annotations

import csv
import gzip
import itertools
import json
import shutil
import statistics
from pathlib import Path

import pytest
from conftest import ROOT, load_lab

LAB = ROOT / "lab" / "archive" / "collapse"
DEMO = ROOT / "lab" / "archive" / "demo"


def page(*parts: str) -> str:
    """A page's text with its line breaks and runs of spaces folded to one space."""
    return " ".join(ROOT.joinpath(*parts).read_text().split())


def current_runner_sets() -> list[str]:
    """Sets written by today's runner: their collapse.json has a ``horizon`` (the earlier lab's
    reports, lab/archive/collapse/plateau/ and single_seed/, were judged by the runner of commit
    d613d79 under other criteria and are kept as they were)."""
    out = []
    for report in sorted(LAB.glob("*/collapse.json")):
        if "horizon" in json.loads(report.read_text()):
            out.append(report.parent.name)
    return out


SETS = current_runner_sets()


@pytest.fixture(scope="module")
def collapse():
    return load_lab("collapse")


@pytest.mark.parametrize("name", SETS)
def test_committed_report_is_recomputed_from_its_metrics(collapse, name: str, tmp_path: Path) -> None:
    src, dst = LAB / name, tmp_path / name
    # Only the evidence travels: per-run metrics and summaries, and collapse.json's meta (commands,
    # CPU time); the committed table and figure are what is checked, so they stay behind.
    for run in src.glob("*/seed*"):
        (dst / run.relative_to(src)).mkdir(parents=True)
        for f in ("metrics.csv.gz", "summary.json"):
            if (run / f).is_file():
                shutil.copy(run / f, dst / run.relative_to(src) / f)
    shutil.copy(src / "collapse.json", dst / "collapse.json")
    assert collapse.main(["--name", name, "--report-only", "--no-figure", "--archive", str(dst)]) == 0
    reports = ("collapse.md", "collapse.json")
    if not (src / "collapse.md").is_file():
        # A registered set under way commits its run record (collapse.json: each run's machine kind and
        # CPU time) after every sitting, but not the runner's table: its per-arm tests on a partial set
        # are not the registered analysis. Only Stage C may be in that state, and only while runs are
        # missing; once all are archived, its table must be committed like every other set's.
        stage_c = load_lab("stage_c")
        archived = len(list(src.glob("*/seed*/summary.json")))
        assert name == stage_c.NAME and archived < len(stage_c.ROLES) * len(stage_c.SEEDS), (
            f"lab/archive/collapse/{name}/collapse.md is missing: run "
            f"`python lab/collapse.py --name {name} --report-only`")
        reports = ("collapse.json",)
    # byte for byte, as lab/README.md promises of the rerun it documents
    for report in reports:
        assert (dst / report).read_bytes() == (src / report).read_bytes(), (
            f"lab/archive/collapse/{name}/{report} differs from its recomputation: run "
            f"`python lab/collapse.py --name {name} --report-only`")


def _arm_runs(name: str, arm: str) -> dict[int, dict]:
    from lldslight.science import collapse as C

    out = {}
    for run in sorted((LAB / name / arm).glob("seed*")):
        frame = C.read_metrics(run)
        out[int(run.name[4:])] = C.summarise(frame[frame["train/reward"].notna()])
    return out


def _fisher(k_a: int, n_a: int, k_b: int, n_b: int) -> float:
    """scipy's one-sided Fisher exact p of "arm a collapses more often than arm b"."""
    from scipy.stats import fisher_exact

    return float(fisher_exact([[k_a, n_a - k_a], [k_b, n_b - k_b]], alternative="greater").pvalue)


def _holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment, written out: sort, multiply the i-th smallest by (m - i),
    carry the running maximum, cap at 1, then back to the given order."""
    m = len(pvalues)
    ranked = sorted(enumerate(pvalues), key=lambda kv: kv[1])
    out, running = {}, 0.0
    for i, (index, p) in enumerate(ranked):
        running = max(running, min(1.0, (m - i) * p))
        out[index] = running
    return [out[i] for i in range(m)]


def _collapsed(runs: dict[int, dict], horizon: int = 600) -> int:
    return sum(bool(s["collapsed"]) and s["step"] < horizon for s in runs.values())


def _columns(run: Path, keys) -> dict[str, dict[int, float]]:
    """Columns ``keys`` of a run's archived metrics, each step -> value, in one read with the csv module
    (not lldslight/science/collapse.py nor lab/heal_eval.py); a step logged on several rows keeps its last value."""
    out: dict[str, dict[int, float]] = {key: {} for key in keys}
    with gzip.open(run / "metrics.csv.gz", "rt") as f:
        for r in csv.DictReader(f):
            if r.get("step"):
                for key in keys:
                    if r.get(key):
                        out[key][int(float(r["step"]))] = float(r[key])
    return out


def _by_step(run: Path, key: str) -> dict[int, float]:
    """Column ``key`` of a run's archived metrics, step -> value (``_columns`` for one key)."""
    return _columns(run, (key,))[key]


def _last100(rewards: dict[int, float]) -> float:
    """Mean of the last 100 logged steps' values."""
    last = sorted(rewards)[-100:]
    return sum(rewards[s] for s in last) / len(last)


def _last100_mean_reward(run: Path) -> float:
    """Mean train/reward over the last 100 logged steps."""
    return _last100(_by_step(run, "train/reward"))


def _t_interval(d: list[float], t975: float) -> tuple[float, float, float]:
    """The mean of paired differences ``d`` with its 95% t interval, Student's t quantile given."""
    mean = statistics.fmean(d)
    half = t975 * statistics.stdev(d) / len(d) ** 0.5
    return mean, mean - half, mean + half


def _paired_set(name: str, other: str) -> dict:
    """GRPO against ``other`` in set ``name``, seeds 10-14, from the per-step metrics: collapse
    counts, scipy's one-sided Fisher p, the last-100 mean rewards (csv module) and their exact
    paired permutation p (other - GRPO, one-sided)."""
    runs = {arm: _arm_runs(name, arm) for arm in ("grpo", other)}
    assert {arm: sorted(r) for arm, r in runs.items()} == {"grpo": [10, 11, 12, 13, 14], other: [10, 11, 12, 13, 14]}
    k = {arm: _collapsed(r) for arm, r in runs.items()}
    last = {arm: {s: _last100_mean_reward(LAB / name / arm / f"seed{s}") for s in range(10, 15)} for arm in runs}
    d = [last[other][s] - last["grpo"][s] for s in range(10, 15)]
    flips = [sum(x * f for x, f in zip(d, signs)) for signs in itertools.product((1, -1), repeat=5)]
    return {"runs": runs, "collapsed": k, "fisher_p": _fisher(k["grpo"], 5, k[other], 5),
            "last100": {arm: statistics.fmean(v.values()) for arm, v in last.items()},
            "permutation_p": sum(f >= sum(d) - 1e-12 for f in flips) / len(flips)}


def _row(key: str) -> str:
    """The line of docs/results.md's table whose first cell is ``key``."""
    table = [l for l in (ROOT / "docs" / "results.md").read_text().splitlines() if l.count("|") == 10]  # the 9-column table
    (line,) = [l for l in table if l.startswith(f"| {key} |")]
    return line


PRIMARY = [("final", "onpolicy"), ("final", "llds"), ("final_5e-4", "llds"), ("final_5e-4_epyc", "onpolicy"), ("final_5e-4_epyc", "llds")]


@pytest.fixture(scope="module")
def primary() -> dict:
    """The five registered primary-endpoint tests, recomputed: {(set, arm): _paired_set}."""
    for name, arm in PRIMARY:
        if not (LAB / name / arm).is_dir():
            pytest.skip(f"{name}/{arm} is not archived")
    return {(name, arm): _paired_set(name, arm) for name, arm in PRIMARY}


def test_rates_7e4_recomputed_independently(primary) -> None:
    """R1 and R3 (7e-4, Xeon) and the README card's rows for them: counts, Fisher p, Holm over the
    five primary tests, median collapse steps of the collapsed runs, the sign test."""
    from scipy.stats import binomtest

    holm = dict(zip(PRIMARY, _holm([primary[k]["fisher_p"] for k in PRIMARY])))
    twin, llds = primary[("final", "onpolicy")], primary[("final", "llds")]
    k_grpo = twin["collapsed"]["grpo"]
    r1, r3 = _row("R1"), _row("R3")
    assert f"collapsed {k_grpo} of 5 vs {twin['collapsed']['onpolicy']} of 5" in r1
    assert f"| {twin['fisher_p']:.3f} (Holm over 5: {holm[('final', 'onpolicy')]:.3f}) | supported |" in r1
    runs = llds["runs"]
    median = {arm: statistics.median(s["step"] for s in r.values() if s["collapsed"]) for arm, r in runs.items()}
    later = sum((runs["llds"][s]["step"] if runs["llds"][s]["collapsed"] else 600) > (runs["grpo"][s]["step"] if runs["grpo"][s]["collapsed"] else 600)
                for s in runs["grpo"])
    p_sign = binomtest(later, 5, 0.5, alternative="greater").pvalue
    assert later == 5 and "delayed in every pair" in r3
    assert f"{k_grpo} of 5 vs {llds['collapsed']['llds']} of 5; delayed in every pair (median collapse step {median['llds']:g} vs {median['grpo']:g})" in r3
    assert f"| {llds['fisher_p']:.2f}; {p_sign:.3f} |" in r3
    card = _readme_row("off-policy drift drives this collapse")
    assert f"| lab, 7e-4: GRPO {k_grpo} of 5 collapsed, its on-policy twin {twin['collapsed']['onpolicy']} of 5 (p = {twin['fisher_p']:.3f}) |" in card
    card = _readme_row("LLDS prevents it")
    assert f"| lab, 7e-4: {llds['collapsed']['llds']} of 5 collapsed with LLDS vs {k_grpo} of 5 (p = {llds['fisher_p']:.2f}) |" in card


def test_llds_5e4_record_recomputed_independently(primary) -> None:
    """R4 and R5 and the reasons R4 is only suggestive: counts, Fisher and Holm p, last-100
    rewards and their permutation p, GRPO's median time to collapse (censored at 600) against
    H / 2, the recount with the condition held 30 steps, and the paired RMST interval quoted as
    the report computed it."""
    holm = dict(zip(PRIMARY, _holm([primary[k]["fisher_p"] for k in PRIMARY])))
    xeon, epyc = primary[("final_5e-4", "llds")], primary[("final_5e-4_epyc", "llds")]
    k, mean = xeon["collapsed"], xeon["last100"]
    r4, r5 = _row("R4"), _row("R5")
    assert f"{k['grpo']} of 5 vs {k['llds']} of 5; last-100 reward {mean['grpo']:.2f} vs {mean['llds']:.2f}" in r4
    assert f"| {xeon['fisher_p']:.3f} (Holm over 5: {holm[('final_5e-4', 'llds')]:.3f}); {xeon['permutation_p']:.3f} | suggestive, not confirmatory" in r4
    assert f"| {epyc['collapsed']['grpo']} of 5 vs {epyc['collapsed']['llds']} of 5 |" in r5 and f"| {epyc['fisher_p']:.2f} | not replicated |" in r5
    results = page("docs", "results.md")
    # (i) the horizon rule: GRPO's median time to collapse, runs that did not collapse counted at 600
    ttc = {name: statistics.median(s["step"] if s["collapsed"] and s["step"] < 600 else 600 for s in primary[(name, "llds")]["runs"]["grpo"].values())
           for name in ("final_5e-4", "final_5e-4_epyc")}
    assert ttc["final_5e-4"] > 300 and ttc["final_5e-4_epyc"] > 300
    assert f"was {ttc['final_5e-4']:g} steps on the Xeon and {ttc['final_5e-4_epyc']:g} on the EPYC" in results
    # (ii) multiplicity
    three = _holm([xeon["fisher_p"], primary[("final_5e-4_epyc", "onpolicy")]["fisher_p"], epyc["fisher_p"]])[0]
    assert (f"makes {xeon['fisher_p']:.3f} into {holm[('final_5e-4', 'llds')]:.3f} (Bonferroni {min(1, 5 * xeon['fisher_p']):.2f}; "
            f"Holm over the three 5e-4 tests {three:.3f})") in results
    # (iii) held 30 steps instead of 20
    held = {arm: sum(_collapse_start(LAB / "final_5e-4" / arm / f"seed{s}", hold=30) is not None for s in range(10, 15))
            for arm in ("grpo", "llds")}
    assert held["grpo"] == k["grpo"] - 1, "the recount removes exactly one GRPO collapse (seed 13's dip)"
    assert _collapse_start(LAB / "final_5e-4" / "grpo" / "seed13", hold=30) is None
    assert _collapse_start(LAB / "final_5e-4" / "grpo" / "seed13", hold=20) is not None
    assert (f"GRPO collapsed in {held['grpo']} of 5 and the test gives p = {_fisher(held['grpo'], 5, held['llds'], 5):.2f}") in results
    # (iv) the EPYC replication
    assert f"the same comparison was {epyc['collapsed']['grpo']} of 5 vs {epyc['collapsed']['llds']} of 5, p = {epyc['fisher_p']:.2f}" in results
    # the paired-bootstrap RMST interval, as the committed report computed it
    rd = json.loads((LAB / "final_5e-4" / "collapse.json").read_text())["arms"]["llds"]["vs_grpo"]["rmst_difference"]
    assert rd["paired"] and f"RMST difference {rd['diff']:+.0f} steps [{rd['low']:+.0f}, {rd['high']:+.0f}]" in results
    assert f"exceeds GRPO's by {rd['diff']:.0f} steps, with a 95% interval of [{rd['low']:+.0f}, {rd['high']:+.0f}]" in results
    assert "prevent" not in r4.split("|")[-2]  # "prevented" is the confirmatory set's word (R12, tested below), never R4's


def _readme_row(claim: str) -> str:
    """The README results card's row whose first cell is ``claim``."""
    (line,) = [l for l in (ROOT / "README.md").read_text().splitlines() if l.startswith(f"| {claim} |")]
    return line


C1 = LAB / "c1_5e-4"


def test_c1_recomputed_independently() -> None:
    """R12, the confirmatory set, from its archived metrics with this file's own code: the collapse
    rule (hold 30) over the csv module, the strata from each run's recorded machine, the exact
    stratified p as a convolution of scipy's hypergeometric distributions, the horizon rule, the
    last-100 rewards and their exact paired permutation p, the hold-20 recount; then every page
    that quotes them, and the verdict words only where the registered conditions hold."""
    from scipy.stats import hypergeom

    if not (C1 / "llds").is_dir():
        pytest.skip("c1_5e-4 is not archived")
    seeds, horizon = range(20, 30), 1100
    runs = json.loads((C1 / "collapse.json").read_text())["meta"]["runs"]
    start = {(arm, s): _collapse_start(C1 / arm / f"seed{s}", hold=30) for arm in ("grpo", "llds") for s in seeds}
    collapsed = {k: v is not None and v < horizon for k, v in start.items()}
    k = {arm: sum(collapsed[(arm, s)] for s in seeds) for arm in ("grpo", "llds")}
    assert len(runs) == 20 and (k["grpo"], k["llds"]) == (10, 3)
    # strata: the CPU model and SIMD flags each run recorded; both arms of a seed on one machine
    kind = {s: {json.dumps([runs[f"{arm}/seed{s}"]["machine_kind"][f] for f in ("cpu_model", "cpu_flags_simd", "init_digest")])
                for arm in ("grpo", "llds")} for s in seeds}
    assert all(len(v) == 1 for v in kind.values())
    cpu = {s: json.loads(next(iter(kind[s])))[:2] for s in seeds}
    strata = {}
    for s in seeds:
        strata.setdefault(json.dumps(cpu[s]), []).append(s)
    assert sorted(map(len, strata.values())) == [4, 6]
    # exact stratified test: given each stratum's total collapses, LLDS's count in it is
    # hypergeometric; p = P(sum over strata of LLDS counts <= observed), strata independent
    dist = {0: 1.0}
    for members in strata.values():
        n = len(members)
        total = sum(collapsed[(arm, s)] for arm in ("grpo", "llds") for s in members)
        pmf = {x: float(hypergeom(2 * n, total, n).pmf(x)) for x in range(n + 1)}
        dist = {t: sum(dist.get(t - x, 0.0) * q for x, q in pmf.items()) for t in range(sum(map(len, strata.values())) + 1)}
    p = sum(q for t, q in dist.items() if t <= k["llds"])
    assert p == pytest.approx(1 / 70 * 84 / 924)  # by hand: P(0 of 4 | 4 of 8) x P(3 of 6 | 9 of 12)
    times = sorted(start[("grpo", s)] if collapsed[("grpo", s)] else horizon for s in seeds)
    grpo_median = statistics.median(times)
    assert grpo_median <= horizon / 2, "the horizon rule"
    last = {arm: {s: _last100_mean_reward(C1 / arm / f"seed{s}") for s in seeds} for arm in ("grpo", "llds")}
    d = [last["llds"][s] - last["grpo"][s] for s in seeds]
    flips = [sum(x * f for x, f in zip(d, signs)) for signs in itertools.product((1, -1), repeat=10)]
    perm_p = sum(f >= sum(d) - 1e-12 for f in flips) / len(flips)
    hold20 = {arm: sum(_collapse_start(C1 / arm / f"seed{s}", hold=20) is not None for s in seeds) for arm in ("grpo", "llds")}
    mean = {arm: statistics.fmean(v.values()) for arm, v in last.items()}
    rd = json.loads((C1 / "c1.json").read_text())["secondary"]["rmst_difference"]  # a bootstrap: quoted as computed

    r12 = _row("R12")
    assert f"collapsed {k['grpo']} of 10 vs {k['llds']} of 10; last-100 reward {mean['grpo']:.2f} vs {mean['llds']:.2f}" in r12
    assert f"RMST difference {rd['diff']:+.0f} steps [{rd['low']:+.0f}, {rd['high']:+.0f}]" in r12
    assert f"GRPO's median time to collapse {grpo_median:g} (horizon rule holds)" in r12
    assert f"| {p:.4f} | supported: LLDS prevented the collapse within 1,100 steps" in r12 and p < 0.05
    card = _readme_row("LLDS prevents it where GRPO first learns")
    assert f"| supported (registered) | lab, 5e-4: {k['llds']} of 10 with LLDS vs {k['grpo']} of 10 (p = {p:.4f}) |" in card
    lab = page("docs", "lab", "collapse_lab.md")
    assert f"GRPO collapsed in **{k['grpo']} of 10** seeds and GRPO + LLDS in **{k['llds']} of 10**" in lab
    assert f"gives **p = {p:.4f}** at 0.05, and GRPO's median time to collapse ({grpo_median:g})" in lab
    assert f"| mean last-100 reward | {mean['grpo']:.3f} | {mean['llds']:.3f} |" in lab
    assert f"GRPO's median time to collapse is {grpo_median:g} <= H / 2 = 550: holds" in lab
    llds_fell = sorted((s, start[("llds", s)]) for s in seeds if collapsed[("llds", s)])
    assert f"({k['llds']} of 10 against {k['grpo']} of 10)" in lab and llds_fell == [(26, 887), (28, 551), (29, 174)]
    assert "(seeds 26, 28, 29, at steps 887, 551, 174)" in lab
    assert f"**+{sum(d) / 10:.3f}**, exact paired permutation p = {perm_p:.3f}" in lab
    assert f"with the old 20-step hold, {hold20['grpo']} of 10 vs {hold20['llds']} of 10" in lab
    per_stratum = {len(m): sum(collapsed[("llds", s)] for s in m) for m in strata.values()}
    assert f"| AVX2-only EPYC, seeds 20-23 | 4 of 4 | {per_stratum[4]} of 4 |" in lab and f"| 6 of 6 | {per_stratum[6]} of 6 |" in lab


def _collapse_start(run: Path, hold: int, smooth: int = 20) -> int | None:
    """The collapse rule written out again over the csv module: the first step from which, for
    ``hold`` training steps in a row, the trailing-``smooth`` reward is <= half its running peak
    or the trailing answered rate < 0.5. Rows of one step are merged (first value wins)."""
    steps: dict[int, dict] = {}
    with gzip.open(run / "metrics.csv.gz", "rt") as f:
        for r in csv.DictReader(f):
            if r.get("step"):
                merged = steps.setdefault(int(float(r["step"])), {})
                for key in ("train/reward", "train/answered_rate"):
                    if r.get(key) and key not in merged:
                        merged[key] = float(r[key])
    train = [(s, v) for s, v in sorted(steps.items()) if "train/reward" in v]

    def trailing(key: str) -> list:
        out = []
        for i in range(len(train)):
            window = [v[key] for _, v in train[max(0, i - smooth + 1): i + 1] if key in v]
            out.append(sum(window) / len(window) if i + 1 >= smooth and window else None)
        return out

    reward, answered = trailing("train/reward"), trailing("train/answered_rate")
    peak, run_length = None, 0
    for i, (step, _) in enumerate(train):
        if reward[i] is not None:
            peak = reward[i] if peak is None else max(peak, reward[i])
        low = (reward[i] is not None and peak is not None and peak > 0 and reward[i] <= 0.5 * peak) or (answered[i] is not None and answered[i] < 0.5)
        run_length = run_length + 1 if low else 0
        if run_length == hold:
            return train[i - hold + 1][0]
    return None


def test_epyc_twin_recomputed_independently(primary) -> None:
    """R2: GRPO vs the on-policy twin on the EPYC at 5e-4."""
    r = primary[("final_5e-4_epyc", "onpolicy")]
    k, mean = r["collapsed"], r["last100"]
    r2 = _row("R2")
    assert f"{k['grpo']} of 5 vs {k['onpolicy']} of 5; last-100 reward {mean['grpo']:.2f} vs {mean['onpolicy']:.2f}" in r2
    assert f"| {r['fisher_p']:.3f}; {r['permutation_p']:.3f} | same direction, not significant |" in r2


@pytest.mark.skipif(not (LAB / "controls_epyc" / "kl").is_dir(), reason="the controls are not archived")
def test_controls_recomputed_independently() -> None:
    """R6 and the README card's row: the controls at 7e-4, 3 seeds each (Xeon: positive-only, LLDS 1.0;
    EPYC: GRPO, masked, LLDS 0.5, KL, half rate), counts and GRPO's deaths and decays."""
    epyc = {arm: _arm_runs("controls_epyc", arm) for arm in ("grpo", "unshared", "llds_0.5", "kl", "half_lr")}
    xeon = {arm: _arm_runs("controls", arm) for arm in ("grpo", "pos_only", "llds_1.0")}
    for runs in (epyc, xeon):
        assert {arm: sorted(r) for arm, r in runs.items()} == {arm: [10, 11, 12] for arm in runs}
    k = {arm: _collapsed(r) for arm, r in {**epyc, **{f"x_{a}": r for a, r in xeon.items()}}.items()}
    modes = [s["mode"] for s in epyc["grpo"].values() if s["collapsed"]]
    r6 = _row("R6")
    assert (f"GRPO {k['grpo']} of 3 (EPYC: {modes.count('death')} deaths, {modes.count('decay')} decay); half rate {k['half_lr']} of 3; "
            f"KL {k['kl']} of 3; positive-only {k['x_pos_only']} of 3 (later); masked {k['unshared']} of 3 (later); "
            f"LLDS 0.5 {k['llds_0.5']} of 3, 1.0 {k['x_llds_1.0']} of 3") in r6
    later = {arm: statistics.median(s["step"] for s in r.values()) > statistics.median(s["step"] for s in base.values())
             for arm, r, base in (("pos_only", xeon["pos_only"], xeon["grpo"]), ("unshared", epyc["unshared"], epyc["grpo"]))}
    assert all(later.values()), later
    assert f"| lab, 7e-4: half the rate {k['half_lr']} of 3, KL {k['kl']} of 3, GRPO {k['grpo']} of 3 |" in _readme_row("a lower rate or a KL anchor holds")


@pytest.mark.skipif(not (LAB / "heal_5e-4" / "grpo_heal").is_dir(), reason="the healing comparison is not archived")
def test_healing_numbers_recomputed_independently() -> None:
    arms = {"healed": LAB / "heal_5e-4" / "grpo_heal", "unhealed": LAB / "final_5e-4" / "grpo", "lower": LAB / "half_2.5e-4" / "grpo"}
    seeds = (10, 11, 12)
    mean = {k: statistics.mean(_last100_mean_reward(d / f"seed{s}") for s in seeds) for k, d in arms.items()}
    assert f"last-100 reward {mean['healed']:.2f} vs {mean['unhealed']:.2f} vs {mean['lower']:.2f}" in _row("R8"), mean
    heal = json.loads((LAB / "heal.json").read_text())
    assert len(heal["per_seed"]) == 3


@pytest.mark.skipif(not (LAB / "alarm.json").is_file(), reason="the alarm validation is not archived")
def test_alarm_numbers_are_the_validation_json() -> None:
    """R7 and the README card's row quote lab/archive/collapse/alarm.json's score at the registered h
    (lab/alarm_eval.py writes it from the archives); every registered run is scored."""
    a = json.loads((LAB / "alarm.json").read_text())
    t = a["test_at_chosen_h"]
    assert t["collapses"] + t["quiet_runs"] == len(a["test_runs"])
    quoted = f"{t['warned_in_time']} of {t['collapses']} collapses warned 20+ steps ahead; {t['false_per_1000']:.1f} false alarms per 1,000 steps"
    r7 = _row("R7")
    assert f"h = {a['chosen_h']:g} | {len(a['test_runs'])} runs |" in r7 and quoted in r7
    assert f"on the {t['quiet_runs']} that did not collapse" in r7
    card = _readme_row("the collapse alarm warns in time")
    assert f"| fails its goal | {t['warned_in_time']} of {t['collapses']} collapses warned 20+ steps ahead (goal: 80%) |" in card
    assert t["warned_in_time"] < 0.8 * t["collapses"]  # the registered goal, as the card's verdict says


def test_two_search_demo_recomputed_independently() -> None:
    """docs/lab/demo_studies.md's two-search figures, recomputed from the archived evaluations by hand
    (zip by position after sorting by question, not lldslight.rollout.evaluation.paired_change)."""
    run = DEMO / "two_searches"

    def records(name: str) -> list[dict]:
        rows = json.loads(gzip.decompress((run / name).read_bytes()))["records"]
        return sorted(rows, key=lambda r: (r["data_source"], r["question"]))

    first, last = records("val_before_step0.json.gz"), records("val_step80.json.gz")
    before, after = [r["em"] for r in first], [r["em"] for r in last]
    assert len(before) == len(after) == 64
    diffs = [a - b for a, b in zip(after, before)]
    change = sum(diffs) / 64
    se = statistics.stdev(diffs) / 64 ** 0.5
    studies = page("docs", "lab", "demo_studies.md")
    quoted = (f"dev EM {sum(before) / 64:.3f} -> {sum(after) / 64:.3f}, paired change {change:+.3f} "
              f"(SE {se:.3f}, n = 64)")
    assert quoted in studies, quoted
    searches = f"({sum(r['searches'] for r in first) / 64:.2f} -> {sum(r['searches'] for r in last) / 64:.2f} searches per question)"
    assert searches in studies, searches


def _as_shipped(arms: Path, n: int, t975_df2: float) -> dict:
    """A registered as-shipped demo test (3 seeds, arms n{n}_seed{S}) recomputed by hand: each seed's
    paired change and SE over 64 questions, the mean with its 95% t interval, how many passed
    (change >= 2 SE), seed 0's time from the archive's timing.json (the command must be the shipped
    one, on an AVX512-BF16 CPU) and seed 0's steps with zero training reward."""
    diffs = [[a - b for a, b in zip(after, before)] for before, after in _test_ems(arms, range(3), n=n)]
    changes = [(sum(d) / 64, statistics.stdev(d) / 8) for d in diffs]
    mean = statistics.fmean(c for c, _ in changes)
    half = t975_df2 * statistics.stdev(c for c, _ in changes) / 3 ** 0.5
    passing = [c >= 2 * se for c, se in changes]
    timing = json.loads((arms / "timing.json").read_text())
    s0 = timing["runs"][f"n{n}_seed0"]
    assert s0["command"] == "bash scripts/demo.sh" and "avx512_bf16" in timing["machine"]["cpu_flags_simd"]
    minutes, seconds = divmod(round(s0["wall_s"]), 60)
    rewards = _by_step(arms / f"n{n}_seed0", "train/reward").values()
    assert len(rewards) == 30
    return {"mean": mean, "interval": f"95% t interval {mean - half:+.3f} to {mean + half:+.3f}", "passing": sum(passing),
            "seed0_change": changes[0][0], "seed0_se": changes[0][1], "seed0_passes": passing[0],
            "met": passing[0] and sum(passing) >= 2, "time": f"{minutes} min {seconds} s",
            "zero_reward_steps": sum(r == 0 for r in rewards)}


def _test_ems(arms: Path, seeds: range, n: int = 32) -> list[tuple[list[float], list[float]]]:
    """(EM before, EM after) per seed from an archived light-warm-start test, both sorted by
    question, by hand (not lab/demo_seeds.py nor lldslight.rollout.evaluation.paired_change)."""
    out = []
    for seed in seeds:
        run = arms / f"n{n}_seed{seed}"
        (after_name,) = [p.name for p in run.glob("val_after_step*.json.gz")]

        def ems(name: str) -> list[float]:
            rows = json.loads(gzip.decompress((run / name).read_bytes()))["records"]
            return [r["em"] for r in sorted(rows, key=lambda r: (r["data_source"], r["question"]))]

        before, after = ems("val_before_step0.json.gz"), ems(after_name)
        assert len(before) == len(after) == 64
        out.append((before, after))
    return out


def test_light_warmstart_demo_recomputed_independently() -> None:
    """The figures of the two registered tests of lab/archive/demo/PLAN_light_warmstart.md, in
    docs/lab/demo_studies.md, docs/results.md (R9, R10), the README's card and its demo paragraph."""
    studies = page("docs", "lab", "demo_studies.md")
    t975 = {2: 4.303, 3: 3.182}  # Student's t tables
    first_test = DEMO / "light_warmstart"
    first_ems = _test_ems(first_test, range(4))
    for key, ems in (("R10", first_ems), ("R9", _test_ems(DEMO / "light_warmstart_kb1", range(3)))):
        diffs = [[a - b for a, b in zip(after, before)] for before, after in ems]
        changes = [(sum(d) / 64, statistics.stdev(d) / 8) for d in diffs]
        n = len(changes)
        mean = statistics.fmean(c for c, _ in changes)
        half = t975[n - 1] * statistics.stdev(c for c, _ in changes) / n ** 0.5
        passing = sum(c >= 2 * se for c, se in changes)
        interval = f"(95% t interval {mean - half:+.3f} to {mean + half:+.3f})"
        quoted = f"{mean:+.3f} on average over {n} seeds {interval}; {passing} of the {n} runs by two standard errors"
        assert quoted in studies, quoted
        assert f"test EM {mean:+.3f} on average {interval}; {passing} of {n} runs by two standard errors" in _row(key)
        # the registered criteria: the 30-step test passes with 2 of 3; the 14-step one needs seed 0 and 2 of the rest
        met = passing >= 2 if key == "R9" else (changes[0][0] >= 2 * changes[0][1] and passing - (changes[0][0] >= 2 * changes[0][1]) >= 2)
        assert _row(key).endswith("| met |" if met else "| not met |")
        if key == "R9":
            assert f"test EM {mean:+.3f} (95% t interval {mean - half:+.3f} to {mean + half:+.3f})" in page("README.md")
    # R14: the shipped demo's registered test (PLAN_shipped_demo.md): seed 0 and 2 of the 3 seeds
    r14 = _as_shipped(DEMO / "shipped", 32, t975[2])
    seed0 = f"{r14['seed0_change']:+.3f} (SE {r14['seed0_se']:.3f})"
    assert f"{r14['mean']:+.3f} on average over 3 seeds ({r14['interval']}); {r14['passing']} of the 3 runs by two standard errors" in studies
    assert f"dev EM {r14['mean']:+.3f} on average ({r14['interval']}); {r14['passing']} of 3 runs by two standard errors; seed 0 {seed0}" in _row("R14")
    assert _row("R14").endswith("| met |" if r14["met"] else "| not met |")
    assert f"seed 0 {seed0} in {r14['time']}" in _row("R14") and f"**{r14['time']}**" in studies
    assert f"reward was 0 in {r14['zero_reward_steps']} of the 30 steps of seed 0" in studies
    # R15: the one-search warm start as shipped (PLAN_warmstart_1hop.md), the README's demo figures
    r15 = _as_shipped(DEMO / "warmstart_1hop", 60, t975[2])
    seed0 = f"{r15['seed0_change']:+.3f} (SE {r15['seed0_se']:.3f})"
    assert f"{r15['mean']:+.3f} on average over 3 seeds ({r15['interval']}); {r15['passing']} of the 3 runs by two standard errors" in studies
    assert (f"dev EM {r15['mean']:+.3f} on average ({r15['interval']}); {r15['passing']} of 3 runs by two standard errors; "
            f"seed 0 {seed0} in {r15['time']}") in _row("R15")
    assert _row("R15").endswith("| met |" if r15["met"] else "| not met (seed 0 passed) |" if r15["seed0_passes"] else "| not met |")
    readme = page("README.md")
    assert f"seed 0 moved dev EM by {seed0} and took {r15['time']} after set-up on an AMD EPYC with AVX512-BF16" in readme
    assert r15["passing"] == 1 and r15["seed0_passes"]  # the README's words: "only seed 0 by two standard errors"
    assert f"three seeds moved it by {r15['mean']:+.3f} on average, only seed 0 by two standard errors" in readme
    # R18: the same registered test again at today's code, on the Xeon (PLAN_xeon_retest.md)
    r18 = _as_shipped(DEMO / "xeon_retest", 60, t975[2])
    seed0_18 = f"{r18['seed0_change']:+.3f} (SE {r18['seed0_se']:.3f})"
    assert (f"dev EM {r18['mean']:+.3f} on average ({r18['interval']}); {r18['passing']} of 3 runs by two standard errors; "
            f"seed 0 {seed0_18} in {r18['time']}") in _row("R18")
    assert _row("R18").endswith("| met |" if r18["met"] else "| not met |")
    assert r18["passing"] == 3  # the README's words: "all three by two standard errors"
    assert f"Intel Xeon with AMX (bf16, 2 threads), seed 0 moved dev EM by {seed0_18} and took {r18['time']} after set-up" in readme
    assert f"three seeds moved it by {r18['mean']:+.3f} on average ({r18['interval']}), all three by two" in readme
    assert f"+{r18['mean']:.3f} on average over 3 seeds ({r18['interval']}); 3 of the 3 runs by two standard errors" in studies
    assert f"whole command after set-up **{r18['time']}**" in studies
    assert f"reward was 0 in {r18['zero_reward_steps']} of the 30 steps of seed 0" in studies
    assert f"**{r15['seed0_change']:+.3f} ({r15['seed0_se']:.3f})**, {r15['seed0_change'] / r15['seed0_se']:.2f} SE" in studies
    assert f"**{r15['time']}**" in studies
    assert f"reward was 0 in {r15['zero_reward_steps']} of the 30 steps of seed 0" in studies
    # "every run ended below what a 64-example warm start scores without GRPO (0.375)"
    context = json.loads(gzip.decompress((first_test / "n64_seed0" / "val_before_step0.json.gz").read_bytes()))["records"]
    context_em = sum(r["em"] for r in context) / len(context)
    assert f"without GRPO ({context_em:.3f})" in studies
    for seed, (_, after) in enumerate(first_ems):
        assert sum(after) / 64 < context_em, seed


C2_SETS = {("bound", "5e-4"): ("c2_5e-4", "bound"), ("bound", "1e-3"): ("c2_1e-3", "bound"),
           ("grpo", "5e-4"): ("c1_5e-4", "grpo"), ("grpo", "1e-3"): ("c2_1e-3", "grpo"), ("grpo", "2.5e-4"): ("c2_2.5e-4", "grpo")}


@pytest.fixture(scope="module")
def c2_runs() -> dict[tuple[str, str], dict[int, dict]]:
    """C2's archived runs, (arm, rate) -> seed -> what this file computes from the metrics: the
    collapse step (hold 30) and collapsed-by-H, the last-100 reward, the median rate, the machine
    (read once for this file's two C2 tests)."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for key, (name, arm) in C2_SETS.items():
        recorded = json.loads((LAB / name / "collapse.json").read_text())["meta"].get("runs", {}) if (LAB / name / "collapse.json").is_file() else {}
        out[key] = {}
        for s in range(20, 25):
            run = LAB / name / arm / f"seed{s}"
            if not (run / "metrics.csv.gz").is_file() or f"{arm}/seed{s}" not in recorded:
                continue
            start = _collapse_start(run, hold=30)
            kind = recorded[f"{arm}/seed{s}"]["machine_kind"]
            out[key][s] = {"start": start, "collapsed": start is not None and start < 1100, "last100": _last100_mean_reward(run),
                           "lr": statistics.median(_by_step(run, "train/lr").values()), "cpu": (kind["cpu_model"], tuple(kind["cpu_flags_simd"]))}
    return out


def test_c2_runs_match_the_registered_analysis(c2_runs) -> None:
    """Every archived C2 run as lab/confirmatory.py reads it (collapsed by H, last-100 reward,
    median rate, machine) equals this file's own computation from the same metrics."""
    runs = c2_runs
    if not runs[("bound", "1e-3")]:
        pytest.skip("C2 is not archived")
    conf = load_lab("confirmatory")
    rep = conf.c2_report()
    seen = 0
    for r in rep["runs"]:
        mine = runs[(r["arm"], r["rate"])][r["seed"]]
        assert r["collapsed"] == mine["collapsed"] and r["final_reward"] == pytest.approx(mine["last100"], abs=1e-9), r
        assert r["lr_median"] == pytest.approx(mine["lr"]), r
        seen += 1
    assert seen == sum(map(len, runs.values()))


def test_c2_recomputed_independently(c2_runs) -> None:
    """R13, the drift-bound set, from its archived metrics with this file's own code: collapses by
    H (hold 30) per arm, the last-100 rewards and the paired differences against GRPO at 2.5e-4
    with a t interval from scipy, Fisher from scipy, the machines; then the pages that quote them,
    and the goal's verdict only as the registered conditions give it."""
    from scipy.stats import t as student_t

    runs = c2_runs
    if any(len(v) < 5 for v in runs.values()):
        pytest.skip("C2 is not complete")
    seeds = range(20, 25)
    k = {key: sum(r[s]["collapsed"] for s in seeds) for key, r in runs.items()}
    assert k == {("bound", "5e-4"): 0, ("bound", "1e-3"): 0, ("grpo", "5e-4"): 5, ("grpo", "1e-3"): 5, ("grpo", "2.5e-4"): 0}
    # the goal's pairs: a seed's bound runs and its GRPO-at-2.5e-4 run on one machine
    for s in seeds:
        assert len({runs[key][s]["cpu"] for key in runs if key != ("grpo", "5e-4")}) == 1
    diff, interval = {}, {}  # per starting rate: the mean paired difference, and "[low, high]" (95% t, 4 df)
    for rate in ("5e-4", "1e-3"):
        d = [runs[("bound", rate)][s]["last100"] - runs[("grpo", "2.5e-4")][s]["last100"] for s in seeds]
        diff[rate] = mean = statistics.fmean(d)
        half = student_t.ppf(0.975, 4) * statistics.stdev(d) / 5 ** 0.5
        interval[rate] = f"[{mean - half:+.3f}, {mean + half:+.3f}]"
        assert _fisher(k[("grpo", rate)], 5, k[("bound", rate)], 5) == pytest.approx(1 / 252)  # by hand: 5 of 5 vs 0 of 5
    # the registered goal: (i) no collapse in either bound arm and (ii) a mean difference >= 0, at both rates
    goal_met = all(k[("bound", r)] == 0 and diff[r] >= 0 for r in ("5e-4", "1e-3"))
    mean_reward = {key: statistics.fmean(r[s]["last100"] for s in seeds) for key, r in runs.items()}
    steps = {key: sorted(r[s]["start"] for s in seeds) for key, r in runs.items() if key[0] == "grpo" and key[1] != "2.5e-4"}
    median_lr = {rate: statistics.median(runs[("bound", rate)][s]["lr"] for s in seeds) for rate in ("5e-4", "1e-3")}

    lab = page("docs", "lab", "collapse_lab.md")
    for rate in ("5e-4", "1e-3"):
        assert f"**{diff[rate]:+.3f}** {interval[rate]} from {rate}" in lab.replace("\n  ", " ").replace("\\", "")
    assert f"| collapsed by H (hold 30) | **0 of 5** | **0 of 5** | 5 of 5 (steps {steps[('grpo', '5e-4')][0]}-{steps[('grpo', '5e-4')][-1]}) " \
           f"| 5 of 5 (steps {steps[('grpo', '1e-3')][0]}-{steps[('grpo', '1e-3')][-1]}) | 0 of 5 |" in lab
    arms = [("bound", "5e-4"), ("bound", "1e-3"), ("grpo", "5e-4"), ("grpo", "1e-3"), ("grpo", "2.5e-4")]
    assert "| mean last-100 reward | " + " | ".join(f"{mean_reward[a]:.3f}" for a in arms) + " |" in lab
    assert f"| median rate (per run, then over runs) | {median_lr['5e-4']:.2e} | {median_lr['1e-3']:.2e} |".replace("e-04", "e-4") in lab
    assert ("**Goal: met.**" if goal_met else "**Goal: not met.**") in lab
    r13 = _row("R13")
    assert (f"last-100 reward minus GRPO at 2.5e-4: {diff['5e-4']:+.3f} {interval['5e-4']} from 5e-4, "
            f"{diff['1e-3']:+.3f} {interval['1e-3']} from 1e-3") in r13
    assert "bound collapsed 0 of 5 from 5e-4 and 0 of 5 from 1e-3 (plain GRPO 5 of 5 at each)" in r13
    assert r13.endswith("| met |" if goal_met else "| not met: no collapse at either rate, reward below the best fixed rate's |")


REAL_LM = LAB / "real_lm_A"


def _window_mean(run: Path, key: str, first: int, last: int) -> float:
    values = _by_step(run, key)
    window = [values[s] for s in range(first, last) if s in values and values[s] == values[s]]  # NaN left out
    return statistics.mean(window)


def _stage_a_row(label: str, run: Path, start: int | None) -> str:
    """One row of docs/lab/collapse_lab.md's Stage A table: the collapse step, then each column's first-20
    -> last-20 mean."""
    cells = [str(start) if start is not None else "none"]
    for key in ("train/reward", "train/answered_rate", "diag/tool_call_rate", "train/zero_var_groups", "train/entropy"):
        cells.append(f"{_window_mean(run, key, 0, 20):.2f} -> {_window_mean(run, key, 80, 100):.2f}")
    return f"| {label} | " + " | ".join(cells) + " |"


def _tool_death(run: Path) -> int:
    """The first step from which every later step's tool-call rate is below 0.5 (the tool died)."""
    tool = _by_step(run, "diag/tool_call_rate")
    return min(s for s in sorted(tool) if all(tool[t] < 0.5 for t in tool if t >= s))


@pytest.mark.skipif(not REAL_LM.is_dir(), reason="Stage A is not archived")
def test_real_lm_stage_a_figures_recomputed_independently() -> None:
    """docs/lab/collapse_lab.md's Stage A table and text: each completed run's collapse step under the
    registered rule (hold 30, the csv module's own implementation above), its first-20 and last-20
    means, the early drift and the likelihoods it quotes; round 1's verdict by the registered table."""
    text = page("docs", "lab", "collapse_lab.md")
    seeds = (1, 2, 3)
    runs = {(arm, seed): REAL_LM / f"grpo_{arm}" / f"seed{seed}" for arm in ("2e-3", "5e-4") for seed in seeds}
    for (arm, seed), run in runs.items():
        assert len(_by_step(run, "train/reward")) == 100, f"{run}: not a complete 100-step run"
        start = _collapse_start(run, hold=30)
        row = _stage_a_row(f"{arm}, seed {seed}", run, start)
        assert row in text, row
    early = {k: max(_by_step(r, "drift/kl_k3_last")[s] for s in range(5)) for k, r in runs.items()}
    assert (f"reached {early[('2e-3', 1)]:.3f}, {early[('2e-3', 2)]:.3f} and {early[('2e-3', 3)]:.3f} within the first five steps" in text
            and f"({early[('5e-4', 1)]:.3f}, {early[('5e-4', 2)]:.3f}, {early[('5e-4', 3)]:.3f})" in text)
    window = {(s, key): f"{_window_mean(runs[('5e-4', s)], key, 0, 20):.2f} -> {_window_mean(runs[('5e-4', s)], key, 80, 100):.2f}"
              for s in seeds for key in ("lld/logp_pos", "lld/logp_neg")}
    pos = [window[(s, "lld/logp_pos")] for s in seeds]
    assert f"steps: {pos[0]}, {pos[1]} and {pos[2]})" in text
    assert (f"seed 1 ({window[(1, 'lld/logp_neg')]})" in text and f"seed 3 ({window[(3, 'lld/logp_neg')]})" in text
            and f"seed 2 ({window[(2, 'lld/logp_neg')]})" in text)
    shared = [_window_mean(runs[("5e-4", s)], "lld/neg_shared_share", a, a + 20) for s in seeds for a in (0, 80)]
    assert f"with {min(shared):.2f}-{max(shared):.2f} of the negative" in text
    tied = [_window_mean(runs[("5e-4", s)], "train/zero_var_groups", a, a + 20) for s in seeds for a in (0, 80)]
    assert f"({min(tied):.2f}-{max(tied):.2f} with G = 4)" in text
    collapsed = {arm: sum(_collapse_start(runs[(arm, s)], hold=30) is not None for s in seeds) for arm in ("2e-3", "5e-4")}
    assert collapsed == {"2e-3": 3, "5e-4": 0}  # the registered table: >= 2 of 3 collapses, 0 of 3 holds
    assert "**2e-3 collapses (3 of 3), 5e-4 holds (0 of 3)**, so round 2 is GRPO at 1e-3" in text
    steps = sorted({_collapse_start(runs[("2e-3", s)], hold=30) for s in seeds})
    row = _row("R16")
    assert f"collapsed {collapsed['2e-3']} of 3 at 2e-3 (all at step {steps[0]}: stopped answering within ~10 steps)" in row and len(steps) == 1
    assert f", {collapsed['5e-4']} of 3 at 5e-4 (reward" in row


@pytest.mark.skipif(not (REAL_LM / "grpo_1e-3").is_dir(), reason="Stage A's round 2 is not archived")
def test_real_lm_stage_a_round_2_and_verdict_recomputed_independently() -> None:
    """Round 2 (GRPO at 1e-3): each run's row, Stage A's verdict and Stage B's horizon by the
    registered rules, the tool-call death's steps, the drifts and likelihoods the page quotes, and
    the README and results rows."""
    text = page("docs", "lab", "collapse_lab.md")
    seeds = (1, 2, 3)
    runs = {s: REAL_LM / "grpo_1e-3" / f"seed{s}" for s in seeds}
    start = {}
    for seed, run in runs.items():
        assert len(_by_step(run, "train/reward")) == 100, f"{run}: not a complete 100-step run"
        start[seed] = _collapse_start(run, hold=30)
        row = _stage_a_row(f"1e-3, seed {seed}", run, start[seed])
        assert row in text, row
    assert all(v is not None for v in start.values())
    assert "round 2, **1e-3 collapses (3 of 3)**" in text
    median = statistics.median(start.values())  # Stage B's H: max(100, 2 x median), held runs at 100
    horizon = max(100, -(-2 * median // 10) * 10)
    assert f"max(100, 2 x the median collapse step at 1e-3, {median}) = **{horizon}**" in text and horizon == 100
    # the tool-call death: the first step from which every later step's tool-call rate is below 0.5
    dead = {}
    for seed, run in runs.items():
        dead[seed] = _tool_death(run)
        assert _window_mean(run, "diag/tool_call_rate", 80, 100) < 0.005
    assert f"(seed 2 from step {dead[2]}, seed 1 from step {dead[1]}, seed 3 from step {dead[3]})" in text
    kl = {seed: _by_step(run, "drift/kl_k3_last") for seed, run in runs.items()}
    assert f"KL {kl[2][12]:.3f} and {kl[2][14]:.3f} at steps 12 and 14" in text
    assert f"against {statistics.median(kl[2].values()):.3f} over the run, median" in text
    assert f"({kl[1][0]:.3f} at step 0; {max(kl[3][s] for s in range(dead[3])):.3f} at step 36)" in text
    assert max(range(dead[3]), key=lambda s: kl[3][s]) == 36
    # the old lld/logp_pos figures, kept in the corrected reading: tests/test_real_lm_reading.py
    shared = [_window_mean(runs[s], "lld/neg_shared_share", a, b) for s in seeds for a, b in ((0, 10), (dead[s] - 10, dead[s]))]
    assert f"{min(shared):.2f}-{max(shared):.2f} of the negative responses' tokens lay in a prefix shared" in text
    steps = ", ".join(str(v) for v in sorted(start.values()))
    results = page("docs", "results.md")
    assert f"3 of 3 at 1e-3 (steps {steps}: stopped searching)" in results


REAL_LM_B = LAB / "real_lm_B"
B_SEEDS = range(10, 16)
B_ARMS = ("grpo", "llds", "stable")


def _b_complete() -> bool:
    return all((REAL_LM_B / f"{arm}_1e-3" / f"seed{s}" / "metrics.csv.gz").is_file() for arm in B_ARMS for s in B_SEEDS)


@pytest.mark.skipif(not _b_complete(), reason="Stage B is not complete (no figure is quoted from a partial set)")
def test_real_lm_stage_b_recomputed_independently() -> None:
    """Stage B (PREREGISTRATION_real_lm_B.md) from its archived metrics with this file's own code: each
    run's collapse step under the registered rule (hold 30, H = 100), P1 and P2 as scipy's one-sided
    Fisher exact tests (one machine kind: no strata), Holm over the two written out, C1's horizon rule,
    the paired last-20 rewards with their t intervals and exact permutation p, the RMST point
    differences; then every page that quotes them, and "prevented" only where the registered
    conditions hold."""
    horizon, hold = 100, 30
    runs = json.loads((REAL_LM_B / "collapse.json").read_text())["meta"]["runs"]
    # one machine kind per seed, all arms on it; and here every run on one kind (no strata)
    kinds = {json.dumps([runs[f"{arm}_1e-3/seed{s}"]["machine_kind"][f] for f in ("cpu_model", "cpu_flags_simd")])
             for arm in B_ARMS for s in B_SEEDS}
    assert len(kinds) == 1, kinds
    path = {(arm, s): REAL_LM_B / f"{arm}_1e-3" / f"seed{s}" for arm in B_ARMS for s in B_SEEDS}
    for run in path.values():
        assert len(_by_step(run, "train/reward")) == horizon, f"{run}: not a complete {horizon}-step run"
    start = {k: _collapse_start(run, hold=hold) for k, run in path.items()}
    collapsed = {k: v is not None and v + hold <= horizon for k, v in start.items()}
    count = {arm: sum(collapsed[(arm, s)] for s in B_SEEDS) for arm in B_ARMS}
    time = {k: start[k] if collapsed[k] else horizon for k in start}
    p = {arm: _fisher(count["grpo"], 6, count[arm], 6) for arm in ("llds", "stable")}
    holm = dict(zip(("llds", "stable"), _holm([p["llds"], p["stable"]])))
    grpo_median = statistics.median(time[("grpo", s)] for s in B_SEEDS)
    rule = grpo_median <= horizon / 2
    final = {k: statistics.fmean(_by_step(run, "train/reward")[s] for s in range(horizon - 20, horizon)) for k, run in path.items()}
    text, results, readme_row = page("docs", "lab", "collapse_lab.md"), page("docs", "results.md"), _readme_row("GRPO collapses on a real LM too")
    stage_b = json.loads((REAL_LM_B / "stage_b.json").read_text())
    for arm in B_ARMS:
        for s in B_SEEDS:
            assert _stage_a_row(f"{arm}, seed {s}", path[(arm, s)], start[(arm, s)] if collapsed[(arm, s)] else None) in text, (arm, s)
    assert (f"GRPO collapsed in **{count['grpo']} of 6** seeds, GRPO + LLDS in **{count['llds']} of 6** and GRPO + the "
            f"drift bound in **{count['stable']} of 6**") in text
    assert f"GRPO's median time to collapse {grpo_median:g} {'<=' if rule else '>'} H / 2 = 50" in text
    for arm, name, key in (("llds", "LLDS", "P1"), ("stable", "the drift bound", "P2")):
        passes = holm[arm] <= 0.05
        d = [final[(arm, s)] - final[("grpo", s)] for s in B_SEEDS]
        mean, half = statistics.fmean(d), 2.571 * statistics.stdev(d) / 6 ** 0.5  # Student's t table, 5 df (as the analysis)
        flips = [abs(sum(x * f for x, f in zip(d, signs))) for signs in itertools.product((1, -1), repeat=6)]
        perm = sum(f >= abs(sum(d)) - 1e-12 for f in flips) / len(flips)
        rmst = statistics.fmean(time[(arm, s)] for s in B_SEEDS) - statistics.fmean(time[("grpo", s)] for s in B_SEEDS)
        rd = stage_b["claims"][arm]["rmst_difference"]  # a bootstrap: its interval quoted as computed
        assert rd["diff"] == pytest.approx(rmst)
        verdict = (f"{name} prevented the collapse within 100 steps" if passes and rule
                   else f"fewer runs collapsed within 100 steps with {name}" if passes else "not supported")
        assert f"{key} ({name}): one-sided exact p = {p[arm]:.4f}, Holm {holm[arm]:.4f}: {verdict}" in text
        assert f"last-20 reward, {name} minus GRPO, {mean:+.3f} (95% t interval {mean - half:+.3f} to {mean + half:+.3f}; exact paired permutation p = {perm:.3f})" in text
        assert f"RMST, {name} minus GRPO, {rmst:+.1f} steps [{rd['low']:+.1f}, {rd['high']:+.1f}]" in text
        row = _row("R19" if arm == "llds" else "R20")
        assert f"collapsed {count['grpo']} of 6 vs {count[arm]} of 6" in row and f"| {p[arm]:.4f} (Holm {holm[arm]:.4f}) |" in row
        assert row.endswith(f"| {verdict} |")
    assert f"| SmolLM2-135M, Stage B: GRPO {count['grpo']} of 6, LLDS {count['llds']} of 6, bound {count['stable']} of 6 |" in readme_row
    # the description: the largest last-update KL before a run's collapse (or over it), the bound's
    # median rate and updates, GRPO's collapsed run's tool death and likelihood, the shared share
    kl = {}
    for arm in B_ARMS:
        tops = [max(v for s, v in _by_step(path[(arm, seed)], "drift/kl_k3_last").items() if s < time[(arm, seed)]) for seed in B_SEEDS]
        kl[arm] = f"{min(tops):.3f}-{max(tops):.3f}"
    assert f"was {kl['grpo']} with GRPO, {kl['llds']} with LLDS and {kl['stable']} with the bound" in text
    lr = [statistics.median(_by_step(path[("stable", s)], "train/lr").values()) for s in B_SEEDS]
    updates = [statistics.fmean(_by_step(path[("stable", s)], "drift/updates").values()) for s in B_SEEDS]
    assert f"median {min(lr):.1e} to {max(lr):.1e}".replace("e-0", "e-") in text and f"applied {min(updates):.1f}-{max(updates):.1f} of the" in text
    (fell,) = [s for s in B_SEEDS if collapsed[("grpo", s)]]
    pos = f"{_window_mean(path[('grpo', fell)], 'lld/logp_pos', 0, 10):.2f} -> {_window_mean(path[('grpo', fell)], 'lld/logp_pos', start[('grpo', fell)] - 10, start[('grpo', fell)]):.2f}"
    # the corrected reading keeps the old figure, saying why it cannot show displacement (the tool
    # deaths and lld/delta_correct around them: tests/test_real_lm_reading.py)
    assert f"`lld/logp_pos` {pos} in seed {fell} from its first 10 steps to the 10 before its collapse" in text
    shared = [_window_mean(run, "lld/neg_shared_share", 0, 10) for run in path.values()]
    assert f"{min(shared):.2f}-{max(shared):.2f} over the first 10 steps of every run" in text
    grpo_fell = sum(_window_mean(path[("grpo", s)], "train/reward", 80, 100) < _window_mean(path[("grpo", s)], "train/reward", 0, 20) for s in B_SEEDS)
    assert f"fell in {['no', 'one', 'two', 'three', 'four', 'five', 'six'][grpo_fell]} of six GRPO seeds" in text

C3_PILOT = LAB / "c3_pilot_1e-3"


@pytest.mark.skipif(not (C3_PILOT / "collapse.json").is_file(), reason="C3's pilot is not archived")
def test_c3_pilot_figures_recomputed_independently() -> None:
    """docs/lab/collapse_lab.md's C3 pilot paragraph (a pipeline check, seeds 0 and 1, 100 steps from 1e-3):
    the metrics the preset must log on every step, and the rate range, held share, mean updates and
    stopped steps it quotes, from the archived metrics with the csv module."""
    text = page("docs", "lab", "collapse_lab.md")
    lr, held, updates, stopped = {}, {}, {}, {}
    for seed in (0, 1):
        run = C3_PILOT / "stable" / f"seed{seed}"
        reward = _by_step(run, "train/reward")
        assert len(reward) == 100 and _collapse_start(run, hold=30) is None, seed
        logged = {key: _by_step(run, key) for key in ("drift/signal", "drift/rate_held", "drift/lr_scale", "train/lr", "drift/updates", "drift/stopped")}
        assert all(set(reward) <= set(v) for v in logged.values()), seed  # every training step logged them
        lr[seed] = (min(logged["train/lr"].values()), max(logged["train/lr"].values()), logged["train/lr"][99])
        held[seed] = logged["drift/rate_held"][99] / 100  # a cumulative count
        updates[seed] = statistics.fmean(logged["drift/updates"].values())
        stopped[seed] = sum(v == 1.0 for v in logged["drift/stopped"].values())
    for seed in (0, 1):
        assert (f"seed {seed}: rate {lr[seed][0]:.1e} to {lr[seed][1]:.1e}, {lr[seed][2]:.1e} at step 99; "
                f"held {held[seed]:.2f} of steps; {updates[seed]:.1f} updates a batch; {stopped[seed]} steps stopped").replace("e-0", "e-") in text


def _val_records(run: Path, file: str) -> dict[tuple[str, str], dict]:
    """An archived demo evaluation's records by (data source, question), read with json and gzip."""
    rows = json.loads(gzip.decompress((run / file).read_bytes()))["records"]
    return {(r["data_source"], r["question"]): r for r in rows}


def test_demo_seed0_on_the_xeon_recomputed_independently() -> None:
    """demo_studies.md's Xeon table and the README's Xeon figure: EM before/after, the paired change and
    its SE from each archived run's evaluation records, by hand; the timing from the run's summary."""
    arms = DEMO / "xeon_seed0"
    text = (ROOT / "docs" / "lab" / "demo_studies.md").read_text()
    expected = {"head_e560a33": ("0.234 -> 0.391", "+0.156 (0.051)", "3.1 SE", "0.91"),
                "before_14790c9": ("0.234 -> 0.422", "+0.188 (0.058)", "3.2 SE", "1.00")}
    for name, (ems, change, z, answered) in expected.items():
        run = arms / name

        before, after = _val_records(run, "val_before_step0.json.gz"), _val_records(run, "val_after_step30.json.gz")
        assert before.keys() == after.keys() and len(before) == 64
        d = [after[q]["em"] - before[q]["em"] for q in before]
        mean, se = sum(d) / 64, statistics.stdev(d) / 8
        em_b, em_a = (sum(r["em"] for r in x.values()) / 64 for x in (before, after))
        assert f"{em_b:.3f} -> {em_a:.3f}" == ems and f"{mean:+.3f} ({se:.3f})" == change and f"{mean / se:.1f} SE" == z
        answered_after = sum(r["answered"] for r in after.values()) / 64
        assert f"{answered_after:.2f}" == answered
        row = next(line for line in text.splitlines() if line.startswith(f"| {name.split('_')[1]} "))
        assert all(x in row for x in (ems, change, z, answered)), row
    summary = json.loads((arms / "head_e560a33" / "summary.json").read_text())
    assert round(summary["wall_time_s"]) == 203 and "GRPO with both evaluations 203 s" in text
    timing = json.loads((arms / "timing.json").read_text())
    assert {"amx_bf16", "avx512_bf16"} <= set(timing["machine"]["cpu_flags_simd"])
    minutes, seconds = divmod(round(timing["runs"]["head_e560a33"]["wall_s"]), 60)
    assert f"{minutes} min {seconds} s" == "5 min 44 s" and "5 min 44 s with set-up" in text


def test_what_moved_demo_seed0_on_the_xeon() -> None:
    """The retest's diagnostic (PLAN_xeon_retest.md): seed 0 with the frozen prefix off answers every
    dev question as the run before the frozen prefix did, and seed 0 as shipped as the e560a33 run,
    compared record by record; the figures demo_studies.md quotes for it, by hand."""
    studies = page("docs", "lab", "demo_studies.md")

    def answers(run: Path, file: str = "val_after_step30.json.gz") -> dict[tuple[str, str], tuple]:
        return {q: (r["em"], r["answered"]) for q, r in _val_records(run, file).items()}

    retest, seed0 = DEMO / "xeon_retest", DEMO / "xeon_seed0"
    before = "val_before_step0.json.gz"  # one warm start: the same answers before training in all four runs
    assert answers(retest / "fp_off_seed0", before) == answers(seed0 / "before_14790c9", before) == answers(retest / "n60_seed0", before)
    assert answers(retest / "fp_off_seed0") == answers(seed0 / "before_14790c9")
    assert answers(retest / "n60_seed0") == answers(seed0 / "head_e560a33")
    assert answers(retest / "fp_off_seed0") != answers(retest / "n60_seed0")
    on, off = answers(retest / "n60_seed0"), answers(retest / "fp_off_seed0")
    moved = sum(off[q][0] for q in off) - sum(on[q][0] for q in on)
    assert moved == 2 and "moved seed 0, by 2 of 64 questions" in studies
    config = (retest / "fp_off_seed0" / "config.yaml").read_text()
    assert "frozen_prefix: false" in config and "frozen_prefix: false" not in (retest / "n60_seed0" / "config.yaml").read_text()
    assert "`--model.update.frozen_prefix false` gave 0.234 -> 0.422 (+0.188, SE 0.058)" in studies


def test_c3_demo_transfer_check_recomputed_independently() -> None:
    """C3's demo transfer check (C3.md): each run's dev EM change and SE from its evaluation records,
    the arms' means and paired differences against the shipped demo with Student's t for 2 df, and
    what the controller did from the metrics, all with json, gzip and csv (not lab/confirmatory.py);
    the figures docs/lab/collapse_lab.md, results.md's R21 and the README quote."""
    root, t975_df2 = DEMO / "c3_transfer", 4.303
    arms, seeds = ("shipped", "stable_5e-4", "stable_2e-3"), (3, 4, 5)
    change, dead = {}, {}
    for arm, seed in itertools.product(arms, seeds):
        run = root / arm / f"seed{seed}"
        before, after = _val_records(run, "val_before_step0.json.gz"), _val_records(run, "val_after_step30.json.gz")
        assert before.keys() == after.keys() and len(before) == 64
        d = [after[q]["em"] - before[q]["em"] for q in before]
        change[arm, seed] = (sum(d) / 64, statistics.stdev(d) / 8)
        assert sum(r["em"] for r in before.values()) / 64 == pytest.approx(0.234375)  # one warm start, 2 threads
        dead[arm, seed] = sum(r["em"] for r in after.values()) == 0 and sum(r["answered"] for r in after.values()) == 0
        summary = json.loads((run / "summary.json").read_text())
        assert summary["machine"]["threads"] == 2 and "amx_bf16" in summary["machine"]["cpu_flags_simd"]
    lab, results = page("docs", "lab", "collapse_lab.md"), _row("R21")
    for arm in arms:
        quoted = " / ".join(f"{change[arm, s][0]:+.3f} ({change[arm, s][1]:.3f})" for s in seeds)
        assert quoted in lab, arm
    means = {arm: statistics.fmean(change[arm, s][0] for s in seeds) for arm in arms}
    assert f"shipped {means['shipped']:+.3f} on average; preset from 5e-4 {means['stable_5e-4']:+.3f}" in results
    assert f"from 2e-3 {means['stable_2e-3']:+.3f}" in results
    for arm in arms[1:]:
        diffs = [change[arm, s][0] - change["shipped", s][0] for s in seeds]
        mean, half = statistics.fmean(diffs), t975_df2 * statistics.stdev(diffs) / 3 ** 0.5
        assert f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]" in lab, arm
        assert f"minus shipped {mean:+.3f}, " in results and f"{mean - half:+.3f} to {mean + half:+.3f}" in results
    # Two of the 4x runs lost every answer; none of the others did.
    assert [k for k, v in dead.items() if v] == [("stable_2e-3", 3), ("stable_2e-3", 4)]
    assert "2 of 3 runs ended with dev EM 0" in results
    assert "with its ceiling at 4x that rate, 2 of 3 runs lost every answer in the first steps" in page("docs", "results.md")
    # What the controller did, from the metrics (each run's columns read once)
    run = {k: root / k[0] / f"seed{k[1]}" for k in change}
    lr = {k: [v for s, v in sorted(_by_step(run[k], "train/lr").items()) if s < 30] for k in change}
    kl = {k: _by_step(run[k], "drift/kl_k3_last") for k in change}
    low = [k for k in change if k[0] == "stable_5e-4"]
    assert [f"{statistics.median(lr[k]):.3g}" for k in low] == ["0.0005", "0.0005", "0.000496"]
    assert "rate median 5.0e-4, 5.0e-4, 4.96e-4" in lab
    shares = [_by_step(run[k], "drift/rate_held")[29] / 30 for k in low]
    assert f"held {min(shares):.2f}-{max(shares):.2f} of steps" in lab
    assert all(v == 0 for k in low for v in _by_step(run[k], "drift/stopped").values())
    signal = {k: _by_step(run[k], "drift/signal") for k in low}
    kl_signal = {k: [v for s, v in kl[k].items() if signal[k].get(s) == 1.0] for k in low}
    assert max(max(v) for v in kl_signal.values()) > 0.00081  # single batches passed the target; their median per run did not
    medians = [statistics.median(kl_signal[k]) for k in low]
    assert f"median {min(medians):.5f}-{max(medians):.5f}" in lab and max(medians) < 0.00081
    died = [("stable_2e-3", 3), ("stable_2e-3", 4)]
    reward = {k: _by_step(run[k], "train/reward") for k in died}
    zero_from = [min(s for s in range(30) if all(reward[k][t] == 0 for t in range(s, 30))) for k in died]
    assert zero_from == [3, 5] and "training reward was 0 from step 3 and step 5" in lab
    first = [v for k in died for s, v in sorted(kl[k].items()) if s < 3]
    assert f"drifted {min(first):.4f}-{max(first):.3f} ({min(first) / 0.00081:.0f}-{max(first) / 0.00081:.0f}x the target)" in lab
    assert [f"{statistics.median(lr[k]):.3g}" for k in died] == ["0.00116", "0.00109"]
    survivor = lr["stable_2e-3", 5]
    assert f"seed 5 survived (rate {min(survivor):.1e} to {max(survivor):.0e})".replace("e-0", "e-") in lab


# C3 (C3.md): (arm, starting rate) -> (set, arm folder, seeds)
C3_RUNS = {("stable", "1e-3"): ("c3_1e-3", "stable", range(30, 40)), ("grpo", "2.5e-4"): ("c3_2.5e-4", "grpo", range(30, 40)),
           ("stable", "5e-4"): ("c3_5e-4", "stable", range(30, 35)), ("stable", "2e-3"): ("c3_2e-3", "stable", range(30, 35))}


def _c3_complete() -> bool:
    return all((LAB / name / arm / f"seed{s}" / "metrics.csv.gz").is_file() for name, arm, seeds in C3_RUNS.values() for s in seeds)


@pytest.fixture(scope="module")
def c3_runs() -> dict[tuple[str, str], dict[int, dict]]:
    """C3's archived runs, (arm, rate) -> seed -> what this file computes from the metrics with the
    csv module: the collapse step (hold 30), the last-100 reward, the rate's median, the share of
    steps below 2.5e-4, the held share, the mean updates, the stopped steps, the median drift over
    the steps with signal; the machine each run recorded (CPU, SIMD flags, init digest)."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for key, (name, arm, seeds) in C3_RUNS.items():
        recorded = json.loads((LAB / name / "collapse.json").read_text())["meta"]["runs"]
        out[key] = {}
        for s in seeds:
            run = LAB / name / arm / f"seed{s}"
            col = _columns(run, ("train/reward", "train/lr", "drift/signal", "drift/kl_k3_last", "drift/updates", "drift/rate_held", "drift/stopped"))
            reward, lr, signal, kl, updates = (col[k] for k in ("train/reward", "train/lr", "drift/signal", "drift/kl_k3_last", "drift/updates"))
            steps = [t for t in sorted(reward) if t < 1100]
            start = _collapse_start(run, hold=30)
            kind = recorded[f"{arm}/seed{s}"]["machine_kind"]
            r = {"start": start, "collapsed": start is not None and start < 1100, "last100": _last100(reward), "n": len(steps),
                 "lr_median": statistics.median(lr[t] for t in steps),
                 "machine": (kind["cpu_model"], tuple(kind["cpu_flags_simd"]), kind["init_digest"])}
            r.update(kl_signal=statistics.median(kl[t] for t in steps if signal.get(t) == 1.0 and t in kl),
                     updates=statistics.fmean(updates[t] for t in steps))
            if arm == "stable":
                held, stopped = col["drift/rate_held"], col["drift/stopped"]
                r.update(below=sum(lr[t] < 2.5e-4 for t in steps) / len(steps), held=held[steps[-1]] / len(steps),
                         stopped=sum(stopped[t] == 1.0 for t in steps))
            out[key][s] = r
    return out


@pytest.mark.skipif(not _c3_complete(), reason="C3 is not complete")
def test_c3_recomputed_independently(c3_runs) -> None:
    """R22, C3's registered goal, from its archived metrics with this file's own code: collapses by H
    (hold 30) per arm, the last-100 rewards, the paired differences against GRPO at 2.5e-4 with
    Student's t written in (2.262 for 9 df, 2.776 for 4), the controller's figures per run; then the
    pages that quote them, and the verdict words only as the registered conditions give them."""
    runs, t975 = c3_runs, {9: 2.262, 4: 2.776}
    control, primary = runs[("grpo", "2.5e-4")], ("stable", "1e-3")
    # the registration: a seed's arms on one machine (CPU, SIMD flags and init digest)
    for s in range(30, 40):
        assert len({runs[key][s]["machine"] for key in runs if s in runs[key]}) == 1, s
    assert all(r["n"] == 1100 for by_seed in runs.values() for r in by_seed.values())
    k = {key: sum(r["collapsed"] for r in by_seed.values()) for key, by_seed in runs.items()}
    fell = {s: r["start"] for s, r in control.items() if r["collapsed"]}

    def paired(key: tuple[str, str]) -> tuple[float, float, float, list[float]]:
        seeds = sorted(runs[key])
        d = [runs[key][s]["last100"] - control[s]["last100"] for s in seeds]
        return (*_t_interval(d, t975[len(d) - 1]), d)

    mean, low, high, d = paired(primary)
    goal_met = all(k[key] == 0 for key in runs if key[0] == "stable") and mean >= 0 and low > -0.03
    wins = sum(x > 0 for x in d)
    text = f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"
    others = {rate: "{:+.3f} [{:+.3f}, {:+.3f}]".format(*paired(("stable", rate))[:3]) for rate in ("5e-4", "2e-3")}
    mean_reward = {key: statistics.fmean(r["last100"] for r in by_seed.values()) for key, by_seed in runs.items()}
    (dead,) = fell  # the one GRPO collapse, and its pair's difference
    rest = [x for s, x in zip(sorted(runs[primary]), d) if s != dead]

    def span(key: tuple[str, str], field: str, fmt: str) -> str:
        values = [r[field] for r in runs[key].values()]
        return f"{format(min(values), fmt)}-{format(max(values), fmt)}"

    lab = page("docs", "lab", "collapse_lab.md")
    for key, label in ((primary, "preset from 1e-3 (primary)"), (("stable", "5e-4"), "preset from 5e-4"), (("stable", "2e-3"), "preset from 2e-3")):
        n = len(runs[key])
        diff = f"**{text}** (9 df)" if key == primary else f"{others[key[1]]} (4 df)"
        collapsed = f"**{k[key]} of {n}**" if key == primary else f"{k[key]} of {n}"
        lr = sorted(r["lr_median"] for r in runs[key].values())
        stopped = span(key, "stopped", "d") + (" of 1,100" if key == primary else "")
        row = (f"| {label} | seeds 30-{29 + n} | {collapsed} | {mean_reward[key]:.3f} | {diff} | {lr[0]:.1e} to {lr[-1]:.1e} | "
               f"{span(key, 'below', '.2f')} | {span(key, 'held', '.2f')} | {span(key, 'updates', '.2f')} | {stopped} | "
               f"{span(key, 'kl_signal', '.5f')} |").replace("e-0", "e-")
        assert row in lab, row
    assert (f"| plain GRPO at 2.5e-4 | seeds 30-39 | {k[('grpo', '2.5e-4')]} of 10 (seed {dead}, step {fell[dead]}: stopped answering) "
            f"| {mean_reward[('grpo', '2.5e-4')]:.3f} | | 2.5e-4 | | | {statistics.fmean(r['updates'] for r in control.values()):g} | | "
            f"{span(('grpo', '2.5e-4'), 'kl_signal', '.5f')} |") in lab
    assert all(r["lr_median"] == pytest.approx(2.5e-4) for r in control.values())
    above = all(mean_reward[key] > mean_reward[("grpo", "2.5e-4")] for key in runs if key[0] == "stable")
    assert above and "more reward than GRPO at that rate, on average from every start, and from 1e-3 in 9 of 10 pairs" in lab and wins == 9
    assert f"that pair's difference is {d[sorted(runs[primary]).index(dead)]:+.3f}; the other nine are {min(rest):+.3f} to {max(rest):+.3f}" in lab
    assert f"the preset ended above GRPO in {wins} of 10 pairs, with a median paired difference of {statistics.median(d):+.3f}" in lab
    assert f"lower bound, {low:+.3f}, is below -0.03" in lab and (low < -0.03) != goal_met
    assert ("**Goal: met**" if goal_met else "**Goal: not met**") in lab
    settled = sorted(r["lr_median"] for key in runs if key[0] == "stable" for r in runs[key].values())
    drift = sorted(r["kl_signal"] for key in runs if key[0] == "stable" for r in runs[key].values())
    assert f"a median {settled[0]:.1e} to {settled[-1]:.1e} per run, from every start".replace("e-0", "e-") in lab
    assert f"at a median {drift[0]:.5f}-{drift[-1]:.5f} per run from every start" in page("docs", "stability.md")  # Choosing the target
    assert f"**{sum(k[key] for key in runs if key[0] == 'stable')} of 20** preset runs collapsed by H: {k[primary]} of 10 from 1e-3, " \
           f"{k[('stable', '5e-4')]} of 5 from 5e-4, {k[('stable', '2e-3')]} of 5 from 2e-3" in lab
    assert f"**{text}** (95% t, 9 df)" in lab and f"{wins} of 10 pairs favour the preset, median {statistics.median(d):+.3f}" in lab
    assert f"from 5e-4 {others['5e-4']}, from 2e-3 {others['2e-3']} (4 df)" in lab
    r22 = _row("R22")
    assert f"preset collapsed 0 of 20 (GRPO at 2.5e-4: {k[('grpo', '2.5e-4')]} of 10)" in r22 and sum(k[key] for key in runs if key[0] == "stable") == 0
    assert f"{text} from 1e-3 (higher in {wins} of 10 pairs), {others['5e-4']} from 5e-4, {others['2e-3']} from 2e-3" in r22
    assert r22.endswith(f"| not met: no collapse, but the lower bound is {low:+.3f} (GRPO's one collapse widened the interval) |") != goal_met
    card = _readme_row("a drift bound keeps any rate from collapsing")
    assert f"| {sum(k[key] for key in runs if key[0] == 'stable')} of 20 collapsed; the reward gain's lower bound {low:+.3f} (goal -0.03) |" in card
    assert ("| met |" if goal_met else "| not met |") in card
    # the registered analysis (lab/confirmatory.py, its own code) agrees with this file's
    rep = json.loads((LAB / "c3.json").read_text())
    assert rep["goal_met"] == goal_met and rep["primary"]["mean_diff"] == pytest.approx(mean) and rep["primary"]["low"] == pytest.approx(low, abs=1e-3)


C3_LLDS = LAB / "c3_llds_1e-3" / "stable"


@pytest.mark.skipif(not all((C3_LLDS / f"seed{s}" / "metrics.csv.gz").is_file() for s in range(30, 35)) or not _c3_complete(),
                    reason="C3's optional LLDS arm is not complete")
def test_c3_llds_arm_recomputed_independently(c3_runs) -> None:
    """C3's optional arm (the preset + LLDS from 1e-3, seeds 30-34, described only): its collapses,
    mean last-100 reward and paired difference against GRPO at 2.5e-4 (t for 4 df written in), from
    the metrics with the csv module; the sentence docs/lab/collapse_lab.md quotes."""
    control = c3_runs[("grpo", "2.5e-4")]
    config = json.loads((C3_LLDS.parent / "collapse.json").read_text())["meta"]
    assert "lab/configs/arms/llds.yaml" in config["extra_configs"]
    start = {s: _collapse_start(C3_LLDS / f"seed{s}", hold=30) for s in range(30, 35)}
    k = sum(v is not None and v < 1100 for v in start.values())
    last = {s: _last100_mean_reward(C3_LLDS / f"seed{s}") for s in range(30, 35)}
    d = [last[s] - control[s]["last100"] for s in range(30, 35)]
    mean, low, high = _t_interval(d, 2.776)
    quoted = (f"the preset + LLDS from 1e-3 (seeds 30-34, described only) collapsed {k} of 5, mean last-100 reward "
              f"{statistics.fmean(last.values()):.3f}, minus GRPO at 2.5e-4 {mean:+.3f} [{low:+.3f}, {high:+.3f}] (4 df)")
    assert quoted in page("docs", "lab", "collapse_lab.md")
