"""`lldslight plot`: a PNG from a real run directory, overlays, and clear errors on bad input."""
from __future__ import annotations

import shutil

import pandas as pd
import pytest

from lld_run import monitored_run
from lldslight.plots import PlotInputError, phase_spans, plot_runs, read_run

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, synth_kb, bm25):
    return monitored_run(tmp_path_factory, synth_kb, bm25)["run_dir"]


def test_cli_plots_a_real_run(run_dir, tmp_path, capsys) -> None:
    from lldslight.cli import main

    out = tmp_path / "one.png"
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    assert str(out) in capsys.readouterr().out


def test_overlay_of_two_runs_with_phases(run_dir, tmp_path) -> None:
    # A second run: the same metrics with a late decay and acceleration the monitor would label.
    other = tmp_path / "other" / "version_0"
    other.mkdir(parents=True)
    frame = pd.read_csv(run_dir / "metrics.csv")
    frame["lld/phase"] = frame["step"].map({0: 2, 1: 3})
    frame["lld/warning"] = frame["step"].map({0: 0, 1: 1})
    frame.to_csv(other / "metrics.csv", index=False)
    out = plot_runs([run_dir, other], tmp_path / "cmp.png", labels=["GRPO", "GRPO+LLDS"], smooth=2, title="t")
    assert out.read_bytes()[:8] == PNG
    assert read_run(other).index.tolist() == [0, 1]


def test_diagnostic_panels_appear_when_a_run_logged_them(run_dir, tmp_path) -> None:
    from lldslight.plots import panels_for

    frame = read_run(run_dir)
    assert [name for name, _ in panels_for([frame])][-1] == "share"  # tool calls, gate open rate, tied groups
    names = lambda frames: [name.split("\n")[0] for name, _ in panels_for(frames)]  # noqa: E731
    assert "control-token prob." not in names([frame.assign(**{"diag/p_eos": float("nan")})])
    with_tags = frame.assign(**{"diag/p_eos": 0.9, "diag/p_search_open": 0.2})
    assert "control-token prob." in names([frame, with_tags])
    bare = frame.drop(columns=[c for c in frame.columns if c.startswith("diag/") or c.startswith("lld/gate") or "zero_var" in c or "delta" in c])
    assert names([bare]) == ["reward", "log-prob / token (pi_old)", "entropy", "grad norm (pre-clip)"]
    out = tmp_path / "tags.png"
    with_tags.reset_index().to_csv(tmp_path / "metrics.csv", index=False)
    assert plot_runs([tmp_path], out).read_bytes()[:8] == PNG


def test_phase_spans_merge_contiguous_steps() -> None:
    assert phase_spans([0, 1, 2, 3, 4, 5], [1, 2, 2, 3, float("nan"), 2]) == [(0.5, 2.5, 2), (2.5, 3.5, 3), (4.5, 5.5, 2)]


def test_missing_metrics_csv_is_a_clear_error(run_dir, tmp_path, capsys) -> None:
    from lldslight.plots import main

    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere: no metrics.csv" in err and "does not exist" in err
    # The parent of a version directory: the error points at the version directory.
    with pytest.raises(PlotInputError, match=r"did you mean .*version_0"):
        read_run(run_dir.parent)


def test_missing_columns_are_named(run_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    frame = pd.read_csv(run_dir / "metrics.csv")
    frame.drop(columns=[c for c in frame.columns if c.startswith("lld/")]).to_csv(bad / "metrics.csv", index=False)
    with pytest.raises(PlotInputError, match=r"missing column\(s\) lld/logp_pos, lld/logp_neg.*LLDMonitor"):
        plot_runs([bad], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    shutil.copy(run_dir / "metrics.csv", bad / "metrics.csv")
    with pytest.raises(PlotInputError, match="2 labels for 1 run"):
        plot_runs([bad], tmp_path / "x.png", labels=["a", "b"])
