"""Plots of the LLD diagnostics of one or more runs: ``lldslight plot RUN_DIR [RUN_DIR ...] [--out PNG]``.

A RUN_DIR is a directory holding the ``metrics.csv`` that Lightning's CSVLogger writes (e.g.
runs/demo/version_0) of a run trained with the LLDMonitor callback. The figure has one panel per
signal on a shared step axis: reward, the log-likelihood of correct (A > 0) and incorrect (A < 0)
responses, the per-step likelihood change Delta of correct responses, entropy, grad norm, the
sampling probability of the control tokens (<search>, </search>, <answer>, </answer>, EOS), and
shares: responses that called the tool, actions whose likelihood fell during the step (the LLDS
gate's open rate), groups with tied rewards. Panels whose columns no run logged are left out. The
phases the monitor detected are shaded (orange = steady decay, red = acceleration; one strip per
run when several are overlaid) and early warnings are dashed vertical lines. When the run logged
the collapse alarm (CollapseAlarm), a last panel shows each signal's CUSUM statistic (alarm/*)
with a triangle on each step the alarm fired; heals (Heal) are solid vertical lines on every panel.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from lldslight.science.collapse import read_metrics
from lldslight.errors import ArgumentParser, UserError
from lldslight.run.writes import write_failure

REQUIRED = ("train/reward", "lld/logp_pos", "lld/logp_neg", "train/entropy", "train/grad_norm")
PHASE_COLOURS = {2: "#f5a623", 3: "#d0021b"}
DASH_DOT_DOT = (0, (5, 1.5, 1, 1.5, 1, 1.5))
# (y label, [(column, line style, legend name)]): one panel each, in this order.
PANELS = [
    ("reward", [("train/reward", "-", "train reward")]),
    ("log-prob / token (pi_old)", [("lld/logp_pos", "-", "correct (A>0)"), ("lld/logp_neg", "--", "incorrect (A<0)")]),
    ("Delta log-prob of correct\nafter the step's updates", [("lld/delta_correct", "-", "Delta correct")]),
    ("entropy", [("train/entropy", "-", "entropy")]),
    ("grad norm (pre-clip)", [("train/grad_norm", "-", "grad norm")]),
    ("control-token prob.\n(sampled)", [
        ("diag/p_search_open", "-", "<search>"), ("diag/p_search_close", "--", "</search>"),
        ("diag/p_answer_open", "-.", "<answer>"), ("diag/p_answer_close", ":", "</answer>"), ("diag/p_eos", DASH_DOT_DOT, "EOS"),
    ]),
    ("share", [
        ("diag/tool_call_rate", "-", "responses with a search"),
        ("lld/gate_open_actions", "--", "A>=0 actions whose likelihood fell (LLDS gate open)"),
        ("train/zero_var_groups", ":", "groups with tied rewards"),
    ]),
]


class PlotInputError(UserError, ValueError):
    """A run directory that cannot be plotted (no metrics.csv, or missing columns)."""


def read_run(run_dir: str | Path):
    """The per-step metrics of a run as a DataFrame indexed by step (one row per step; the rows
    Lightning writes separately for one step, e.g. evaluation, are merged)."""
    run_dir = Path(run_dir)
    csv = run_dir / "metrics.csv"
    if not csv.is_file():
        hint = ""
        if run_dir.is_dir():
            found = sorted(str(p.parent) for p in run_dir.glob("*/metrics.csv"))
            if found:
                hint = f"; did you mean {' or '.join(found[:3])}?"
        elif not run_dir.exists():
            hint = " (the directory does not exist)"
        raise PlotInputError(
            f"{run_dir}: no metrics.csv{hint} (a RUN_DIR is a CSVLogger version directory, e.g. runs/demo/version_0)"
        )
    try:  # the lab's reader: parses, names the file in its errors, merges a step's rows
        frame = read_metrics(csv)
    except UserError as err:
        raise PlotInputError(str(err)) from None
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise PlotInputError(
            f"{csv}: missing column(s) {', '.join(missing)}; lld/* columns come from the "
            "lldslight.callbacks.LLDMonitor callback: train with --config configs/monitor.yaml after your config "
            "(or add LLDMonitor to trainer.callbacks); train/* come from GRPOModule"
        )
    if frame[list(REQUIRED)].dropna(how="all").empty:
        raise PlotInputError(f"{csv}: no training step logged yet")
    return frame


def phase_spans(steps: Sequence[float], phases: Sequence[float]) -> list[tuple[float, float, int]]:
    """Contiguous runs of decay (2) and acceleration (3) as (start, end, phase), in step units."""
    spans: list[tuple[float, float, int]] = []
    for step, phase in zip(steps, phases):
        if phase != phase or int(phase) not in PHASE_COLOURS:  # NaN or not shaded
            continue
        phase = int(phase)
        if spans and spans[-1][2] == phase and step - spans[-1][1] <= 0.5 + 1e-9:
            spans[-1] = (spans[-1][0], step + 0.5, phase)
        else:
            spans.append((step - 0.5, step + 0.5, phase))
    return spans


def panels_for(frames) -> list[tuple[str, list]]:
    """The PANELS at least one of ``frames`` has a value for."""
    return [
        (name, series) for name, series in PANELS
        if any(column in f.columns and f[column].notna().any() for f in frames for column, _, _ in series)
    ]


# -- the collapse alarm and heals (docs/alarm_and_healing.md) -----------------------------------------

ALARM_LABEL = "collapse alarm:\nCUSUM C (baseline sds)"
ALARM_STYLES = ["-", "--", "-.", ":", DASH_DOT_DOT, (0, (1, 1)), (0, (3, 1, 1, 1)), (0, (8, 2))]
_ALARM_AUX = ("alarm/votes", "alarm/fired", "alarm/onset")


def alarm_columns(frame) -> list[str]:
    """The per-signal CUSUM columns (``alarm/<signal>``) a run logged, in column order."""
    return [
        c for c in frame.columns
        if c.startswith("alarm/") and c not in _ALARM_AUX and not c.endswith(("_crossed", "_value", "_z")) and frame[c].notna().any()
    ]


def fired_steps(frame) -> list[float]:
    """Steps on which the alarm fired."""
    if "alarm/fired" not in frame.columns:
        return []
    return [float(s) for s in frame.index[frame["alarm/fired"].fillna(0).to_numpy() > 0]]


def heal_steps(frame) -> list[float]:
    """Steps on which Heal rolled the run back (skipped heals left out)."""
    if "heal/count" not in frame.columns:
        return []
    done = frame["heal/count"].notna()
    if "heal/skipped" in frame.columns:
        done &= frame["heal/skipped"].fillna(0) == 0
    return [float(s) for s in frame.index[done.to_numpy()]]


def draw_alarm_panel(ax, frame, colour) -> list:
    """One run's alarm statistics on ``ax``: a line per signal (line styles name the signals),
    a triangle on each step the alarm fired. Returns the legend handles of the signals."""
    import matplotlib.pyplot as plt

    steps = frame.index.to_numpy(dtype=float)
    handles = []
    for i, column in enumerate(alarm_columns(frame)):
        y = frame[column]
        ok = y.notna().to_numpy()
        style = ALARM_STYLES[i % len(ALARM_STYLES)]
        ax.plot(steps[ok], y[ok], linestyle=style, color=colour, lw=1.3)
        handles.append(plt.Line2D([], [], color="grey", linestyle=style, label=column.removeprefix("alarm/")))
    fired = fired_steps(frame)
    columns = alarm_columns(frame)
    if fired and columns:
        top = frame.loc[frame["alarm/fired"].fillna(0).to_numpy() > 0, columns].max(axis=1).fillna(0.0)
        ax.plot(fired, top.to_numpy(dtype=float), linestyle="none", marker="v", markersize=8, color=colour, label="alarm fired")
    return handles


def draw_heals(axes, frame, colour) -> None:
    """A solid vertical line on every panel at each step a heal rolled the run back."""
    for step in heal_steps(frame):
        for ax in axes:
            ax.axvline(step, color=colour, ls="-", lw=1.8, alpha=0.55)


def _label(run_dir: Path) -> str:
    parts = run_dir.resolve().parts
    return "/".join(parts[-2:]) if parts and parts[-1].startswith("version_") else parts[-1]


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    labels: Optional[Sequence[str]] = None,
    smooth: int = 1,
    title: Optional[str] = None,
) -> Path:
    """Draw the diagnostics of ``run_dirs`` overlaid into the PNG ``out``; returns its path.

    ``smooth`` > 1 adds a rolling mean over that many steps on top of the raw (faint) curves.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    if not run_dirs:
        raise PlotInputError("no RUN_DIR given")
    if labels is not None and len(labels) != len(run_dirs):
        raise PlotInputError(f"{len(labels)} labels for {len(run_dirs)} run directories")
    if smooth < 1:
        raise PlotInputError(f"smooth must be >= 1, got {smooth}")
    frames = [read_run(d) for d in run_dirs]
    labels = list(labels) if labels is not None else [_label(Path(d)) for d in run_dirs]

    panels = panels_for(frames)
    alarm = any(alarm_columns(f) for f in frames)
    rows = len(panels) + int(alarm)
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.2 * rows + 0.9), sharex=True, layout="constrained")
    alarm_ax, axes = (axes[-1], list(axes[:-1])) if alarm else (None, list(axes))
    alarm_handles: dict[str, object] = {}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = len(frames)
    for i, (frame, label) in enumerate(zip(frames, labels)):
        colour = colours[i % len(colours)]
        steps = frame.index.to_numpy(dtype=float)
        spans = phase_spans(steps, frame["lld/phase"].tolist()) if "lld/phase" in frame.columns else []
        warnings = steps[frame["lld/warning"].fillna(0).to_numpy() > 0] if "lld/warning" in frame.columns else []
        for ax, (_, series) in zip(axes, panels):
            for start, end, phase in spans:
                # One run: shade the whole panel; several: one strip per run along the bottom.
                lo, hi = (0.0, 1.0) if n == 1 else (i * 0.05, (i + 1) * 0.05)
                ax.axvspan(start, end, ymin=lo, ymax=hi, color=PHASE_COLOURS[phase], alpha=0.18 if n == 1 else 0.6, lw=0)
            for step in warnings:
                ax.axvline(step, color=colour, ls=":", lw=1.2)
            for column, style, _ in series:
                if column not in frame.columns:
                    continue
                y = frame[column]
                ok = y.notna().to_numpy()
                if smooth > 1:
                    ax.plot(steps[ok], y[ok], linestyle=style, color=colour, alpha=0.3, lw=0.8)
                    ax.plot(steps[ok], y[ok].rolling(smooth, min_periods=1).mean(), linestyle=style, color=colour, lw=1.6)
                else:
                    ax.plot(steps[ok], y[ok], linestyle=style, color=colour, lw=1.4, marker="." if ok.sum() < 30 else None)
        if alarm_ax is not None:
            for handle in draw_alarm_panel(alarm_ax, frame, colour):
                alarm_handles.setdefault(handle.get_label(), handle)
        draw_heals(axes + ([alarm_ax] if alarm_ax is not None else []), frame, colour)
    for ax, (name, series) in zip(axes, panels):
        ax.set_ylabel(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)
        if len(series) > 1:  # line styles name the series; colours name the runs (figure legend)
            ax.legend(handles=[plt.Line2D([], [], color="grey", linestyle=style, label=label) for _, style, label in series],
                      fontsize=7, loc="best", framealpha=0.6)
        if series[0][0] == "lld/delta_correct":
            ax.axhline(0.0, color="black", lw=0.8)
        if all(column.startswith(("diag/", "lld/gate_open", "train/zero_var")) for column, _, _ in series):
            ax.set_ylim(-0.03, 1.03)  # probabilities and shares
        if series[0][0] == "train/grad_norm" and all((f["train/grad_norm"].dropna() > 0).all() for f in frames):
            ax.set_yscale("log")
    if alarm_ax is not None:
        alarm_ax.set_ylabel(ALARM_LABEL, fontsize=9)
        alarm_ax.grid(alpha=0.3)
        alarm_ax.legend(handles=list(alarm_handles.values()), fontsize=7, loc="upper left", framealpha=0.6, ncol=2)
        axes.append(alarm_ax)
    axes[-1].set_xlabel("training step (rollout batch)")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = [plt.Line2D([], [], color=colours[i % len(colours)], lw=2, label=label) for i, label in enumerate(labels)]
    handles += [Patch(color=PHASE_COLOURS[2], alpha=0.5, label="steady decay"), Patch(color=PHASE_COLOURS[3], alpha=0.5, label="acceleration")]
    handles += [plt.Line2D([], [], color="grey", ls=":", label="early warning")]
    if any(fired_steps(f) for f in frames):
        handles += [plt.Line2D([], [], color="grey", ls="none", marker="v", label="collapse alarm")]
    if any(heal_steps(f) for f in frames):
        handles += [plt.Line2D([], [], color="grey", ls="-", lw=1.8, alpha=0.55, label="heal (rolled back)")]
    strips = "phase strips: one per run, bottom-up in legend order" if n > 1 else None
    fig.legend(handles=handles, loc="outside upper center", ncol=4, fontsize=8, frameon=False, title=strips, title_fontsize=7)
    if title:
        axes[0].set_title(title, fontsize=11)
    out = Path(out)
    if not out.suffix:  # matplotlib would add ".png" itself, and the path printed would not be the file's
        out = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def check_format(out: str) -> None:
    """``out``'s extension must be one matplotlib writes (its own list); none means PNG."""
    from matplotlib.figure import Figure

    suffix = Path(out).suffix.lower().lstrip(".")
    formats = Figure().canvas.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise PlotInputError(f"--out {out}: matplotlib cannot write .{suffix} files; give one of "
                             f"{', '.join('.' + f for f in sorted(formats))}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(prog="lldslight plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directories holding metrics.csv (e.g. runs/demo/version_0)")
    parser.add_argument("--out", default=None, help="PNG to write, or an existing directory to write it in (default: "
                                                      "RUN_DIR/lld.png for one run, lld_compare.png for several)")
    parser.add_argument("--labels", nargs="+", default=None, help="legend names, one per RUN_DIR")
    parser.add_argument("--smooth", type=int, default=1, help="rolling-mean window drawn over the raw curves (1 = off)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    name = "lld.png" if len(args.run_dirs) == 1 else "lld_compare.png"
    out = args.out or (str(Path(args.run_dirs[0]) / name) if len(args.run_dirs) == 1 else name)
    if Path(out).is_dir():  # --out DIR: the default file name inside it, not ./DIR.png
        out = str(Path(out) / name)
    try:
        check_format(out)
        path = plot_runs(args.run_dirs, out, labels=args.labels, smooth=args.smooth, title=args.title)
    except (UserError, OSError) as err:  # PlotInputError, or an --out that cannot be written
        reason = err if isinstance(err, UserError) else f"--out: cannot write {out}: {write_failure(err)}"
        print(f"lldslight plot: error: {reason}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
