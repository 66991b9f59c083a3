"""When a run collapsed, how, and how to compare arms of runs: the collapse toolkit.

Pure functions over a run's per-step metrics (the columns Lightning's CSVLogger writes; a
``read_run`` frame or plain lists), shared by the collapse lab's runner (lab/collapse.py),
the end-of-run summary (``RunSummary`` writes ``collapse`` into summary.json), the alarm's
validation and the tests. Nothing here looks at a detector: the collapse is defined from what the
agent earned and did, so a detector can be scored against it without judging itself.

**Collapse** (``CollapseCriteria``): the first step ``t`` such that for ``hold`` (20) consecutive
steps from ``t``
- the trailing mean of ``train/reward`` over ``smooth`` (20) steps is <= ``fall_fraction`` (0.5) x
  its running peak (the peak of that trailing mean so far; a positive peak), or
- the trailing mean of ``train/answered_rate`` over ``smooth`` steps is < ``answered_floor`` (0.5).
``t`` is the collapse step (the first step of the stretch). Trailing means count a step only once
``smooth`` steps are in; NaN values (a step that logged nothing) are skipped inside a window.

**Failure mode** of a collapse, read over the ``mode_window`` (50) steps from the collapse step:
- *death*: the agent stops working the protocol: the trailing tool-call rate
  (``diag/tool_call_rate``) or answered rate falls below ``death_rate`` (0.5) at some step of the
  window (it stopped searching or stopped answering; entropy and length then usually sit at a
  limit, reported alongside);
- *decay*: it keeps searching and answering while the reward falls (what it learned is lost).

**Explosions**, like with like: a step's largest per-update pre-clip gradient norm
(``train/grad_norm_max``) against the median of the same statistic over the previous
``explode_window`` (50) steps, steps with a zero gradient (every group tied) excluded from both
sides; an explosion is a non-finite value or one above ``explode_factor`` (10) x that median, once
``explode_warmup`` (10) steps are in. Explosions are reported, not part of the collapse.

**Statistics** for arms of seeds (paired by seed where the design pairs them): Fisher's exact test
on "collapsed by the horizon", the sign test on paired times to collapse (censored at the horizon),
the restricted mean survival time with a bootstrap interval (seeds resampled as pairs), and a
paired permutation test on the mean reward of the last steps. scipy provides the distributions; the pairing logic is here.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Literal, Mapping, Optional, Sequence

from lldslight.errors import require, require_choice

Series = Sequence[float]
Alternative = Literal["greater", "two-sided"]


@dataclass(frozen=True)
class CollapseCriteria:
    """The numbers of the collapse definition (see the module docstring)."""

    smooth: int = 20  # steps in the trailing means of reward and answered rate
    fall_fraction: float = 0.5  # reward collapse: trailing reward <= this x its running peak
    answered_floor: float = 0.5  # answer collapse: trailing answered rate < this
    hold: int = 20  # consecutive steps a condition must hold
    mode_window: int = 50  # steps after the collapse read to tell death from decay
    death_rate: float = 0.5  # death: trailing tool-call or answered rate below this in the window
    explode_factor: float = 10.0
    explode_window: int = 50
    explode_warmup: int = 10

    def __post_init__(self) -> None:
        for key in ("smooth", "hold", "mode_window", "explode_window"):
            require(getattr(self, key) >= 1, f"CollapseCriteria.{key}", ">= 1", getattr(self, key))
        require(0 < self.fall_fraction < 1, "CollapseCriteria.fall_fraction", "in (0, 1)", self.fall_fraction)
        require(self.explode_factor > 1, "CollapseCriteria.explode_factor", "> 1", self.explode_factor)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def trailing_mean(values: Series, window: int) -> list[float]:
    """Mean of the finite values among the last ``window`` steps; NaN for the first ``window - 1``
    steps and where the window holds no finite value."""
    out = []
    for i in range(len(values)):
        if i + 1 < window:
            out.append(float("nan"))
            continue
        inside = [v for v in values[i - window + 1 : i + 1] if finite(v)]
        out.append(sum(inside) / len(inside) if inside else float("nan"))
    return out


def running_peak(values: Series) -> list[float]:
    """The largest finite value so far (NaN before the first)."""
    peak, out = float("nan"), []
    for v in values:
        if finite(v) and not (peak >= v):
            peak = v
        out.append(peak)
    return out


def _first_hold(flags: Sequence[bool], hold: int) -> Optional[int]:
    """Index of the first of ``hold`` consecutive True flags; None if there is none."""
    run = 0
    for i, f in enumerate(flags):
        run = run + 1 if f else 0
        if run == hold:
            return i - hold + 1
    return None


def reward_low(reward: Series, crit: CollapseCriteria) -> list[bool]:
    """Per step: the trailing reward is <= fall_fraction x its running (positive) peak."""
    smooth = trailing_mean(reward, crit.smooth)
    peak = running_peak(smooth)
    return [finite(r) and finite(p) and p > 0 and r <= crit.fall_fraction * p for r, p in zip(smooth, peak)]


def answered_low(answered: Series, crit: CollapseCriteria) -> list[bool]:
    smooth = trailing_mean(answered, crit.smooth)
    return [finite(a) and a < crit.answered_floor for a in smooth]


@dataclass
class Collapse:
    """One run's collapse verdict; indices are positions in the series, ``step`` the logged step."""

    collapsed: bool
    index: Optional[int] = None
    step: Optional[int] = None
    cause: Optional[str] = None  # "reward" or "answered" (the condition that held first; both: "reward")
    mode: Optional[str] = None  # "death" or "decay"
    reward_index: Optional[int] = None  # first index of the reward condition alone
    answered_index: Optional[int] = None  # first index of the answered condition alone


