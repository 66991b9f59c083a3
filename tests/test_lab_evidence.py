"""The committed lab evidence: every report under lab/archive/collapse/ is recomputed from its archived
per-step metrics (``lab/collapse.py --report-only``) and must equal the committed one, so no
number of the reports can drift from the data it claims to summarise."""
from __future__ import annotations

import gzip
import json
import shutil
import statistics
from pathlib import Path

import pytest
from conftest import ROOT, load_lab

LAB = ROOT / "lab" / "archive" / "collapse"


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
    assert (dst / "collapse.md").read_text() == (src / "collapse.md").read_text(), (
        f"lab/archive/collapse/{name}/collapse.md differs from its recomputation: run "
        f"`python lab/collapse.py --name {name} --report-only`")


def _arm_runs(name: str, arm: str) -> dict[int, dict]:
    from lldslight import collapse as C

    out = {}
    for run in sorted((LAB / name / arm).glob("seed*")):
        frame = C.read_metrics(run)
        out[int(run.name[4:])] = C.summarise(frame[frame["train/reward"].notna()])
    return out


@pytest.mark.skipif(not (LAB / "final" / "grpo").is_dir(), reason="the 7e-4 primary set is not archived")
def test_readme_lab_numbers_recomputed_independently() -> None:
    """The README's lab sentence, recomputed from the per-step metrics with scipy's tests (not the
    runner's own statistics code): counts, Fisher p, median collapse steps, sign test."""
    from scipy.stats import binomtest, fisher_exact

    readme = (ROOT / "README.md").read_text()
    runs = {arm: _arm_runs("final", arm) for arm in ("grpo", "llds", "onpolicy")}
    collapsed = {arm: sum(bool(s["collapsed"]) and s["step"] < 600 for s in r.values()) for arm, r in runs.items()}
    n = {arm: len(r) for arm, r in runs.items()}
    assert n == {"grpo": 5, "llds": 5, "onpolicy": 5}
    for arm in runs:
        assert f"**{collapsed[arm]} of {n[arm]}**" in readme
    # One-sided: GRPO collapses more often than the other arm.
    for arm in ("onpolicy", "llds"):
        p = fisher_exact([[collapsed["grpo"], n["grpo"] - collapsed["grpo"]], [collapsed[arm], n[arm] - collapsed[arm]]],
                         alternative="greater").pvalue
        assert f"p = {p:.3f}" in readme or f"p = {p:.2f}" in readme, (arm, p)
    # The median collapse step of the runs that collapsed (statistics.median: 4 LLDS runs -> the mean of the middle two).
    median = {arm: statistics.median(s["step"] for s in r.values() if s["collapsed"]) for arm, r in runs.items() if collapsed[arm]}
    assert f"median collapse step of the collapsed runs {median['llds']:g} vs {median['grpo']:g}" in " ".join(readme.split())
    later = sum((runs["llds"][s]["step"] if runs["llds"][s]["collapsed"] else 600) > (runs["grpo"][s]["step"] if runs["grpo"][s]["collapsed"] else 600)
                for s in runs["grpo"])
    p_sign = binomtest(later, n["grpo"], 0.5, alternative="greater").pvalue
    assert f"sign test p = {p_sign:.3f}" in " ".join(readme.split())


def _paired_set(name: str, other: str) -> dict:
    """GRPO against ``other`` in set ``name``, seeds 10-14, from the per-step metrics: collapse
    counts, scipy's one-sided Fisher p, the last-100 mean rewards (csv module) and their exact
    paired permutation p (other - GRPO, one-sided)."""
    import itertools

    from scipy.stats import fisher_exact

    runs = {arm: _arm_runs(name, arm) for arm in ("grpo", other)}
    assert {arm: sorted(r) for arm, r in runs.items()} == {"grpo": [10, 11, 12, 13, 14], other: [10, 11, 12, 13, 14]}
    k = {arm: sum(bool(s["collapsed"]) and s["step"] < 600 for s in r.values()) for arm, r in runs.items()}
    p = fisher_exact([[k["grpo"], 5 - k["grpo"]], [k[other], 5 - k[other]]], alternative="greater").pvalue
    last = {arm: {s: _last100_mean_reward(LAB / name / arm / f"seed{s}") for s in range(10, 15)} for arm in runs}
    d = [last[other][s] - last["grpo"][s] for s in range(10, 15)]
    flips = [sum(x * f for x, f in zip(d, signs)) for signs in itertools.product((1, -1), repeat=5)]
    return {"collapsed": k, "fisher_p": p, "last100": {arm: statistics.fmean(v.values()) for arm, v in last.items()},
            "permutation_p": sum(f >= sum(d) - 1e-12 for f in flips) / len(flips)}


