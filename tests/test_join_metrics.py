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
    main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), str(out), "--from-step", "2"])
    assert out.read_bytes() == first  # mtime 0: the same join gives the same bytes


def test_a_gap_is_refused(tmp_path):
    (tmp_path / "a.csv").write_text("step,r\n0,1\n1,1\n")
    (tmp_path / "b.csv").write_text("step,r\n3,1\n")
    with pytest.raises(SystemExit, match="gaps"):
        main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), str(tmp_path / "m.csv.gz"), "--from-step", "2"])
