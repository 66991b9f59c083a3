"""lab/collapse.py: the report over archived seeds x arms (hand-built runs with known
collapses), the command composition, the archive, and the smoke pipeline end to end."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, load_lab


@pytest.fixture(scope="module")
def collapse():
    return load_lab("collapse")


def archived(path: Path, reward: list[float], answered: float = 1.0, tool: float = 1.0) -> None:
    """A run in the archive's form: metrics.csv.gz (training rows, then evaluation rows logged
    apart as Lightning does) and summary.json."""
    path.mkdir(parents=True)
    n = len(reward)
    frame = pd.DataFrame({"step": range(n), "train/reward": reward, "train/answered_rate": [answered] * n,
                          "diag/tool_call_rate": [tool] * n, "train/grad_norm_max": [1.0] * n})
    extra = pd.DataFrame([{"step": n, "val_after/em": 0.5}])
    with gzip.open(path / "metrics.csv.gz", "wt") as f:
        pd.concat([frame, extra]).to_csv(f, index=False)
    (path / "summary.json").write_text(json.dumps({"dev_before": {"em": 0.25}, "dev_after": {"em": 0.5}, "wall_time_s": 60.0}))


def test_report_counts_collapses_and_tests_arms(collapse, tmp_path) -> None:
    # GRPO: 3 seeds collapse (reward 0.8 for 60 steps, then 0.1), LLDS: 3 seeds hold 0.8.
    fall = [0.8] * 60 + [0.1] * 80
    # trailing-20 mean at step t >= 60: (0.8 * (79 - t) + 0.1 * (t - 59)) / 20 <= 0.4  <=>  t >= 70.43 -> 71
    for s in range(3):
        archived(tmp_path / "grpo" / f"seed{s}", fall)
        archived(tmp_path / "llds" / f"seed{s}", [0.8] * 140)
    meta = {"invocation": "x", "runs": {"grpo/seed0": {"command": "fit ...", "wall_s": 100.0}}}
    labels = {"grpo": "GRPO", "llds": "LLDS"}
    jobs = [(a, s) for a in ("grpo", "llds") for s in range(3)]
    payload = collapse.report(tmp_path, jobs, labels, "grpo", 140, meta)
    runs = {(r["arm"], r["seed"]): r for r in payload["runs"]}
    assert runs[("grpo", 0)]["step"] == 71 and runs[("grpo", 0)]["mode"] == "decay" and runs[("grpo", 0)]["cause"] == "reward"
    assert not runs[("llds", 1)]["collapsed_by_horizon"] and runs[("llds", 1)]["time_to_collapse"] == 140
    arms = payload["arms"]
    assert (arms["grpo"]["collapsed"], arms["llds"]["collapsed"]) == (3, 0)
    t = arms["llds"]["vs_grpo"]
    assert t["fisher_p"] == pytest.approx(0.05)  # 3/3 vs 0/3: 1 / C(6, 3)
    assert t["sign_test"]["wins"] == 3 and t["sign_test"]["p"] == pytest.approx(0.125)
    assert t["rmst_difference"]["diff"] == pytest.approx(140 - 71)
    assert t["final_reward_permutation"]["mean_diff"] == pytest.approx(0.8 - (20 * 0.8 + 80 * 0.1) / 100)  # last 100 steps
    text = (tmp_path / "collapse.md").read_text()
    assert "| GRPO | 0 | yes, 71, reward, decay |" in text and "| LLDS | 3 of 3" not in text
    assert "| LLDS | 0 of 3 (0 / 0) |" in text and "0.050" in text
    assert (tmp_path / "collapse.png").read_bytes()[:4] == b"\x89PNG"


def test_death_when_the_agent_stops_answering(collapse, tmp_path) -> None:
    archived(tmp_path / "grpo" / "seed0", [0.8] * 60 + [0.0] * 60, answered=1.0)
    frame_path = tmp_path / "grpo" / "seed0" / "metrics.csv.gz"
    frame = pd.read_csv(frame_path)
    frame.loc[frame["step"] >= 60, "train/answered_rate"] = 0.0
    with gzip.open(frame_path, "wt") as f:
        frame.to_csv(f, index=False)
    payload = collapse.report(tmp_path, [("grpo", 0)], {}, "grpo", 120, {})
    r = payload["runs"][0]
    # reward: 0.8 * (79 - t) / 20 <= 0.4 from t = 69; answered: (79 - t) / 20 < 0.5 from t = 70
    assert r["collapsed_by_horizon"] and r["step"] == 69 and r["cause"] == "reward" and r["mode"] == "death"


def test_arms_are_the_files_of_the_arms_dir(collapse) -> None:
    arms = collapse.arms_in(ROOT / "lab/configs/arms")
    assert {"grpo", "llds", "onpolicy", "pos_only", "unshared", "kl"} <= set(arms)
    assert arms["llds"][0].startswith("LLDS action gate")


def test_fit_command_composes_recipe_arm_extras(collapse, tmp_path) -> None:
    cmd = collapse.fit_command("lab/configs/constant.yaml", Path("lab/configs/arms/llds.yaml"), tmp_path, "llds", 7, "runs/lab/policy_q1",
                               12, ["configs/guard.yaml"], ["--model.optim.lr", "1e-4"])
    configs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]
    assert configs == ["lab/configs/constant.yaml", "lab/configs/arms/llds.yaml", "configs/guard.yaml"]
    assert cmd[cmd.index("--seed_everything") + 1] == "7" and cmd[cmd.index("--data.seed") + 1] == "7"
    assert cmd[cmd.index("--model.policy.model") + 1] == "runs/lab/policy_q1"
    assert cmd[cmd.index("--trainer.max_steps") + 1] == "12" and cmd[-2:] == ["--model.optim.lr", "1e-4"]


def test_archive_is_byte_stable(collapse, tmp_path) -> None:
    src = tmp_path / "run"
    src.mkdir()
    (src / "metrics.csv").write_text("step,train/reward\n0,0.5\n")
    collapse.archive_run(src, tmp_path / "a")
    collapse.archive_run(src, tmp_path / "b")
    assert (tmp_path / "a" / "metrics.csv.gz").read_bytes() == (tmp_path / "b" / "metrics.csv.gz").read_bytes()


@pytest.mark.slow
def test_smoke_pipeline_end_to_end(collapse, tmp_path) -> None:
    """At toy size: knowledge base, warm start, 2 arms x 2 seeds two at a time from the warm-started
    weights, archived metrics, the report; --report-only redoes it from the archive alone, the same
    report byte for byte (a run and a later --report-only list the runs in one order)."""
    out, archive = tmp_path / "runs", tmp_path / "archive"
    assert collapse.main(["--smoke", "--steps", "2", "--seeds", "0", "1", "--out", str(out), "--archive", str(archive)]) == 0
    result = json.loads((archive / "collapse.json").read_text())
    assert [(r["arm"], r["seed"]) for r in result["runs"]] == [("grpo", 0), ("grpo", 1), ("llds", 0), ("llds", 1)]
    written = (archive / "collapse.md").read_text()
    assert all("error" not in r and r["steps"] == 2 for r in result["runs"])
    assert (archive / "llds" / "seed0" / "metrics.csv.gz").is_file()
    assert "LLDS" in (collapse.run_dir(out, "llds", 0) / "config.yaml").read_text()
    # Each run names the machine kind it ran on (a stratified test's stratum), read back from /proc.
    kind = result["meta"]["runs"]["llds/seed0"]["machine_kind"]
    flags = set(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split(":")[1].split())
    assert kind["cpu_flags_simd"] and set(kind["cpu_flags_simd"]) <= flags
    import shutil

    shutil.rmtree(out)  # the archive alone must be enough
    (archive / "collapse.md").unlink()
    assert collapse.main(["--report-only", "--archive", str(archive), "--out", str(out)]) == 0
    again = json.loads((archive / "collapse.json").read_text())
    assert again["runs"] == result["runs"] and (archive / "collapse.md").read_text() == written


@pytest.mark.parametrize("extra", [["--arms", "nosucharm"], ["--arms", "grpo"], ["--seeds", "3"], ["--", "--model.optim.lr", "1"]],
                         ids=["unknown-arm", "known-arm", "seeds", "fit-overrides"])
def test_report_only_refuses_what_it_would_ignore(collapse, tmp_path, capsys, extra) -> None:
    """--report-only reports every archived run of the set: an option that chooses runs or their
    settings would be ignored, and the committed report rewritten anyway; refused, nothing written."""
    archived(tmp_path / "grpo" / "seed0", [0.8] * 30)
    collapse.report(tmp_path, [("grpo", 0)], {}, "grpo", 30, {"arms": ["grpo"], "seeds": [0]})
    before = {p.name: p.read_bytes() for p in tmp_path.glob("collapse.*")}
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"collapse: --report-only reports every archived run .*: " + extra[0].replace("-", r"\-")):
        collapse.main(["--report-only", "--archive", str(tmp_path), "--out", str(tmp_path / "runs"), *extra])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("collapse.*")} == before
    assert capsys.readouterr().out == ""


def test_alarm_scoring_by_hand() -> None:
    """lab/alarm_eval.py's scoring: a warning counts for a collapse within 100 steps after
    it; earlier or collapse-less warnings are false alarms."""
    ev = load_lab("alarm_eval")
    assert ev.score([150, 250], 270, 100, 20) == {"false": 1, "lead": 20, "warned": True}
    assert ev.score([260], 270, 100, 20) == {"false": 0, "lead": 10, "warned": False}
    assert ev.score([280], 270, 100, 20) == {"false": 1, "lead": None, "warned": False}  # after the fall
    assert ev.score([10, 90], None, 100, 20) == {"false": 2, "lead": None, "warned": False}


def test_reward_baseline_fires_when_the_condition_starts(tmp_path) -> None:
    ev = load_lab("alarm_eval")
    archived(tmp_path / "grpo" / "seed0", [0.8] * 80 + [0.55] * 40)
    (run,) = ev.load_runs([str(tmp_path)])
    # trailing-20 at t >= 80: (0.8 (99 - t) + 0.55 (t - 79)) / 20 < 0.85 x 0.8 <=> t > 88.6 -> first at 89
    assert ev.reward_warnings(run) == [89]


def test_a_set_filled_in_rounds_keeps_every_runs_entry(collapse, tmp_path, monkeypatch) -> None:
    """Two invocations into one set (round 1: arm grpo; round 2: arm llds): the set's collapse.json
    still holds round 1's run entries (machine kind, CPU time) after round 2."""
    archive, out = tmp_path / "archive", tmp_path / "runs"

    def fake_run_all(commands, out, archive, jobs, threads, kinds):  # each run "finishes" with known metrics
        runs = {}
        for arm, seed in commands:
            archived(archive / arm / f"seed{seed}", [0.5] * 40)
            runs[f"{arm}/seed{seed}"] = {"wall_s": 60.0, "cpu_s": 50.0 + seed, "machine_kind": kinds[(arm, seed)]}
        return runs

    monkeypatch.setattr(collapse, "run_all", fake_run_all)
    monkeypatch.setattr(collapse, "weights_digest", lambda directory: "d0")
    common = ["--seeds", "1", "2", "--steps", "40", "--no-build", "--inits", "policy", "--out", str(out), "--archive", str(archive)]
    assert collapse.main(["--arms", "grpo", *common]) == 0
    assert collapse.main(["--arms", "llds", *common]) == 0
    written = (archive / "collapse.json").read_bytes()
    payload = json.loads(written)
    runs = payload["meta"]["runs"]
    assert sorted(runs) == ["grpo/seed1", "grpo/seed2", "llds/seed1", "llds/seed2"]
    assert runs["grpo/seed2"]["cpu_s"] == 52.0 and runs["grpo/seed1"]["machine_kind"]["init_digest"] == "d0"
    # Round 2's report is the set's (round 1's runs too, each with its CPU time), and a report of the
    # archive alone writes the same bytes.
    assert [(r["arm"], r["seed"], r["cpu_s"]) for r in payload["runs"]] == [
        ("llds", 1, 51.0), ("llds", 2, 52.0), ("grpo", 1, 51.0), ("grpo", 2, 52.0)]
    assert collapse.main(["--report-only", "--no-figure", "--archive", str(archive), "--out", str(out)]) == 0
    assert (archive / "collapse.json").read_bytes() == written


