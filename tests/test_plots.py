"""`lldslight plot`: a PNG from a real run directory, overlays, and clear errors on bad input."""
from __future__ import annotations

import shutil

import pandas as pd
import pytest

from lld_run import monitored_run
from lldslight.science.plots import PlotInputError, phase_spans, plot_runs, read_run

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
    from lldslight.science.plots import panels_for

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
    from lldslight.science.plots import main

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


def _capture_figures(monkeypatch) -> list:
    """The figures plot_runs saves (it closes them after saving)."""
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_alarm_panel_and_heals_appear_when_logged(run_dir, tmp_path, monkeypatch) -> None:
    from lldslight.science.plots import ALARM_LABEL, alarm_columns, fired_steps, heal_steps

    frame = pd.read_csv(run_dir / "metrics.csv")
    steps = frame["step"]
    # What CollapseAlarm and Heal log: two signals' CUSUMs, a firing on step 1, a heal on step 1.
    frame["alarm/tool_call_rate"] = steps.map({0: 0.0, 1: 6.5})
    frame["alarm/gate_open"] = steps.map({0: 1.0, 1: 5.5})
    frame["alarm/tool_call_rate_crossed"] = steps.map({0: 0.0, 1: 1.0})
    frame["alarm/votes"] = steps.map({0: 0.0, 1: 2.0})
    frame["alarm/fired"] = steps.map({0: 0.0, 1: 1.0})
    frame["heal/count"] = steps.map({1: 1.0})
    frame["heal/skipped"] = steps.map({1: 0.0})
    healed = tmp_path / "healed" / "version_0"
    healed.mkdir(parents=True)
    frame.to_csv(healed / "metrics.csv", index=False)
    read = read_run(healed)
    assert alarm_columns(read) == ["alarm/tool_call_rate", "alarm/gate_open"]
    assert fired_steps(read) == [1.0] and heal_steps(read) == [1.0]

    saved = _capture_figures(monkeypatch)
    plot_runs([run_dir], tmp_path / "plain.png")
    plot_runs([healed], tmp_path / "healed.png")
    plain, fig = saved
    labels = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
    assert ALARM_LABEL not in [ax.get_ylabel() for ax in plain.axes]
    assert labels[-1] == ALARM_LABEL and len(labels) == len([ax for ax in plain.axes if ax.get_ylabel()]) + 1
    alarm_ax = next(ax for ax in fig.axes if ax.get_ylabel() == ALARM_LABEL)
    lines = alarm_ax.get_lines()
    # two CUSUM curves, one marker line for the firing (at the larger C, 6.5), one heal line
    curves = [ln for ln in lines if ln.get_linestyle() != "None" and list(ln.get_xdata()) == [0.0, 1.0]]
    assert len(curves) == 2
    markers = [ln for ln in lines if ln.get_marker() == "v"]
    assert len(markers) == 1 and list(markers[0].get_xdata()) == [1.0] and list(markers[0].get_ydata()) == [6.5]
    vlines = [ln for ln in lines if list(ln.get_xdata()) == [1.0, 1.0]]
    assert len(vlines) == 1
    # The heal is marked on every panel, and named in the figure legend with the alarm.
    assert all(any(list(ln.get_xdata()) == [1.0, 1.0] for ln in ax.get_lines()) for ax in fig.axes if ax.get_ylabel())
    legend_labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "collapse alarm" in legend_labels and "heal (rolled back)" in legend_labels
    assert [t.get_text() for t in alarm_ax.get_legend().get_texts()] == ["tool_call_rate", "gate_open"]


def test_a_metrics_file_that_is_not_csv_text_is_refused_by_name(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    (run / "metrics.csv").write_bytes(b"\xff\xfe\x00binary\x00\x80\x81")
    with pytest.raises(PlotInputError, match=r"version_0/metrics.csv: not UTF-8 text \(byte b'\\xff' at offset 0, line 1\)"):
        read_run(run)


def test_an_empty_metrics_file_is_refused_by_name(tmp_path):
    """An empty metrics.csv (a run killed before its first row) gets the reader's error, not
    pandas' EmptyDataError."""
    run = tmp_path / "version_0"
    run.mkdir()
    (run / "metrics.csv").write_text("")
    with pytest.raises(PlotInputError, match=r"version_0/metrics.csv: not a readable metrics CSV"):
        read_run(run)
