"""lab/stage_c.py, the registered Stage C analysis, on a stand-in set built from Stage A's archived real-model
runs (GRPO at 2e-3 died at step 19 in every seed; 5e-4 held): each figure checked against a computation
written here from the raw CSV, the hypergeometric sum and the signed-rank distribution enumerated by hand."""
from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import statistics
from math import comb
from pathlib import Path

import pytest

from lab import stage_c

ROOT = Path(__file__).resolve().parents[1]
A = ROOT / "lab" / "archive" / "collapse" / "real_lm_A"
# role -> the Stage A arm standing in for it: the control dies, two arms hold
STAND_IN = {"grpo": "grpo_2e-3", "llds": "grpo_5e-4", "preset": "grpo_5e-4", "best": "grpo_1e-3"}


def source_seed(seed: int) -> int:
    return 1 + (seed - 20) % 3  # seeds 20-31 cycle over Stage A's 1-3


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lab")
    meta_a = json.loads((A / "collapse.json").read_text())["meta"]
    runs = {}
    for role, (_, folder) in stage_c.ROLES.items():
        for seed in stage_c.SEEDS:
            run = root / stage_c.NAME / folder / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "metrics.csv.gz").symlink_to(A / STAND_IN[role] / f"seed{source_seed(seed)}" / "metrics.csv.gz")
            runs[f"{folder}/seed{seed}"] = meta_a["runs"][f"{STAND_IN[role]}/seed{source_seed(seed)}"]
    (root / stage_c.NAME / "collapse.json").write_text(json.dumps({"meta": {"horizon": 80, "runs": runs}}))
    return root


@pytest.fixture(scope="module")
def rep(lab) -> dict:
    return stage_c.report(lab)


def raw(seed: int, arm: str) -> dict[int, dict[str, float]]:
    """step -> {key: value} straight from the archived CSV (first non-empty value of each key per step)."""
    rows: dict[int, dict[str, float]] = {}
    with gzip.open(A / arm / f"seed{seed}" / "metrics.csv.gz", "rt", newline="") as f:
        for r in csv.DictReader(f):
            if not r.get("step"):
                continue
            into = rows.setdefault(int(float(r["step"])), {})
            for k, v in r.items():
                if k != "step" and v not in ("", None) and k not in into:
                    into[k] = float(v)
    return {s: r for s, r in rows.items() if "train/reward" in r}


def fisher_by_hand(a: int, n: int, b: int) -> float:
    """P(the arm collapses <= b times | margins), the one-sided hypergeometric tail (a of n control collapses)."""
    total = a + b
    return sum(comb(n, k) * comb(n, total - k) for k in range(0, b + 1) if 0 <= total - k <= n) / comb(2 * n, total)