def find_collapse(reward: Series, answered: Optional[Series], crit: CollapseCriteria = CollapseCriteria(),
                  tool_call: Optional[Series] = None, steps: Optional[Sequence[int]] = None) -> Collapse:
    """The collapse of one run (module docstring). ``answered`` / ``tool_call`` may be None (not
    logged): that condition then never holds."""
    steps = list(steps) if steps is not None else list(range(len(reward)))
    r = _first_hold(reward_low(reward, crit), crit.hold)
    a = _first_hold(answered_low(answered, crit), crit.hold) if answered is not None else None
    # In order of precedence: when both conditions start on the same step the cause is "reward"
    # (the documented tie-break; comparing the names would pick "answered", which sorts first).
    candidates = [(i, cause) for i, cause in ((r, "reward"), (a, "answered")) if i is not None]
    if not candidates:
        return Collapse(False, reward_index=r, answered_index=a)
    index, cause = min(candidates, key=lambda c: c[0])  # min keeps the first of equal indices: "reward"
    mode = failure_mode(index, answered, tool_call, crit)
    return Collapse(True, index, int(steps[index]), cause, mode, r, a)


def failure_mode(index: int, answered: Optional[Series], tool_call: Optional[Series], crit: CollapseCriteria) -> str:
    """"death" when the trailing tool-call or answered rate drops below ``death_rate`` within
    ``mode_window`` steps from ``index``, else "decay"."""
    for series in (tool_call, answered):
        if series is None:
            continue
        smooth = trailing_mean(series, crit.smooth)
        window = smooth[index : index + crit.mode_window]
        if any(finite(v) and v < crit.death_rate for v in window):
            return "death"
    return "decay"


def explosions(grad_max: Series, crit: CollapseCriteria = CollapseCriteria()) -> list[int]:
    """Indices of steps whose largest per-update norm is non-finite or above explode_factor x the
    median of the previous explode_window non-zero, non-exploded steps' largest norms."""
    history: list[float] = []
    out = []
    for i, g in enumerate(grad_max):
        if g is None or (isinstance(g, float) and math.isnan(g)):
            continue  # not logged this step
        if not math.isfinite(g):
            out.append(i)
            continue
        if g == 0:
            continue  # every group tied: no update, nothing to compare
        window = history[-crit.explode_window :]
        if len(window) >= crit.explode_warmup and g > crit.explode_factor * statistics.median(window):
            out.append(i)
            continue
        history.append(g)
    return out


def read_metrics(path) -> "pandas.DataFrame":
    """A run's per-step metrics, indexed by step (the rows Lightning writes apart for one step,
    e.g. evaluation, merged): from a directory holding metrics.csv or metrics.csv.gz (the lab's
    archive), or such a file. Errors name the file."""
    from pathlib import Path

    import pandas as pd

    import zlib

    from lldslight.errors import MissingFileError, UserError

    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("metrics.csv", "metrics.csv.gz") if (path / n).is_file()]
        if not found:
            raise MissingFileError(f"{path}: no metrics.csv or metrics.csv.gz")
        path = found[0]
    try:
        frame = pd.read_csv(path)
    except UnicodeDecodeError:
        # pandas decodes in chunks: its error's offset is within a chunk. The file's own offset
        # (of the decompressed text, for a .gz) comes from decoding it whole.
        import gzip

        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        try:
            data.decode("utf-8")
            where = ""
        except UnicodeDecodeError as whole:
            line = data[: whole.start].count(b"\n") + 1
            where = f"byte {data[whole.start:whole.start + 1]!r} at offset {whole.start}, line {line}"
        raise UserError(f"{path}: not UTF-8 text ({where or 'undecodable bytes'}); "
                        "is this a Lightning CSVLogger metrics.csv?") from None
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, EOFError, zlib.error) as err:
        # zlib.error: a .gz whose compressed blocks are damaged (a truncated one is an EOFError)
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"{path}: not a readable metrics CSV ({first_line})") from None
    if "step" not in frame.columns:
        raise UserError(f"{path}: no 'step' column; is this a Lightning CSVLogger metrics.csv?")
    return frame.dropna(subset=["step"]).groupby("step", sort=True).first()


