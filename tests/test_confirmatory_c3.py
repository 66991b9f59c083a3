"""lab/confirmatory.py --c3, C3's registered goal (lab/archive/collapse/C3.md), on small hand-made
archives written here (per-step metrics.csv.gz and each set's collapse.json, as lab/collapse.py writes
them) whose collapse steps, rewards and controller figures are worked out by hand below: a complete
set that meets the goal, one that fails (i), one that fails (ii) by its lower bound, a partial set
that computes no test, and the demo transfer check."""
import csv
import gzip
import json
from pathlib import Path

import pytest
from conftest import load_lab

STEPS = 1100
GRPO_REWARD = 0.3
MEETS = [0.01] * 5 + [0.03] * 5  # mean 0.02; sd = 0.01 x sqrt(10 / 9), SE = 0.01 / 3, half = 2.262 / 300 = 0.00754
LOW_BOUND_FAILS = [0.10, -0.09] * 5  # mean 0.005 >= 0; SE = 0.095 / 3, half = 2.262 x 0.095 / 3 = 0.071630: low -0.066630
OTHER_STARTS = [0.1, 0.2, 0.3, 0.4, 0.5]  # mean 0.3; sd sqrt(0.025), half 2.776 x 0.158114 / sqrt(5) = 0.196293 (4 df)
DROP = 400  # a collapsing run's reward is 0 from this step: its trailing-20 mean is <= half its peak
COLLAPSE_STEP = 409  # once 10 of the 20 steps are 0 (step 409), and stays so past the 30-step hold

# The preset runs' controller columns, one period of 10 steps repeated (1,100 = 110 periods): by hand,
# 4 of 10 steps below 2.5e-4; 3 held (the count is cumulative: 330 at the end, share 0.3); updates
# 8,8,3,8,8,8,2,8,8,8 (mean 6.9, 2 stopped a period: 220); 7 of 10 with signal, whose KLs sort to
# 0.0005, 0.0008, 0.0009, 0.001, 0.002, 0.003, 0.004 (median 0.001; the held steps' tiny KLs left out);
# rates 1..5e-4 twice each (median 3e-4).
LR = [1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 5e-4, 4e-4, 3e-4, 2e-4, 1e-4]
HELD = [0, 0, 1, 0, 0, 1, 0, 0, 1, 0]
UPDATES = [8, 8, 3, 8, 8, 8, 2, 8, 8, 8]
SIGNAL = [1, 1, 0, 1, 1, 0, 1, 1, 0, 1]
KL = [0.001, 0.002, 1e-5, 0.004, 0.0005, 2e-5, 0.003, 0.0008, 3e-5, 0.0009]
KIND = {"cpu_model": "AMD EPYC", "cpu_flags_simd": ["avx", "avx2"], "cpu_capability": "AVX2", "torch": "2.x"}


@pytest.fixture(scope="module")
def conf():
    return load_lab("confirmatory")