@pytest.mark.skipif(not (LAB / "final_5e-4" / "llds").is_dir(), reason="the 5e-4 primary set is not archived")
def test_readme_5e4_numbers_recomputed_independently() -> None:
    """The README's 5e-4 sentence (GRPO vs LLDS on the Xeon), recomputed from the metrics."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    r = _paired_set("final_5e-4", "llds")
    k, mean = r["collapsed"], r["last100"]
    assert f"GRPO collapsed in {k['grpo']} of 5 seeds and GRPO + LLDS in {k['llds']} of 5" in readme
    assert f"Fisher p = {r['fisher_p']:.3f}" in readme
    assert f"last-100 reward {mean['llds']:.2f} vs {mean['grpo']:.2f}" in readme
    assert f"paired permutation p = {r['permutation_p']:.3f}" in readme


def _last100_mean_reward(run: Path) -> float:
    """Mean train/reward over the last 100 logged steps, read with the csv module (not
    lldslight/collapse.py nor lab/heal_eval.py)."""
    import csv
    with gzip.open(run / "metrics.csv.gz", "rt") as f:
        rewards = {int(r["step"]): float(r["train/reward"]) for r in csv.DictReader(f) if r.get("train/reward")}
    last = sorted(rewards)[-100:]
    return sum(rewards[s] for s in last) / len(last)


@pytest.mark.skipif(not (LAB / "heal_5e-4" / "grpo_heal").is_dir(), reason="the healing comparison is not archived")
def test_readme_healing_numbers_recomputed_independently() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    arms = {"healed": LAB / "heal_5e-4" / "grpo_heal", "unhealed": LAB / "final_5e-4" / "grpo", "lower": LAB / "half_2.5e-4" / "grpo"}
    seeds = (10, 11, 12)
    mean = {k: statistics.mean(_last100_mean_reward(d / f"seed{s}") for s in seeds) for k, d in arms.items()}
    assert f"mean reward of **{mean['healed']:.2f}** against **{mean['unhealed']:.2f}**" in readme, mean
    assert f"(**{mean['lower']:.2f}**, no collapse in 3 of 3)" in readme, mean
    heal = json.loads((LAB / "heal.json").read_text())
    assert len(heal["per_seed"]) == 3


@pytest.mark.skipif(not (LAB / "alarm.json").is_file(), reason="the alarm validation is not archived")
def test_readme_alarm_numbers_are_the_validation_json() -> None:
    """The README's alarm sentence quotes lab/archive/collapse/alarm.json's held-out score at the
    calibrated h (lab/alarm_eval.py writes it from the archives)."""
    t = json.loads((LAB / "alarm.json").read_text())["test_at_chosen_h"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"warned {t['warned_in_time']} of {t['collapses']} held-out collapses 20+ steps ahead, with "
            f"{t['false_per_1000']:.1f} false alarms per 1,000 steps on the {t['quiet_runs']} runs that did not collapse") in readme


@pytest.mark.skipif(not (LAB / "final_5e-4_epyc" / "onpolicy").is_dir(), reason="the EPYC set is not archived")
def test_readme_epyc_numbers_recomputed_independently() -> None:
    """The README's second-machine sentence (GRPO vs the on-policy twin on the EPYC)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    r = _paired_set("final_5e-4_epyc", "onpolicy")
    k, mean = r["collapsed"], r["last100"]
    assert f"GRPO collapsed in {k['grpo']} of 5 seeds and its on-policy twin in {k['onpolicy']} of 5" in readme
    assert f"(Fisher p = {r['fisher_p']:.3f}, not significant;" in readme
    assert f"last-100 reward {mean['onpolicy']:.2f} vs {mean['grpo']:.2f}" in readme
    assert f"paired permutation p = {r['permutation_p']:.3f}): there the twin" in readme