def test_a_run_keeps_its_record_when_the_invocation_is_cut_short(collapse, tmp_path) -> None:
    """Each finished run writes its record (command, wall and CPU seconds, machine kind) beside its
    metrics; an invocation stopped before it writes collapse.json loses none of it: a report of the
    archive reads the run's own record."""
    archive, out = tmp_path / "archive", tmp_path / "runs"
    rows = pd.DataFrame({"step": range(30), "train/reward": [0.5] * 30, "train/answered_rate": [1.0] * 30,
                         "diag/tool_call_rate": [1.0] * 30, "train/grad_norm_max": [1.0] * 30})
    csv = tmp_path / "rows.csv"
    rows.to_csv(csv, index=False)
    target = collapse.run_dir(out, "grpo", 7)
    # A real child process: what run_all measures is its own child's wall and CPU time.
    child = [sys.executable, "-c", f"import pathlib, shutil; d = pathlib.Path({str(target)!r}); d.mkdir(parents=True); "
             f"shutil.copy({str(csv)!r}, d / 'metrics.csv'); sum(range(3_000_000))"]
    kind = {"cpu_model": "model X", "cpu_flags_simd": ["avx2"], "init": "policy", "init_digest": "d7"}
    runs = collapse.run_all({("grpo", 7): child}, out, archive, jobs=1, threads=1, kinds={("grpo", 7): kind})
    record = json.loads((archive / "grpo" / "seed7" / collapse.RUN_RECORD).read_text())
    assert record == runs["grpo/seed7"] and record["machine_kind"] == kind
    assert record["wall_s"] > 0 and 0 < record["cpu_s"] < record["wall_s"] + 1.0 and record["command"].startswith("-c ")
    assert not (archive / "collapse.json").exists()  # the invocation "ended" here, before its report
    assert collapse.main(["--report-only", "--no-figure", "--archive", str(archive), "--out", str(out), "--horizon", "30"]) == 0
    report = json.loads((archive / "collapse.json").read_text())
    assert report["meta"]["runs"]["grpo/seed7"] == record
    assert report["runs"][0]["cpu_s"] == record["cpu_s"] and report["runs"][0]["steps"] == 30
    # A damaged record is named, and the report left as it was.
    report["meta"]["runs"] = {}
    (archive / "collapse.json").write_text(json.dumps(report))
    (archive / "grpo" / "seed7" / collapse.RUN_RECORD).write_text('{"command": ')
    with pytest.raises(SystemExit, match=r"run\.json: not JSON .*the run's record is damaged"):
        collapse.main(["--report-only", "--no-figure", "--archive", str(archive), "--out", str(out)])
    assert json.loads((archive / "collapse.json").read_text())["meta"]["runs"] == {}