def write_run(path, reward: float, preset: bool, collapse: bool = False, steps: int = STEPS) -> None:
    """One run's metrics.csv.gz: a constant reward (0 from DROP on when it collapses), every rollout
    answered; a preset run also logs the controller's columns."""
    path.mkdir(parents=True)
    fields = ["step", "train/reward", "train/answered_rate", "train/lr", "drift/updates", "drift/stopped", "drift/signal",
              "drift/kl_k3_last", "drift/rate_held", "drift/lr_scale"]
    held = 0
    with gzip.open(path / "metrics.csv.gz", "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for step in range(steps):
            i = step % 10
            held += HELD[i]
            r = 0.0 if collapse and step >= DROP else reward
            if preset:
                w.writerow([step, r, 1.0, LR[i], UPDATES[i], float(UPDATES[i] < 8), SIGNAL[i], KL[i], held, LR[i] / 1e-3])
            else:
                w.writerow([step, r, 1.0, 2.5e-4, 8, 0.0, 1, 0.001, "", ""])


def write_set(lab, name: str, arm: str, rate: str, rewards: dict[int, float], collapsed=(), skip=(), extra_configs=()) -> None:
    runs = {}
    for seed, reward in rewards.items():
        if seed in skip:
            continue
        write_run(lab / name / arm / f"seed{seed}", reward, arm == "stable", seed in collapsed)
        runs[f"{arm}/seed{seed}"] = {"cpu_s": 900.0, "machine_kind": {**KIND, "init": f"runs/lab/policy_q{seed % 2}", "init_digest": f"d{seed % 2}"}}
    meta = {"recipe": "lab/configs/constant.yaml", "arms": [arm], "seeds": sorted(rewards), "horizon": STEPS,
            "extra_configs": list(extra_configs), "overrides": ["--model.optim.lr", rate], "runs": runs}
    (lab / name).mkdir(parents=True, exist_ok=True)
    (lab / name / "collapse.json").write_text(json.dumps({"meta": meta}))


def make_c3(lab, primary=MEETS, collapsed_2e3=(), skip_grpo=()):
    """The four registered sets: GRPO at 2.5e-4 earns 0.3 on every seed; the preset from 1e-3 earns
    0.3 + ``primary``[i]; from 5e-4 and from 2e-3, 0.3 + OTHER_STARTS[i]."""
    seeds = range(30, 40)
    write_set(lab, "c3_2.5e-4", "grpo", "2.5e-4", {s: GRPO_REWARD for s in seeds}, skip=skip_grpo)
    write_set(lab, "c3_1e-3", "stable", "1e-3", {s: GRPO_REWARD + d for s, d in zip(seeds, primary)})
    write_set(lab, "c3_5e-4", "stable", "5e-4", {s: GRPO_REWARD + d for s, d in zip(range(30, 35), OTHER_STARTS)})
    write_set(lab, "c3_2e-3", "stable", "2e-3", {s: GRPO_REWARD + d for s, d in zip(range(30, 35), OTHER_STARTS)}, collapsed=collapsed_2e3)
    return lab


def test_a_complete_set_that_meets_the_goal(conf, tmp_path):
    rep = conf.c3_report(make_c3(tmp_path / "lab"), tmp_path / "no_demo")
    assert rep["status"] == "complete" and len(rep["runs"]) == 30
    p = rep["primary"]
    assert p["mean_diff"] == pytest.approx(0.02) and p["df"] == 9
    assert p["low"] == pytest.approx(0.02 - 0.00754, abs=1e-9) and p["high"] == pytest.approx(0.02 + 0.00754, abs=1e-9)
    assert rep["held_all"] and p["holds"] and rep["goal_met"]
    assert rep["preset_collapsed"] == {"1e-3": {"collapsed": 0, "n": 10}, "5e-4": {"collapsed": 0, "n": 5}, "2e-3": {"collapsed": 0, "n": 5}}
    for rate in ("5e-4", "2e-3"):
        d = rep["descriptive"]["reward_vs_2.5e-4"][rate]
        assert d["df"] == 4 and d["mean_diff"] == pytest.approx(0.3)
        assert d["low"] == pytest.approx(0.103707, abs=1e-6) and d["high"] == pytest.approx(0.496293, abs=1e-6)
    assert rep["descriptive"]["grpo_2.5e-4_collapsed"] == {"collapsed": 0, "n": 10}
    assert rep["llds"]["status"] == "not run" and rep["demo"]["status"] == "not run" and rep["goal_pairs_across_machines"] == []
    preset = [r for r in rep["runs"] if r["arm"] == "stable"]
    assert len(preset) == 20
    for r in preset:  # the controller figures, by hand (the period above)
        assert r["lr_min"] == pytest.approx(1e-4) and r["lr_median"] == pytest.approx(3e-4) and r["lr_max"] == pytest.approx(5e-4)
        assert r["below_safe_share"] == pytest.approx(0.4) and r["held_share"] == pytest.approx(0.3)
        assert r["updates_mean"] == pytest.approx(6.9) and r["stopped_steps"] == 220
        assert r["signal_share"] == pytest.approx(0.7) and r["kl_signal_median"] == pytest.approx(0.001)
        assert r["cpu_min"] == pytest.approx(15.0)
    text = conf.c3_text(rep)
    assert "(ii) primary: last-100 reward, preset from 1e-3 minus GRPO at 2.5e-4: +0.020 [+0.012, +0.028] (9 df)" in text
    assert "Goal: met." in text


def test_one_collapse_in_any_preset_arm_fails_i(conf, tmp_path):
    """Seed 32 of the preset from 2e-3 drops to 0 at step 400: collapsed at step 409 (hand-worked), and
    the goal fails although the primary holds."""
    rep = conf.c3_report(make_c3(tmp_path / "lab", collapsed_2e3=(32,)), tmp_path / "no_demo")
    run = next(r for r in rep["runs"] if r["rate"] == "2e-3" and r["seed"] == 32)
    assert run["collapsed"] and run["time"] == COLLAPSE_STEP and run["final_reward"] == 0.0
    assert rep["preset_collapsed"]["2e-3"] == {"collapsed": 1, "n": 5} and not rep["held_all"]
    assert rep["primary"]["holds"] and not rep["goal_met"]
    assert "(i) preset runs collapsed by H (hold 30): 0 of 10 from 1e-3, 0 of 5 from 5e-4, 1 of 5 from 2e-3 -> fails." in conf.c3_text(rep)


def test_a_mean_above_zero_with_a_low_lower_bound_fails_ii(conf, tmp_path):
    rep = conf.c3_report(make_c3(tmp_path / "lab", primary=LOW_BOUND_FAILS), tmp_path / "no_demo")
    p = rep["primary"]
    assert p["mean_diff"] == pytest.approx(0.005) and p["mean_diff"] >= 0
    assert p["low"] == pytest.approx(0.005 - 0.071630, abs=1e-6) and p["low"] <= -0.03
    assert rep["held_all"] and not p["holds"] and not rep["goal_met"]
    assert "Goal: not met." in conf.c3_text(rep)


def test_a_partial_set_computes_no_test(conf, tmp_path, monkeypatch):
    """GRPO's seed 39 not archived: counts only; the paired difference is never computed (it would
    raise here), and the report carries no goal, interval or per-run reward."""
    lab = make_c3(tmp_path / "lab", skip_grpo=(39,))

    def no_test(*_):
        raise AssertionError("a test computed on a partial set")

    monkeypatch.setattr(conf, "paired_difference", no_test)
    rep = conf.c3_report(lab, tmp_path / "no_demo")
    assert rep["status"] == "partial" and rep["archived"] == 29 and rep["registered"] == 30
    assert rep["counts"]["grpo 2.5e-4"] == {"archived": 9, "registered": 10} and "c3_2.5e-4/grpo/seed39" in rep["missing"]
    assert not {"goal_met", "primary", "held_all", "runs", "descriptive"} & set(rep)
    text = conf.c3_text(rep)
    assert "29 of the 30 registered runs archived; partial: no test computed" in text and "Goal" not in text


def test_a_run_archived_before_its_set_is_recorded_counts_as_missing(conf, tmp_path):
    """The runner records a run's machine in collapse.json when its invocation ends: until then the
    run has no machine kind to pair on and the set is partial."""
    lab = make_c3(tmp_path / "lab")
    meta = json.loads((lab / "c3_1e-3" / "collapse.json").read_text())
    del meta["meta"]["runs"]["stable/seed35"]
    (lab / "c3_1e-3" / "collapse.json").write_text(json.dumps(meta))
    rep = conf.c3_report(lab, tmp_path / "no_demo")
    assert rep["status"] == "partial" and "c3_1e-3/stable/seed35 (set unfinished)" in rep["missing"]


def test_a_set_at_another_rate_is_refused(conf, tmp_path):
    lab = make_c3(tmp_path / "lab")
    meta = json.loads((lab / "c3_1e-3" / "collapse.json").read_text())
    meta["meta"]["overrides"] = ["--model.optim.lr", "5e-4"]
    (lab / "c3_1e-3" / "collapse.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match=r"confirmatory: not C3's registered sets in .*: c3_1e-3: lr 5e-4, registered 1e-3"):
        conf.c3_report(lab, tmp_path / "no_demo")


def test_the_optional_llds_arm_is_reported_beside_the_goal(conf, tmp_path):
    lab = make_c3(tmp_path / "lab")
    write_set(lab, "c3_llds_1e-3", "stable", "1e-3", {s: 0.5 for s in range(30, 35)}, extra_configs=["lab/configs/arms/llds.yaml"])
    rep = conf.c3_report(lab, tmp_path / "no_demo")
    assert rep["llds"]["collapsed"] == 0 and rep["llds"]["mean_final_reward"] == pytest.approx(0.5)
    assert rep["llds"]["reward_vs_2.5e-4"]["mean_diff"] == pytest.approx(0.2) and rep["goal_met"]
    # without arms/llds.yaml composed it is not the registered arm
    meta = json.loads((lab / "c3_llds_1e-3" / "collapse.json").read_text())
    meta["meta"]["extra_configs"] = []
    (lab / "c3_llds_1e-3" / "collapse.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match=r"c3_llds_1e-3: no --config lab/configs/arms/llds.yaml"):
        conf.c3_report(lab, tmp_path / "no_demo")


def write_demo(root, changes: dict[str, list[float]], metrics=()) -> None:
    """Each run's summary.json; the arms in ``metrics`` also log 30 steps of the preset's controller
    columns (three periods of the hand-worked ten above)."""
    for arm, values in changes.items():
        for seed, change in zip((3, 4, 5), values):
            if change is None:
                continue
            if arm in metrics:
                write_run(root / arm / f"seed{seed}", 0.3, preset=True, steps=30)
            else:
                (root / arm / f"seed{seed}").mkdir(parents=True)
            summary = {"dev_em_change": {"n": 64, "before": 0.2, "after": 0.2 + change, "change": change, "se": 0.05, "z": change / 0.05},
                       "dev_after": {"answered": 0.5 + seed / 10}}
            (root / arm / f"seed{seed}" / "summary.json").write_text(json.dumps(summary))


def test_demo_transfer_check_by_hand(conf, tmp_path):
    """(b) - (a) per seed 0.03, 0.02, 0.04: mean 0.03, sd 0.01, half 4.303 x 0.01 / sqrt(3) = 0.024843
    (2 df); (c) - (a) -0.02 on every seed: an interval of width 0."""
    demo = tmp_path / "demo"
    write_demo(demo, {"shipped": [0.0, 0.02, -0.02], "stable_5e-4": [0.03, 0.04, 0.02], "stable_2e-3": [-0.02, 0.0, -0.04]},
               metrics=("stable_5e-4",))
    rep = conf.c3_demo(demo)
    assert rep["status"] == "complete" and rep["archived"] == 9
    b, c = rep["difference_vs_shipped"]["stable_5e-4"], rep["difference_vs_shipped"]["stable_2e-3"]
    assert b["df"] == 2 and b["mean_diff"] == pytest.approx(0.03) and b["low"] == pytest.approx(0.03 - 0.024843, abs=1e-6)
    assert c["mean_diff"] == pytest.approx(-0.02) and c["low"] == pytest.approx(-0.02) and c["high"] == pytest.approx(-0.02)
    rep = conf.c3_report(make_c3(tmp_path / "lab"), demo)
    assert rep["demo"]["changes"]["stable_5e-4"][4]["change"] == pytest.approx(0.04)
    text = conf.c3_text(rep)
    assert "Demo stable_5e-4 minus shipped: +0.030 [+0.005, +0.055] (2 df)." in text
    # 30 steps of the ten-step period: rates 1-5e-4 (median 3e-4), 9 held of 30, 6.9 updates, 7 of 10
    # with signal whose KLs have median 0.001, 6 steps stopped (2 a period); a run without metrics says n/a
    assert "| stable_5e-4 | 4 | 0.200 -> 0.240 | 0.90 | 1.00e-04 / 3.00e-04 / 5.00e-04 | 0.30 | 6.90 | 6 | 0.70 | 0.00100 |" in text
    assert "| shipped | 3 | 0.200 -> 0.200 | 0.80 | n/a / n/a / n/a | n/a | n/a | n/a | n/a | n/a |" in text
    # The demo check is its own set: complete, it is reported whole while the lab set is partial.
    partial_lab = make_c3(tmp_path / "lab_partial", skip_grpo=(39,))
    rep = conf.c3_report(partial_lab, demo)
    assert rep["status"] == "partial" and rep["demo"]["status"] == "complete"
    assert "Demo stable_5e-4 minus shipped: +0.030 [+0.005, +0.055] (2 df)." in conf.c3_text(rep)
    # two of (c)'s seeds only: counts, no interval
    partial = tmp_path / "demo_partial"
    write_demo(partial, {"shipped": [0.0, 0.02, -0.02], "stable_5e-4": [0.03, 0.04, 0.02], "stable_2e-3": [-0.02, 0.0, None]})
    rep = conf.c3_report(make_c3(tmp_path / "lab2"), partial)
    assert rep["demo"] == {"status": "partial", "archived": 8, "registered": 9}


def test_main_writes_c3_json_and_names_a_folder_without_c3(conf, tmp_path, capsys):
    lab = make_c3(tmp_path / "lab")
    (tmp_path / "demo" / "shipped").mkdir(parents=True)  # the demo check's archive, none of its runs yet
    assert conf.main(["--c3", "--set", str(lab / "c3_1e-3"), "--demo", str(tmp_path / "demo")]) == 0
    assert "Goal: met." in capsys.readouterr().out and json.loads((lab / "c3.json").read_text())["goal_met"] is True
    with pytest.raises(SystemExit, match=r"confirmatory: neither C3.md nor a C3 set .* in .*: with --c3, --set must be a set"):
        conf.main(["--c3", "--set", str(tmp_path / "elsewhere" / "x")])
    assert not (tmp_path / "elsewhere").exists()


def test_controller_table_of_one_set(conf, tmp_path, capsys):
    """--controller: per run of a set (here the pilot's shape: 100 steps), the same figures."""
    lab = tmp_path / "lab"
    write_set(lab, "pilot", "stable", "1e-3", {0: 0.3, 1: 0.3})
    meta = json.loads((lab / "pilot" / "collapse.json").read_text())
    meta["meta"]["horizon"] = 100
    (lab / "pilot" / "collapse.json").write_text(json.dumps(meta))
    assert conf.main(["--controller", str(lab / "pilot")]) == 0
    out = capsys.readouterr().out
    # the first 100 steps: 10 periods, the same shares; 20 stopped steps
    assert "| stable/seed0 | 100 | no | 1.00e-04 / 3.00e-04 / 5.00e-04 | 0.40 | 0.30 | 6.90 | 20 | 0.70 | 0.00100 |" in out


def test_a_demo_folder_that_is_not_the_demo_checks_archive_is_refused(conf, tmp_path, capsys):
    """A missing folder, a file or another archive as --demo: it exited 0 with "0 of 9 runs archived"."""
    lab = make_c3(tmp_path / "lab")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "other" / "grpo" / "seed0").mkdir(parents=True)
    for demo, why in (("missing", "no such directory"), ("a_file", "a file, not the demo transfer check's archive"),
                      ("other", "holds none of the demo transfer check's arms")):
        with pytest.raises(SystemExit, match=rf"^confirmatory: --demo {tmp_path / demo}:? {why}"):
            conf.main(["--c3", "--set", str(lab / "c3_1e-3"), "--demo", str(tmp_path / demo)])
        assert capsys.readouterr().out == "" and not (lab / "c3.json").exists()


def test_json_where_it_cannot_be_written_is_refused_before_the_analysis(conf, tmp_path, capsys):
    lab = make_c3(tmp_path / "lab")
    target = Path("/sys/c3.json")  # a folder no process may create files in, root's included (Linux)
    try:
        target.open("w").close()
        target.unlink()
        pytest.skip("/sys takes new files here")
    except OSError:
        pass
    with pytest.raises(SystemExit, match=rf"^confirmatory: --json {target}: cannot write to /sys: "):
        conf.main(["--c3", "--set", str(lab / "c3_1e-3"), "--json", str(target)])
    assert capsys.readouterr().out == ""  # nothing analysed first


def test_a_set_report_without_meta_and_a_damaged_archive_are_named(conf, tmp_path, capsys):
    """A collapse.json without meta was a KeyError; a garbled metrics.csv.gz a zlib.error naming no file."""
    lab = make_c3(tmp_path / "lab")
    report = lab / "c3_2e-3" / "collapse.json"
    kept = report.read_text()
    report.write_text(json.dumps({"runs": []}))
    with pytest.raises(SystemExit, match=rf"^confirmatory: {report}: no 'meta' \(what the set ran with\)"):
        conf.main(["--c3", "--set", str(lab / "c3_1e-3")])
    report.write_text(kept)
    gz = lab / "c3_1e-3" / "stable" / "seed31" / "metrics.csv.gz"
    data = bytearray(gz.read_bytes())
    data[20:40] = b"\xff" * 20
    gz.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=rf"^confirmatory: {gz}: not a readable metrics CSV \("):
        conf.main(["--c3", "--set", str(lab / "c3_1e-3")])
    assert not (lab / "c3.json").exists()
