"""lab/join_metrics.py: a run's metrics joined from its first log directory and its resume's."""
from __future__ import annotations

import gzip

import pytest

from lab.join_metrics import main


def test_steps_before_the_checkpoint_from_the_first_the_rest_from_the_resume(tmp_path):
    # the first run logged steps 0-3 (and was stopped after its step-2 checkpoint); the resume
    # trained 2-4 again and logged a column the first did not have
    (tmp_path / "a.csv").write_text("step,train/reward\n0,0.1\n1,0.2\n2,0.3\n3,0.4\n")
    (tmp_path / "b.csv").write_text("step,train/reward,lld/x\n2,0.35,7\n3,0.45,8\n4,0.5,9\n")
    out = tmp_path / "m.csv.gz"
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), str(out), "--from-step", "2"]) == 0
    assert gzip.decompress(out.read_bytes()).decode() == "step,train/reward,lld/x\n0,0.1,\n1,0.2,\n2,0.35,7\n3,0.45,8\n4,0.5,9\n"
    first = out.read_bytes()
    main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), str(out), "--from-step", "2", "--force"])
    assert out.read_bytes() == first  # mtime 0: the same join gives the same bytes


def test_a_gap_is_refused(tmp_path):
    (tmp_path / "a.csv").write_text("step,r\n0,1\n1,1\n")
    (tmp_path / "b.csv").write_text("step,r\n3,1\n")
    with pytest.raises(SystemExit, match="gaps"):
        main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), str(tmp_path / "m.csv.gz"), "--from-step", "2"])


def join_args(tmp_path, a: str, b: str, out: str = "m.csv.gz", *extra: str) -> list[str]:
    return [str(tmp_path / a), str(tmp_path / b), str(tmp_path / out), "--from-step", "2", *extra]


def test_a_step_twice_inside_one_input_is_refused(tmp_path):
    # the docstring promised it; the join kept both rows of step 1
    (tmp_path / "a.csv").write_text("step,train/reward\n0,0.1\n1,0.2\n1,0.25\n2,0.3\n")
    (tmp_path / "b.csv").write_text("step,train/reward\n2,0.35\n3,0.45\n")
    with pytest.raises(SystemExit, match=r"join_metrics: .*a\.csv holds step 1 twice: two rows of the same columns"):
        main(join_args(tmp_path, "a.csv", "b.csv"))
    assert not (tmp_path / "m.csv.gz").exists()
    # a step's evaluation row beside its training row is not a repeat
    (tmp_path / "c.csv").write_text("step,train/reward,val/em\n0,,0.5\n0,0.1,\n1,0.2,\n")
    assert main(join_args(tmp_path, "c.csv", "b.csv")) == 0


def test_a_csv_without_a_step_column_is_refused(tmp_path):
    # each of its rows counted as "an evaluation's" and was written twice
    (tmp_path / "a.csv").write_text("reward\n0.1\n0.2\n")
    (tmp_path / "b.csv").write_text("reward\n0.3\n")
    with pytest.raises(SystemExit, match=r"join_metrics: .*a\.csv: no 'step' column \(its header: reward\)"):
        main(join_args(tmp_path, "a.csv", "b.csv"))


def test_an_existing_output_is_not_replaced_without_force(tmp_path):
    archived = tmp_path / "seed0" / "metrics.csv.gz"
    archived.parent.mkdir()
    archived.write_bytes(gzip.compress(b"step,train/reward\n0,0.9\n"))
    (tmp_path / "a.csv").write_text("step,r\n0,1\n1,1\n")
    (tmp_path / "b.csv").write_text("step,r\n2,1\n")
    kept = archived.read_bytes()
    with pytest.raises(SystemExit, match=r"join_metrics: .*seed0/metrics\.csv\.gz exists .*pass --force to replace it"):
        main(join_args(tmp_path, "a.csv", "b.csv", "seed0/metrics.csv.gz"))
    assert archived.read_bytes() == kept
    assert main(join_args(tmp_path, "a.csv", "b.csv", "seed0/metrics.csv.gz", "--force")) == 0
    assert gzip.decompress(archived.read_bytes()) == b"step,r\n0,1\n1,1\n2,1\n"


def test_bad_inputs_and_outputs_are_one_line_naming_the_file(tmp_path):
    (tmp_path / "a.csv").write_text("step,r\n0,1\n1,1\n")
    (tmp_path / "b.csv").write_text("step,r\n2,1\n")
    # an archived run's metrics.csv.gz is read as it is
    (tmp_path / "a.csv.gz").write_bytes(gzip.compress((tmp_path / "a.csv").read_bytes()))
    assert main(join_args(tmp_path, "a.csv.gz", "b.csv")) == 0
    assert gzip.decompress((tmp_path / "m.csv.gz").read_bytes()) == b"step,r\n0,1\n1,1\n2,1\n"
    (tmp_path / "cut.csv.gz").write_bytes((tmp_path / "a.csv.gz").read_bytes()[:-12])
    (tmp_path / "garbage.csv").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "folder").mkdir()
    for a, out, message in [("cut.csv.gz", "x.csv.gz", r"cut\.csv\.gz: a truncated or damaged gzip file"),
                            ("garbage.csv", "x.csv.gz", r"garbage\.csv: not a metrics\.csv \(byte 0xff at offset 0 is not UTF-8\)"),
                            ("missing.csv", "x.csv.gz", r"missing\.csv: no such file"),
                            ("a.csv", "folder", r"folder: is a directory; give the file to write")]:
        with pytest.raises(SystemExit, match=r"^join_metrics: .*" + message):
            main(join_args(tmp_path, a, "b.csv", out))
    assert not (tmp_path / "x.csv.gz").exists()