@pytest.mark.skipif(not (LAB / "controls_epyc" / "kl").is_dir(), reason="the EPYC controls are not archived")
def test_readme_epyc_controls_recomputed_independently() -> None:
    """The README's sentence on the last four controls (EPYC, 7e-4, seeds 10-12): collapse counts,
    GRPO's last and the masked arm's median collapse step, and the last-100 rewards (csv module)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    arms = ("grpo", "unshared", "llds_0.5", "kl", "half_lr")
    runs = {arm: _arm_runs("controls_epyc", arm) for arm in arms}
    assert {arm: sorted(r) for arm, r in runs.items()} == {arm: [10, 11, 12] for arm in arms}
    k = {arm: sum(bool(s["collapsed"]) and s["step"] < 600 for s in r.values()) for arm, r in runs.items()}
    grpo_last = max(s["step"] for s in runs["grpo"].values())
    masked_median = statistics.median(s["step"] for s in runs["unshared"].values() if s["collapsed"])
    last = {arm: statistics.fmean(_last100_mean_reward(LAB / "controls_epyc" / arm / f"seed{s}") for s in (10, 11, 12))
            for arm in ("grpo", "kl", "half_lr")}
    assert f"GRPO died in {k['grpo']} of 3 by step {grpo_last}" in readme
    assert f"delayed the death (median step {masked_median:g}) but did not prevent it ({k['unshared']} of 3)" in readme
    assert f"LLDS at 0.5 collapsed in {k['llds_0.5']} of 3" in readme
    assert k["kl"] == k["half_lr"] and f"half the rate collapsed in {k['kl']} of 3" in readme
    assert f"(last-100 reward {last['kl']:.2f} and {last['half_lr']:.2f} vs {last['grpo']:.2f})" in readme


def test_readme_two_search_demo_recomputed_independently() -> None:
    """The README's two-search demo figures, recomputed from the archived evaluations by hand
    (zip by position after sorting by question, not lldslight.evaluation.paired_change)."""
    run = ROOT / "lab" / "archive" / "demo" / "two_searches"

    def records(name: str) -> list[dict]:
        rows = json.loads(gzip.decompress((run / name).read_bytes()))["records"]
        return sorted(rows, key=lambda r: (r["data_source"], r["question"]))

    first, last = records("val_before_step0.json.gz"), records("val_step80.json.gz")
    before, after = [r["em"] for r in first], [r["em"] for r in last]
    assert len(before) == len(after) == 64
    diffs = [a - b for a, b in zip(after, before)]
    change = sum(diffs) / 64
    se = statistics.stdev(diffs) / 64 ** 0.5
    readme = (ROOT / "README.md").read_text()
    quoted = (f"dev EM {sum(before) / 64:.3f} -> {sum(after) / 64:.3f}, paired change {change:+.3f} "
              f"(SE {se:.3f}, n = 64)")
    assert quoted in " ".join(readme.split()), quoted
    searches = f"({sum(r['searches'] for r in first) / 64:.2f} -> {sum(r['searches'] for r in last) / 64:.2f} searches per question)"
    assert searches in " ".join(readme.split()), searches


def _test_ems(arms: Path, seeds: range, n: int = 32) -> list[tuple[list[float], list[float]]]:
    """(EM before, EM after) per seed from an archived light-warm-start test, both sorted by
    question, by hand (not lab/demo_seeds.py nor lldslight.evaluation.paired_change)."""
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


def test_readme_light_warmstart_demo_recomputed_independently() -> None:
    """The README's figures for the two registered tests of lab/archive/demo/PLAN_light_warmstart.md."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    t975 = {2: 4.303, 3: 3.182}  # Student's t tables
    first_test = ROOT / "lab" / "archive" / "demo" / "light_warmstart"
    first_ems = _test_ems(first_test, range(4))
    for ems in (first_ems, _test_ems(ROOT / "lab" / "archive" / "demo" / "light_warmstart_kb1", range(3))):
        diffs = [[a - b for a, b in zip(after, before)] for before, after in ems]
        changes = [(sum(d) / 64, statistics.stdev(d) / 8) for d in diffs]
        mean = statistics.fmean(c for c, _ in changes)
        half = t975[len(changes) - 1] * statistics.stdev(c for c, _ in changes) / len(changes) ** 0.5
        passing = sum(c >= 2 * se for c, se in changes)
        quoted = (f"{mean:+.3f} on average over {len(changes)} seeds (95% t interval {mean - half:+.3f} to {mean + half:+.3f}); "
                  f"{passing} of the {len(changes)} runs by two standard errors")
        assert quoted in readme, quoted
    # "every run ended below what a 64-example warm start scores without GRPO (0.375)"
    context = json.loads(gzip.decompress((first_test / "n64_seed0" / "val_before_step0.json.gz").read_bytes()))["records"]
    context_em = sum(r["em"] for r in context) / len(context)
    assert f"without GRPO ({context_em:.3f})" in readme
    for seed, (_, after) in enumerate(first_ems):
        assert sum(after) / 64 < context_em, seed
