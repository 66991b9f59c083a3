"""lab/demo_seeds.py (the report of lab/archive/demo/PLAN_light_warmstart.md) on hand-built arms:
four test questions, four recipe seeds and the context arm; every number worked out by hand below."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import load_lab


def _records(ems: list[float]) -> list[dict]:
    return [{"data_source": "hop1" if i < 2 else "hop2", "question": f"q{i}", "golden_answers": ["a"], "em": em,
             "answered": float(em > 0), "searches": 1} for i, em in enumerate(ems)]


def _arm(root: Path, name: str, before: list[float], after: list[float], gz: bool = False) -> None:
    run = root / name / "version_0"
    run.mkdir(parents=True)
    for stem, ems in (("val_before_step0", before), ("val_after_step14", after)):
        text = json.dumps({"summary": {}, "records": _records(ems)})
        if gz:
            (run / f"{stem}.json.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (run / f"{stem}.json").write_text(text)


def _arms(root: Path) -> Path:
    _arm(root, "n32_seed0", [0, 0, 0, 0], [1, 1, 1, 0])  # d = 1,1,1,0: mean .75, sd .5, se .25 -> passes
    _arm(root, "n32_seed1", [0, 0, 0, 0], [1, 0, 1, 1], gz=True)  # .75, se .25 -> passes
    _arm(root, "n32_seed2", [0, 0, 0, 1], [1, 1, 0, 1])  # d = 1,1,0,0: mean .5, sd sqrt(1/3), se .2887 -> fails
    _arm(root, "n32_seed3", [0, 0, 0, 0], [0, 1, 1, 1])  # .75 -> passes
    _arm(root, "n64_seed0", [1, 0, 0, 0], [1, 0, 0, 0])  # the context arm: no change
    (root / "notes").mkdir()  # not an arm: ignored
    return root


def test_report_by_hand(tmp_path):
    ds = load_lab("demo_seeds")
    r = ds.report(_arms(tmp_path))
    arms = r["arms"]
    assert [arms[f"n32_seed{s}"]["passes"] for s in range(4)] == [True, True, False, True]
    assert arms["n32_seed0"]["se"] == pytest.approx(0.25) and arms["n32_seed2"]["se"] == pytest.approx((1 / 3) ** 0.5 / 2)
    assert arms["n32_seed0"]["steps"] == 14
    assert arms["n32_seed0"]["answered_before"] == 0 and arms["n32_seed0"]["answered_after"] == pytest.approx(0.75)
    rep = r["replication"]
    # changes .75 .75 .5 .75: mean .6875, sd .125; half-width t(.975, 3) * .125 / 2 = 3.182 * .0625
    assert rep["mean_change"] == pytest.approx(0.6875)
    assert rep["t95_low"] == pytest.approx(0.6875 - 3.182 * 0.0625) and rep["t95_high"] == pytest.approx(0.6875 + 3.182 * 0.0625)
    assert rep["passing_replications"] == 2 and rep["replications"] == 3 and r["shows_held_out_learning"] is True
    assert r["context"]["change"] == 0
    # seed 0 after (1,1,1,0) against the context's before (1,0,0,0): d = 0,1,1,0 -> +.5
    assert r["recipe_after_vs_context_before"]["n32_seed0"]["change"] == pytest.approx(0.5)
    by_type = {t["data_source"]: t for t in arms["n32_seed2"]["by_type"]}
    # hop1: q0, q1 0 -> 1 (+1); hop2: q2 0 -> 0, q3 1 -> 1 (0)
    assert by_type["hop1"]["change"] == 1 and by_type["hop2"]["change"] == 0


def test_one_failing_replication_too_many_means_no(tmp_path):
    ds = load_lab("demo_seeds")
    root = _arms(tmp_path)
    (root / "n32_seed3" / "version_1").mkdir()  # a rerun: the newest version is the arm's
    for stem, ems in (("val_before_step0", [0, 0, 0, 1]), ("val_after_step14", [1, 1, 0, 1])):
        (root / "n32_seed3" / "version_1" / f"{stem}.json").write_text(json.dumps({"summary": {}, "records": _records(ems)}))
    r = ds.report(root)
    assert r["replication"]["passing_replications"] == 1 and r["shows_held_out_learning"] is False


def test_missing_primary_arm_or_evaluation_is_named(tmp_path):
    ds = load_lab("demo_seeds")
    _arm(tmp_path, "n32_seed1", [0, 0, 0, 0], [1, 1, 1, 0])
    with pytest.raises(Exception, match="n32_seed0"):
        ds.report(tmp_path)
    _arm(tmp_path, "n32_seed0", [0, 0, 0, 0], [1, 1, 1, 0])
    (tmp_path / "n32_seed0" / "version_0" / "val_after_step14.json").unlink()
    with pytest.raises(Exception, match="val_after_stepN"):
        ds.report(tmp_path)


def test_majority_rule_counts_every_seed(tmp_path):
    ds = load_lab("demo_seeds")
    _arm(tmp_path, "n32_seed0", [0, 0, 0, 0], [1, 1, 0, 0])  # d = 1,1,0,0: .5 < 2 * .2887 -> fails
    _arm(tmp_path, "n32_seed1", [0, 0, 0, 0], [1, 1, 1, 0])  # passes
    _arm(tmp_path, "n32_seed2", [0, 0, 0, 0], [0, 1, 1, 1])  # passes
    assert ds.report(tmp_path, rule="majority")["shows_held_out_learning"] is True  # 2 of 3
    assert ds.report(tmp_path)["shows_held_out_learning"] is False  # the primary rule needs seed 0
    with pytest.raises(Exception, match="rule"):
        ds.report(tmp_path, rule="best")


def test_shipped_rule_needs_seed_0_and_one_more(tmp_path):
    """PLAN_shipped_demo.md: seed 0 passes and at least 2 of the 3 seeds pass."""
    ds = load_lab("demo_seeds")
    _arm(tmp_path, "n32_seed0", [0, 0, 0, 0], [1, 1, 1, 0])  # passes (.75 >= 2 x .25)
    _arm(tmp_path, "n32_seed1", [0, 0, 0, 0], [1, 1, 0, 0])  # fails (.5 < 2 x .2887)
    _arm(tmp_path, "n32_seed2", [0, 0, 0, 1], [1, 1, 0, 1])  # fails
    assert ds.report(tmp_path, rule="shipped")["shows_held_out_learning"] is False  # 1 of 3
    (tmp_path / "n32_seed2" / "version_1").mkdir()  # a newer version of seed 2 that passes
    for stem, ems in (("val_before_step0", [0, 0, 0, 0]), ("val_after_step14", [0, 1, 1, 1])):
        (tmp_path / "n32_seed2" / "version_1" / f"{stem}.json").write_text(json.dumps({"summary": {}, "records": _records(ems)}))
    assert ds.report(tmp_path, rule="shipped")["shows_held_out_learning"] is True  # seed 0 + seed 2
    # Seeds 1 and 2 passing without seed 0 is not enough (the majority rule would say yes).
    _arm(tmp_path, "n32_seed3", [0, 0, 0, 0], [1, 1, 1, 0])
    for stem, ems in (("val_before_step0", [0, 0, 0, 0]), ("val_after_step14", [1, 1, 0, 0])):
        (tmp_path / "n32_seed0" / "version_0" / f"{stem}.json").write_text(json.dumps({"summary": {}, "records": _records(ems)}))
    r = ds.report(tmp_path, rule="shipped")
    assert not r["arms"]["n32_seed0"]["passes"] and r["shows_held_out_learning"] is False
    assert ds.report(tmp_path, rule="majority")["shows_held_out_learning"] is False  # 2 of 4 is not most


def test_recipe_n_names_the_tested_arms(tmp_path, capsys):
    """--recipe-n 60 reports the arms n60_seed*, not the n32 ones beside them (PLAN_warmstart_1hop.md)."""
    ds = load_lab("demo_seeds")
    _arm(tmp_path, "n32_seed0", [0, 0, 0, 0], [0, 0, 0, 0])  # fails: must not be read as the n60 arm
    _arm(tmp_path, "n60_seed0", [0, 0, 0, 0], [1, 1, 1, 0])  # passes
    _arm(tmp_path, "n60_seed1", [0, 0, 0, 0], [1, 0, 1, 1])  # passes
    assert ds.main([str(tmp_path), "--recipe-n", "60", "--rule", "shipped"]) == 0
    out = capsys.readouterr().out
    assert "| n60_seed0 | 0.000 -> 0.750 (4) | +0.750 (0.250) | 3.00 | yes |" in out and "n32_seed0" not in out
    assert "shows held-out learning (seed 0 passes and >= 2 seeds in all do): True" in out