def signed_rank_p(values: list[float]) -> float:
    """Exact one-sided p of W+ (sum of the ranks of the positive values) by enumerating every sign pattern."""
    kept = [v for v in values if v != 0]
    order = sorted(range(len(kept)), key=lambda i: abs(kept[i]))
    ranks = [0.0] * len(kept)
    i = 0
    while i < len(order):  # average ranks over ties of |v|
        j = i
        while j + 1 < len(order) and abs(kept[order[j + 1]]) == abs(kept[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    observed = sum(r for r, v in zip(ranks, kept) if v > 0)
    hits = sum(sum(r for r, s in zip(ranks, signs) if s) >= observed - 1e-9 for signs in itertools.product((0, 1), repeat=len(kept)))
    return hits / 2 ** len(kept)


def test_partial_set_reports_counts_only(tmp_path) -> None:
    (tmp_path / stage_c.NAME / "grpo_2e-3" / "seed20").mkdir(parents=True)
    rep = stage_c.report(tmp_path)
    assert rep["status"] == "partial" and "p3" not in rep and "claims" not in rep
    assert rep["counts"]["grpo"] == {"archived": 0, "registered": 12} and len(rep["missing"]) == 48


def test_complete_set_tests_as_registered(rep) -> None:
    assert rep["status"] == "complete" and rep["horizon"] == 80 and rep["hold"] == 30
    # GRPO at 2e-3 died in all of Stage A's seeds (step 19); 5e-4 held in all
    assert rep["collapsed"]["grpo"] == 12 and rep["collapsed"]["llds"] == 0 and rep["collapsed"]["preset"] == 0
    assert rep["grpo_median_time"] <= 40 and rep["horizon_rule_holds"]
    for role in ("llds", "preset"):
        c = rep["claims"][role]
        assert c["p"] == pytest.approx(fisher_by_hand(12, 12, c["collapsed"]), rel=1e-12)
    p_sorted = sorted(rep["claims"][r]["p"] for r in ("llds", "preset"))
    assert rep["claims"]["llds"]["p_holm"] == pytest.approx(min(1.0, max(2 * p_sorted[0], p_sorted[1])))
    assert rep["claims"]["llds"]["verdict"] == "LLDS prevented the collapse within 80 steps"
    # P3: d from the raw CSVs (steps 60-79), then the exact signed-rank p enumerated over 2^12 sign patterns
    d = []
    for seed in stage_c.SEEDS:
        pre, best = raw(source_seed(seed), STAND_IN["preset"]), raw(source_seed(seed), STAND_IN["best"])
        d.append(statistics.fmean(pre[s]["train/reward"] for s in range(60, 80)) -
                 statistics.fmean(best[s]["train/reward"] for s in range(60, 80)))
    assert [rep["p3_differences"][s] for s in stage_c.SEEDS] == pytest.approx(d, abs=1e-9)
    assert rep["p3"]["p"] == pytest.approx(signed_rank_p([x + stage_c.MARGIN for x in d]), abs=1e-12)
    assert rep["p3"]["passes"] == (rep["p3"]["p"] <= 0.05)


def test_signals_before_each_death_from_the_raw_csv(rep) -> None:
    run = next(r for r in rep["runs"] if r["role"] == "grpo" and r["seed"] == 20)
    assert run["collapsed"] and run["time"] == 19
    rows = raw(1, "grpo_2e-3")
    # the death: the first step of the zero-reward run that holds step 19, found here by scanning forward
    death = next(s for s in range(20) if all(rows[t]["train/reward"] == 0 for t in range(s, 20)))
    assert run["death_step"] == death == 6
    window = range(max(0, death - 10), death)
    before = run["signals_before"]

    def finite_mean(values):
        values = [v for v in values if not math.isnan(v)]
        return statistics.fmean(values) if values else None

    for key in ("lld/delta_correct", "drift/kl_k3_last", "train/entropy", "train/answered_rate", "diag/tool_call_rate"):
        assert before[key] == pytest.approx(finite_mean(rows[s][key] for s in window if key in rows[s]), abs=1e-9), key
        assert run["signals_first10"][key] == pytest.approx(finite_mean(rows[s][key] for s in range(10) if key in rows[s]), abs=1e-9)
    assert before["lld/delta_incorrect"] is None  # Stage A did not log it: absent, not zero
    step, value = before["most_negative_delta_correct"]
    assert value == min(v for s in window if not math.isnan(v := rows[s]["lld/delta_correct"])) and rows[step]["lld/delta_correct"] == value
    step, value = before["largest_drift"]
    assert value == max(rows[s]["drift/kl_k3_last"] for s in window)
    held = next(r for r in rep["runs"] if r["role"] == "preset")
    assert held["signals_before"] is None and held["alarm_false"] == len(held["alarm_firings"])


def test_at_horizon_on_hand_worked_runs() -> None:
    """The post hoc reading at H on 40-step runs worked by hand (trailing means over 20 steps)."""
    import pandas as pd

    steps = range(40)
    # 25 steps of reward 1 then 15 of 0: the trailing-20 mean first reaches 0.5 x its peak 1.0 at step 34
    # (steps 15-34 hold ten 1s), so steps 34-39 are flagged: 6; at step 39 the window 20-39 holds five 1s.
    fall = pd.DataFrame({"train/reward": [1.0] * 25 + [0.0] * 15, "train/answered_rate": [1.0] * 40}, index=steps)
    assert stage_c.at_horizon(fall) == {"flagged_at_h": 6, "trailing_peak": 1.0, "trailing_at_h": 0.25}
    # flat reward, answered 1 then 0 from step 20: the trailing answered rate is < 0.5 once 11 zeros are in
    # the window (step 30), so steps 30-39 are flagged: 10; the reward never falls from its peak.
    quiet = pd.DataFrame({"train/reward": [0.5] * 40, "train/answered_rate": [1.0] * 20 + [0.0] * 20}, index=steps)
    assert stage_c.at_horizon(quiet) == {"flagged_at_h": 10, "trailing_peak": 0.5, "trailing_at_h": 0.5}
    # the stretch counts back from the last step only: a recovery on the last step ends it
    back = pd.DataFrame({"train/reward": [1.0] * 25 + [0.0] * 14 + [20.0], "train/answered_rate": [1.0] * 40}, index=steps)
    assert stage_c.at_horizon(back)["flagged_at_h"] == 0
    # the two conditions in turn: answered 0 on steps 0-24 (its trailing mean < 0.5 on steps 19-33, ten 1s
    # from step 34), reward 1 on steps 0-19 then 0 (trailing <= 0.5 x 1.0 from step 29: ten 1s in 10-29).
    # Either flag holds on steps 19-39 (21), but the rule holds each alone: reward 29-39 is 11, answered 0.
    turns = pd.DataFrame({"train/reward": [1.0] * 20 + [0.0] * 20, "train/answered_rate": [0.0] * 25 + [1.0] * 15}, index=steps)
    assert stage_c.at_horizon(turns) == {"flagged_at_h": 11, "trailing_peak": 1.0, "trailing_at_h": 0.0}
    # no reward ever: no positive peak, nothing flagged by reward, and no finite peak to report
    none = pd.DataFrame({"train/reward": [0.0] * 40}, index=steps)
    assert stage_c.at_horizon(none) == {"flagged_at_h": 0, "trailing_peak": 0.0, "trailing_at_h": 0.0}


def test_at_horizon_from_the_raw_csv(rep) -> None:
    """flagged_at_h and the trailing peak of every stand-in run, recomputed here from the raw CSV."""
    for r in rep["runs"]:
        rows = raw(source_seed(r["seed"]), STAND_IN[r["role"]])
        kept = [s for s in sorted(rows) if s < 80]
        reward = [rows[s]["train/reward"] for s in kept]
        answered = [rows[s].get("train/answered_rate", math.nan) for s in kept]
        smooth, low_reward, low_answered, peak = [], [], [], -math.inf
        for i in range(len(kept)):
            if i < 19:
                smooth.append(math.nan)
                low_reward.append(False)
                low_answered.append(False)
                continue
            m = statistics.fmean(reward[i - 19:i + 1])
            a = [v for v in answered[i - 19:i + 1] if not math.isnan(v)]
            peak = max(peak, m)
            smooth.append(m)
            low_reward.append(peak > 0 and m <= 0.5 * peak)
            low_answered.append(bool(a) and statistics.fmean(a) < 0.5)
        stretch = max(len(f) - max((i + 1 for i, x in enumerate(f) if not x), default=0) for f in (low_reward, low_answered))
        assert r["flagged_at_h"] == stretch, (r["role"], r["seed"])
        assert r["trailing_peak"] == pytest.approx(peak, abs=1e-12) and r["trailing_at_h"] == pytest.approx(smooth[-1], abs=1e-12)
        if not r["collapsed"]:
            assert stretch < 30  # held by the rule: its flagged stretch never reached the hold
    # the stand-in "best" is Stage A's GRPO at 1e-3: seed 3 died at step 69, held by H = 80 but flagged at its end
    h = rep["post_hoc_at_horizon"]
    best = {r["seed"]: r for r in rep["runs"] if r["role"] == "best"}
    assert h["best"]["held"] == sum(not r["collapsed"] for r in best.values())
    assert h["best"]["stretches"] == {s: r["flagged_at_h"] for s, r in best.items() if not r["collapsed"] and r["flagged_at_h"] > 0}
    assert h["best"]["inside_at_h"] == len(h["best"]["stretches"]) > 0
    assert h["grpo"]["held"] == 0 and h["grpo"]["stretches"] == {}


def test_text_and_json(rep, tmp_path, capsys) -> None:
    printed = stage_c.text(rep)
    assert "P1 (llds vs grpo" in printed and "P3 (preset - best" in printed and "Signals over the 10 steps before each death" in printed
    assert "| grpo | 20 | yes | 19 |" in printed and "| 19 (6) |" in printed
    assert "Post hoc (added after seeds 20-26 were seen; descriptive, not a test)" in printed
    with pytest.raises(SystemExit, match="no Stage C archive yet"):
        stage_c.main(["--lab", str(tmp_path / "nowhere")])
    (tmp_path / stage_c.NAME).mkdir()
    assert stage_c.main(["--lab", str(tmp_path)]) == 0
    assert "partial: no test computed" in capsys.readouterr().out
    assert json.loads((tmp_path / stage_c.NAME / "stage_c.json").read_text())["status"] == "partial"



def test_t_table_matches_scipy() -> None:
    """The 95% t quantiles the lab's intervals use (Stage C's 11 df among them), against scipy's."""
    from scipy.stats import t

    from lab.demo_seeds import T975

    assert set(T975) >= set(range(1, 12))
    for df, q in T975.items():
        assert q == pytest.approx(float(t.ppf(0.975, df)), abs=6e-4), df


def _lost_demo_runs(root) -> list[str]:
    """The preset's archived demo runs under ``root`` that the calibration's rule calls lost, read with json and csv."""
    lost = []
    for summary in sorted(root.glob("stable_*/seed*/summary.json")):
        with gzip.open(summary.parent / "metrics.csv.gz", "rt", newline="") as f:
            answered = [float(r["train/answered_rate"]) for r in csv.DictReader(f) if r.get("train/answered_rate")]
        if json.loads(summary.read_text())["dev_after"]["em"] == 0 or sum(answered[-10:]) / 10 < 0.5:
            lost.append(f"{summary.parent.parent.name}/{summary.parent.name}")
    return lost


def _calib_round(n: int, tmp_path) -> dict:
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / f"round{n}.json"
    done = subprocess.run([sys.executable, str(ROOT / "lab" / "calib_c.py"), "--round", str(n), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_the_calibrations_first_round_reads_not_calibrated_from_its_archives(tmp_path):
    """lab/calib_c.py --round 1 against the archived runs read here with json and csv: the preset from 4x
    lost seed 8 (dev EM 0 after), so round 1 is "not calibrated" though runs of it were never made."""
    from tests.conftest import ROOT

    got = _calib_round(1, tmp_path)
    lost = _lost_demo_runs(ROOT / "lab" / "archive" / "demo" / "c_calib")
    assert lost == ["stable_2.0e-3/seed8"]
    assert [k for k, v in got["demo"].items() if v and v["lost"]] == lost
    assert got["checks"]["demo_4x_8x_not_lost"] is False and got["verdict"] == "not calibrated"
    assert "stable_2.0e-3/seed6" in got["missing"]  # decided without it


def test_the_calibrations_second_round_reads_not_calibrated_from_its_archives(tmp_path):
    """Round 2 (tied batches past the target cut the rate): the preset from 4x lost seed 6 (dev EM
    0.281 -> 0, answered 0 over its last 10 steps); the sweep stopped there, so its real-model half
    and seed 7 were never run, and the verdict is "not calibrated" without them."""
    from tests.conftest import ROOT

    got = _calib_round(2, tmp_path)
    lost = _lost_demo_runs(ROOT / "lab" / "archive" / "demo" / "c_calib" / "round2")
    assert lost == ["stable_2.0e-3/seed6"]
    assert [k for k, v in got["demo"].items() if v and v["lost"]] == lost
    assert got["checks"]["demo_4x_8x_not_lost"] is False and got["verdict"] == "not calibrated"
    assert "slowstart_cut_2e-3/seed1" in got["missing"] and "stable_2.0e-3/seed7" in got["missing"]


def _own_rate_pairs(demo) -> list[float]:
    """Round 3's own-rate pairs, seeds 6-8: the preset's dev EM change minus the shipped demo's, from the summaries."""
    change = lambda p: json.loads((p / "summary.json").read_text())["dev_em_change"]["change"]  # noqa: E731
    return [change(demo / "round3" / "stable_5.0e-4" / f"seed{s}") - change(demo / "shipped" / f"seed{s}") for s in (6, 7, 8)]


def test_the_calibrations_third_round_demo_half_reads_from_its_archives(tmp_path):
    """Round 3 (no optimiser step on a zero gradient): none of its 9 demo runs lost, read here with
    json and csv; the own-rate pairs (preset minus shipped dev EM change) recomputed from the summaries."""
    import statistics

    from tests.conftest import ROOT

    got = _calib_round(3, tmp_path)
    demo = ROOT / "lab" / "archive" / "demo" / "c_calib"
    assert len(list((demo / "round3").glob("stable_*/seed*/summary.json"))) == 9
    assert _lost_demo_runs(demo / "round3") == [] and got["checks"]["demo_4x_8x_not_lost"] is True
    pairs = _own_rate_pairs(demo)
    assert got["own_rate"]["pairs"] == pytest.approx(pairs) and statistics.fmean(pairs) == pytest.approx(-0.026, abs=5e-4)
    assert not [k for k in got["missing"] if not k.startswith("slowstart_skip_")]  # only the real-model half is missing


# Round 3's real-model runs as CALIBRATION_real_lm_C.md quotes them: (arm, seed) -> (held to 80 steps,
# reward over the last 10 steps, median rate).
ROUND3_REAL = {
    ("slowstart_skip_2e-3", 1): (True, 0.431, 3.81e-4),
    ("slowstart_skip_4e-3", 1): (True, 0.481, 3.46e-4),
    ("slowstart_skip_2e-3", 2): (True, 0.481, 4.60e-4),
    ("slowstart_skip_4e-3", 2): (True, 0.406, 4.41e-4),
    ("slowstart_skip_2e-3", 3): (True, 0.5125, 2.44e-4),
    ("slowstart_skip_4e-3", 3): (True, 0.575, 3.06e-4),
}


@pytest.mark.parametrize("arm,seed", sorted(ROUND3_REAL))
def test_the_calibrations_third_round_real_runs_recomputed_from_their_csvs(tmp_path, arm, seed):
    """Round 3's real-model runs as CALIBRATION_real_lm_C.md quotes them, from the raw CSVs with this
    test's own code: 80 steps; the collapse rule written out (trailing-20 reward <= 0.5 x its running
    peak, or trailing-20 answered < 0.5, for 30 consecutive steps) holds or not as quoted; the reward
    over the last 10 steps and the median rate; calib_c.py reads the same."""
    from tests.conftest import ROOT

    held, last10, lr = ROUND3_REAL[arm, seed]
    got = _calib_round(3, tmp_path)
    base = ROOT / "lab" / "archive" / "collapse" / "real_lm_C_calib"
    text = (base.parent / "CALIBRATION_real_lm_C.md").read_text()
    with gzip.open(base / arm / f"seed{seed}" / "metrics.csv.gz", "rt", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("train/reward")}
    steps = sorted(rows)
    assert steps == list(range(80)), arm
    reward = [float(rows[s]["train/reward"]) for s in steps]
    answered = [float(rows[s]["train/answered_rate"]) for s in steps]
    bad, peak = [], float("-inf")
    for t in steps:
        trail_r = sum(reward[max(0, t - 19):t + 1]) / len(reward[max(0, t - 19):t + 1])
        trail_a = sum(answered[max(0, t - 19):t + 1]) / len(answered[max(0, t - 19):t + 1])
        peak = max(peak, trail_r)
        bad.append(trail_r <= 0.5 * peak or trail_a < 0.5)
    longest = max((len(s) for s in "".join("x" if b else "." for b in bad).split(".")), default=0)
    assert (longest < 30) is held, (arm, seed, longest)
    assert sum(reward[-10:]) / 10 == pytest.approx(last10, abs=5e-4)
    assert statistics.median(float(rows[s]["train/lr"]) for s in steps) == pytest.approx(lr, rel=2e-3)
    assert got["real"][f"{arm}/seed{seed}"]["holds"] is held
    assert f"{last10:.3f}" in text
    if seed >= 2:  # quoted from seed 2 on: answered over the last 10 steps
        assert f"{sum(answered[-10:]) / 10:.3f}" in text


def test_the_calibrations_third_round_reads_calibrated(tmp_path):
    """Round 3's verdict as CALIBRATION_real_lm_C.md and docs/stability.md state it: nothing missing,
    every real-model run held, and the own-rate interval recomputed here with scipy's t quantile (not
    the lab's table) from the archived summaries."""
    from scipy.stats import t

    from tests.conftest import ROOT

    got = _calib_round(3, tmp_path)
    assert got["missing"] == [] and got["verdict"] == "calibrated"
    assert len(got["real"]) == 6 and all(r["holds"] for r in got["real"].values())
    demo = ROOT / "lab" / "archive" / "demo" / "c_calib"
    pairs = _own_rate_pairs(demo)
    mean, half = statistics.fmean(pairs), float(t.ppf(0.975, 2)) * statistics.stdev(pairs) / len(pairs) ** 0.5
    quoted = f"{mean:+.3f} (95% t interval {mean - half:+.3f} to {mean + half:+.3f}, 3 seeds)"
    assert quoted == "-0.026 (95% t interval -0.378 to +0.326, 3 seeds)"
    calibration = (ROOT / "lab" / "archive" / "collapse" / "CALIBRATION_real_lm_C.md").read_text()
    stability = (ROOT / "docs" / "stability.md").read_text()
    for text in (calibration, stability):
        assert quoted in " ".join(text.split())
    assert "15 of 15 runs not lost" in " ".join(calibration.split())
    assert got["checks"]["demo_4x_8x_not_lost"] is True and len([k for k in got["demo"] if not k.startswith("shipped")]) == 9
    assert "kept 6 of 6 real-model runs alive" in " ".join(stability.split())
    # collapse_lab.md's summary line: the ranges over the six real-model runs, from the CSVs
    last10, rates = [], []
    for arm in ("slowstart_skip_2e-3", "slowstart_skip_4e-3"):
        for seed in (1, 2, 3):
            path = ROOT / "lab" / "archive" / "collapse" / "real_lm_C_calib" / arm / f"seed{seed}" / "metrics.csv.gz"
            with gzip.open(path, "rt", newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("train/reward")]
            last10.append(sum(float(r["train/reward"]) for r in rows[-10:]) / 10)
            rates.append(statistics.median(float(r["train/lr"]) for r in rows))
    lab = " ".join((ROOT / "docs" / "lab" / "collapse_lab.md").read_text().split())
    assert (f"15 of 15 runs not lost. Real model: 6 of 6 held (last-10 reward {min(last10):.3f}-{max(last10):.3f}, "
            f"median rate {min(rates):.2e} to {max(rates):.2e}".replace("e-0", "e-")) in lab
    assert max(rates) <= 5e-4 and quoted in lab  # "at or under GRPO's best fixed rate"
