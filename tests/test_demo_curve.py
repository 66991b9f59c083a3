"""lab/demo_curve.py on a hand-built run: four dev questions, two evaluations, six training
steps; every number worked out by hand below."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import load_lab


def _records(ems: list[float], searches: tuple[int, ...] = (1, 1, 1, 1)) -> list[dict]:
    # q0, q1: type "hop1"; q2, q3: type "hop2"
    return [{"data_source": "hop1" if i < 2 else "hop2", "question": f"q{i}", "golden_answers": ["a"], "em": em, "answered": 1.0,
             "searches": searches[i]} for i, em in enumerate(ems)]


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    for name, ems, searches in (("val_before_step0", [0, 0, 1, 0], (1, 1, 1, 1)), ("val_step10", [1, 1, 1, 0], (1, 2, 2, 1)),
                                ("val_after_step10", [1, 1, 1, 0], (1, 2, 2, 1))):
        (run / f"{name}.json").write_text(json.dumps({"summary": {}, "records": _records(ems, searches)}))
    lines = ["step,train/em,train/answered_rate,train/entropy,val/em"] + [f"{s},{em},1.0,0.5," for s, em in enumerate([0, 0.5, 0, 1, 0.5, 1])]
    lines.insert(1, "0,,,,0.25")  # a validation row: not a training step
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    return run


def test_curve_by_hand(tmp_path):
    dc = load_lab("demo_curve")
    c = dc.curve(_run(tmp_path), block=3, compare=3)
    (dev,) = c["dev"]  # val_after_step10 is not a second evaluation
    # differences per question: +1, +1, 0, 0 -> mean 0.5, sd sqrt(1/3), se sqrt(1/3)/2
    assert dev["step"] == 10 and dev["change"] == pytest.approx(0.5) and dev["se"] == pytest.approx((1 / 3) ** 0.5 / 2)
    assert [b["em"] for b in c["train"]] == pytest.approx([0.5 / 3, 2.5 / 3])
    f = c["train_first_vs_last"]
    # first [0, .5, 0]: mean 1/6, var 1/12; last [1, .5, 1]: mean 5/6, var 1/12; se sqrt(2 * (1/12) / 3)
    assert f["change"] == pytest.approx(2 / 3) and f["se"] == pytest.approx((2 / 36) ** 0.5)
    # by type, before vs step 10: hop1 0,0 -> 1,1 (change 1, se 0), searches 1 -> 1.5; hop2 1,0 -> 1,0 (change 0)
    hop1, hop2 = c["dev_by_type"]["types"]
    assert c["dev_by_type"]["step"] == 10 and (hop1["data_source"], hop2["data_source"]) == ("hop1", "hop2")
    assert (hop1["n"], hop1["before"], hop1["after"], hop1["change"], hop1["se"]) == (2, 0.0, 1.0, 1.0, 0.0)
    assert (hop1["searches_before"], hop1["searches_after"]) == (1.0, 1.5)
    assert (hop2["change"], hop2["searches_after"]) == (0.0, 1.5)


def test_archive_round_trip_and_missing_baseline(tmp_path):
    dc = load_lab("demo_curve")
    run = _run(tmp_path)
    dc.archive(run, tmp_path / "kept")
    assert gzip.decompress((tmp_path / "kept" / "metrics.csv.gz").read_bytes()) == (run / "metrics.csv").read_bytes()
    # as JSON text: a nan z (no change, no spread) is equal to itself there
    assert json.dumps(dc.curve(tmp_path / "kept", 3, 3)) == json.dumps({**dc.curve(run, 3, 3), "run": str(tmp_path / "kept")})
    (run / "val_before_step0.json").unlink()
    with pytest.raises(ValueError, match="val_before_step0.json"):
        dc.curve(run)