def report_meta(path) -> dict:
    """The ``meta`` (what a set ran with) of a set's collapse.json, which lab/collapse.py writes; a
    UserError naming the file when it is unreadable, not JSON or has no meta (a KeyError before)."""
    import json
    from pathlib import Path

    from lldslight.errors import UserError

    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a readable collapse report ({err})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("meta"), dict):
        raise UserError(f"{path}: no 'meta' (what the set ran with): not a collapse report lab/collapse.py wrote")
    return payload["meta"]


def training_rows(frame) -> "pandas.DataFrame":
    """The steps of a :func:`read_metrics` frame that trained (a train/reward logged); none when the
    run logged no reward."""
    return frame[frame["train/reward"].notna()] if "train/reward" in frame.columns else frame.iloc[:0]


def archived_runs(directory, pattern: str = "seed*") -> list:
    """The run directories under ``directory`` matching ``pattern`` that hold a metrics.csv or
    metrics.csv.gz (the lab's archive layout: ``<arm>/seed<S>/``), sorted."""
    from pathlib import Path

    return [p for p in sorted(Path(directory).glob(pattern)) if (p / "metrics.csv.gz").is_file() or (p / "metrics.csv").is_file()]


def column(frame, name: str) -> Optional[list[float]]:
    """A frame's column as floats (None when the run did not log it)."""
    if name not in getattr(frame, "columns", ()):
        return None
    return [float(v) for v in frame[name]]


def mean_over(values: Optional[Series], start: int, end: int) -> Optional[float]:
    if values is None:
        return None
    inside = [v for v in values[max(0, start) : end] if finite(v)]
    return sum(inside) / len(inside) if inside else None


def summarise(frame, crit: CollapseCriteria = CollapseCriteria(), final_window: int = 100) -> dict:
    """Every per-run number the lab reports, from a frame of training steps (index = step)."""
    steps = [int(s) for s in frame.index]
    reward = column(frame, "train/reward") or []
    answered = column(frame, "train/answered_rate")
    tool = column(frame, "diag/tool_call_rate")
    c = find_collapse(reward, answered, crit, tool, steps)
    smooth = trailing_mean(reward, crit.smooth)
    finite_smooth = [(v, i) for i, v in enumerate(smooth) if finite(v)]
    peak, peak_index = max(finite_smooth) if finite_smooth else (None, None)
    n = len(steps)
    out = {"steps": n, "last_step": steps[-1] if steps else None, **asdict(c)}
    out["peak_reward"], out["peak_step"] = peak, steps[peak_index] if peak_index is not None else None
    out["final_reward"] = mean_over(reward, n - final_window, n)
    out["final_answered"] = mean_over(answered, n - final_window, n)
    out["final_tool_call"] = mean_over(tool, n - final_window, n)
    out["explosion_steps"] = [steps[i] for i in explosions(column(frame, "train/grad_norm_max") or column(frame, "train/grad_norm") or [], crit)]
    delta = column(frame, "lld/delta_correct")
    if delta is not None:
        measured = [d for d in delta if finite(d)]
        out["delta_negative_share"] = sum(d < 0 for d in measured) / len(measured) if measured else None
    if c.collapsed:
        i = c.index
        for key, name in (("entropy", "train/entropy"), ("response_len", "train/response_len")):
            out[f"{key}_after_collapse"] = mean_over(column(frame, name), i, i + crit.mode_window)
    return out


# --------------------------------------------------------------------------- statistics of arms


def fisher_one_sided(collapsed_a: int, n_a: int, collapsed_b: int, n_b: int) -> float:
    """P-value of "arm A collapses more often than arm B" (one-sided Fisher exact test)."""
    from scipy.stats import fisher_exact

    table = [[collapsed_a, n_a - collapsed_a], [collapsed_b, n_b - collapsed_b]]
    return float(fisher_exact(table, alternative="greater").pvalue)