def a_reported_set(collapse, tmp_path: Path) -> dict[str, bytes]:
    """One archived run and its report, as a set's committed files; their bytes."""
    archived(tmp_path / "grpo" / "seed0", [0.8] * 30)
    collapse.report(tmp_path, [("grpo", 0)], {}, "grpo", 30, {"arms": ["grpo"], "seeds": [0], "hold": 20})
    return {p.name: p.read_bytes() for p in tmp_path.glob("collapse.*")}


def test_hold_zero_is_refused_not_read_as_the_archives(collapse, tmp_path) -> None:
    before = a_reported_set(collapse, tmp_path)
    with pytest.raises(SystemExit, match=r"^collapse: --hold must be >= 1 .*, got 0$"):
        collapse.main(["--report-only", "--archive", str(tmp_path), "--out", str(tmp_path / "runs"), "--hold", "0"])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("collapse.*")} == before


@pytest.mark.parametrize("damage", ["garbled", "truncated"])
def test_a_damaged_archived_gzip_is_named_and_the_report_kept(collapse, tmp_path, damage) -> None:
    before = a_reported_set(collapse, tmp_path)
    gz = tmp_path / "grpo" / "seed0" / "metrics.csv.gz"
    data = bytearray(gz.read_bytes())
    if damage == "garbled":
        data[20:40] = b"\xff" * 20  # the deflate stream itself (zlib.error, which named no file)
    else:
        data = data[: len(data) // 2]
    gz.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=rf"^collapse: {gz}: not a readable metrics CSV \("):
        collapse.main(["--report-only", "--archive", str(tmp_path), "--out", str(tmp_path / "runs")])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("collapse.*")} == before


def test_a_collapse_json_without_meta_is_named(collapse, tmp_path) -> None:
    a_reported_set(collapse, tmp_path)
    (tmp_path / "collapse.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(SystemExit, match=rf"^collapse: {tmp_path / 'collapse.json'}: no 'meta' .*not a collapse report"):
        collapse.main(["--report-only", "--archive", str(tmp_path), "--out", str(tmp_path / "runs")])