def fisher_stratified_one_sided(strata: Sequence[tuple[int, int, int, int]]) -> float:
    """One-sided exact stratified test of "arm A collapses more often than arm B", strata (e.g.
    machines) kept apart: each stratum is (collapsed_a, n_a, collapsed_b, n_b). Conditional on every
    stratum's margins, A's collapse count in a stratum is hypergeometric under the null; the
    statistic is their sum over strata, its null distribution the convolution (the exact
    Cochran-Mantel-Haenszel test, Birch 1964). With one stratum it is Fisher's exact test."""
    from scipy.stats import hypergeom

    dist = {0: 1.0}  # null distribution of the summed count, built stratum by stratum
    observed = 0
    for ca, na, cb, nb in strata:
        total = ca + cb
        observed += ca
        pmf = {k: float(hypergeom.pmf(k, na + nb, total, na)) for k in range(max(0, total - nb), min(na, total) + 1)}
        nxt: dict[int, float] = {}
        for s_, p_ in dist.items():
            for k, q in pmf.items():
                nxt[s_ + k] = nxt.get(s_ + k, 0.0) + p_ * q
        dist = nxt
    return min(1.0, sum(p_ for s_, p_ in dist.items() if s_ >= observed))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: a family of tests corrected so that
    rejecting every adjusted p <= alpha keeps the chance of any false rejection <= alpha. The i-th
    smallest p is multiplied by (m - i) (i from 0), then made non-decreasing, capped at 1."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def sign_test(pairs: Sequence[tuple[float, float]]) -> dict:
    """Paired sign test of "the second of each pair is larger" (e.g. time to collapse under LLDS
    vs GRPO, censored at the horizon: a censored time is the horizon). Ties are dropped."""
    from scipy.stats import binomtest

    wins = sum(b > a for a, b in pairs)
    losses = sum(b < a for a, b in pairs)
    n = wins + losses
    p = float(binomtest(wins, n, 0.5, alternative="greater").pvalue) if n else 1.0
    return {"wins": wins, "losses": losses, "ties": len(pairs) - n, "p": p}


def paired_permutation(a: Sequence[float], b: Sequence[float], alternative: Alternative = "greater") -> dict:
    """Exact paired permutation (sign-flip) test of mean(b - a) > 0 ("greater") or two-sided."""
    require(len(a) == len(b) and len(a) > 0, "paired_permutation", "two non-empty series of equal length", (len(a), len(b)))
    require_choice(alternative, "paired_permutation.alternative", Alternative)
    diffs = [y - x for x, y in zip(a, b)]
    observed = sum(diffs) / len(diffs)
    count, total = 0, 0
    for mask in range(2 ** len(diffs)):
        value = sum(d if not (mask >> k) & 1 else -d for k, d in enumerate(diffs)) / len(diffs)
        total += 1
        if alternative == "greater":
            count += value >= observed - 1e-12
        else:
            count += abs(value) >= abs(observed) - 1e-12
    return {"mean_diff": observed, "p": count / total}


def rmst(times: Sequence[float], collapsed: Sequence[bool], horizon: float) -> float:
    """Restricted mean survival time up to ``horizon`` (Kaplan-Meier area). Runs that did not
    collapse are censored at their time (the horizon when they ran the whole course)."""
    events = sorted(zip(times, collapsed))
    at_risk, survival, last, area = len(events), 1.0, 0.0, 0.0
    for t, died in events:
        t = min(t, horizon)
        area += survival * (t - last)
        last = t
        if died and t < horizon:
            survival *= 1 - 1 / at_risk
        at_risk -= 1
    return area + survival * (horizon - last)


def rmst_difference(a: Sequence[tuple[float, bool]], b: Sequence[tuple[float, bool]], horizon: float, n_boot: int = 2000,
                    seed: int = 0, paired: bool = True) -> dict:
    """RMST(b) - RMST(a) with a percentile bootstrap 95% interval.

    ``paired`` (the lab's design: ``a[i]`` and ``b[i]`` are one seed's two arms, same init, same
    data order): seeds are resampled, each drawn seed bringing both of its runs, so the interval
    reflects the pairing. ``paired=False`` resamples runs within each arm independently (arms of
    unrelated runs)."""
    if paired:
        require(len(a) == len(b) and len(a) > 0, "rmst_difference", "two non-empty arms of equal length (paired by seed)",
                (len(a), len(b)))
    rng = random.Random(seed)

    def area(runs):
        return rmst([t for t, _ in runs], [c for _, c in runs], horizon)

    point = area(b) - area(a)
    boots = []
    for _ in range(n_boot):
        if paired:
            idx = [rng.randrange(len(a)) for _ in a]
            boots.append(area([b[i] for i in idx]) - area([a[i] for i in idx]))
        else:
            boots.append(area([rng.choice(b) for _ in b]) - area([rng.choice(a) for _ in a]))
    boots.sort()
    return {"diff": point, "low": boots[int(0.025 * n_boot)], "high": boots[int(0.975 * n_boot) - 1], "paired": paired}


def time_to_collapse(summary: Mapping, horizon: int) -> tuple[float, bool]:
    """(time, collapsed by the horizon) of a ``summarise`` result; censored at the horizon."""
    if summary.get("collapsed") and summary.get("step") is not None and summary["step"] < horizon:
        return float(summary["step"]), True
    return float(min(horizon, (summary.get("last_step") or horizon - 1) + 1)), False
