"""The collapse alarm's rule, as plain Python over per-step metric values (no Lightning, no torch).

docs/alarm_and_healing.md. Each training step the rule reads a few metrics the project
already logs, turns each into a *signal* x_t, standardises it against a per-run baseline and runs a
one-sided CUSUM in the direction in which the signal moves before a collapse:

    z_t = s * (x_t - mu) / max(sd, floor)        s = +1 for a signal that rises, -1 for one that falls
    C_t = max(0, C_{t-1} + z_t - k)              (C starts at 0 once the baseline is known)

- **Baseline**: mu and sd of the signal's finite values on steps ``[baseline_start, baseline_end)``
  (sample sd). A signal with fewer than ``baseline_min`` finite values there keeps collecting after
  ``baseline_end`` until it has them; until then its C is NaN (not started) and it cannot vote.
  ``floor`` (per signal, in the signal's own unit) keeps a signal that was constant in the
  baseline (tool-call rate 1.0) from turning every later wobble into a huge z.
- **Missing data**: a NaN or absent value leaves C (and the derived windows) exactly as they were:
  a step with no mixed group is missing data, not a reset.
- **Alarm**: a signal *crosses* when C > h. The alarm fires on the step where at least ``votes``
  signals have crossed on each of ``consecutive`` consecutive steps, or where any single signal
  has C > ``far`` x h. Steps count as steps fed, whether or not they brought new data (held values
  keep voting). On firing, the rule reports the *onset* (the step after the crossed signals'
  statistics last stood at 0, the earliest over them: the CUSUM's change-point estimate), then
  restarts every C at 0 and the streak at 0, so it can fire again if the shift persists.

Signals (``SIGNALS``; names are what ``AlarmConfig.signals`` lists and what ``alarm/<name>`` logs):

=====================  =================================================  =========  =======
name                   x_t, from the metric keys                          adverse    floor
=====================  =================================================  =========  =======
tool_call_rate         diag/tool_call_rate (share of responses that       falls      0.05
                       searched; LLDMonitor)
answered_rate          train/answered_rate (share that gave an answer;    falls      0.05
                       GRPOModule)
gate_open              lld/gate_open_actions (share of A>=0 actions whose rises      0.05
                       likelihood fell during the step; LLDMonitor)
delta_negative_share   share of the last ``share_window`` measured steps  rises      0.2 (**)
                       with lld/delta_correct < 0 (NaN until
                       ``share_min`` were measured; LLDMonitor)
reward_vs_peak         trailing mean of train/reward over                 falls      0.3 (*)
                       ``reward_window`` steps / its running peak (NaN
                       until the window is full or while the peak <= 0)
first_vs_later_logp    lld/logp_first_action - lld/logp_later_actions     falls      0.05 nats
                       (optional; the paper's Fig. 5 crossover)
p_search_open          diag/p_search_open (optional)                      falls      0.05
p_answer_close         diag/p_answer_close (optional)                     falls      0.05
=====================  =================================================  =========  =======

(*) reward_vs_peak has a fixed baseline, mean 1 and sd 0.3 (its floor), instead of a measured
one: while the reward rises the ratio sits at ~1 with a tiny sd, and on any healthy plateau it
drifts below 1 as the running peak of a noisy trailing mean ratchets up, so a measured baseline
would make every plateau look adverse. With k = 0.5 its C grows only while the trailing mean is
below 85% of its peak (the a-priori threshold of LAB_NOTES §4).

(**) delta_negative_share is a share over a trailing window, so consecutive values are strongly
correlated: standardised by their own sd, one ordinary excursion would add up ``share_window``
steps of z. Its sd is instead the per-step sd of the indicator it averages, sqrt(p0 (1 - p0)) for
a baseline share p0 (floor 0.2): at p0 = 0.07, C grows only while the share exceeds ~0.2.

Only ``h`` is meant to be calibrated (on runs that did not collapse; ``replay_alarm`` recomputes
everything the callback logs from a finished run's metrics.csv, for any config). The form and the
other defaults were fixed before the decisive lab's runs existed (LAB_NOTES §4).
"""
from __future__ import annotations

import csv
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import numpy as np

from lldslight.errors import ConfigError, require

Transform = Literal["raw", "negative_share", "peak_ratio", "difference"]


@dataclass(frozen=True)
class SignalDef:
    """One signal of the catalogue.

    Args:
        keys: the metric keys it reads (two for "difference": x = keys[0] - keys[1]).
        direction: +1 when the signal rises before a collapse, -1 when it falls.
        transform: "raw" (the metric itself), "negative_share" (share of recent measured steps with
            the metric < 0), "peak_ratio" (trailing mean / its running peak), "difference".
        floor: the smallest sd the standardisation divides by, in the signal's unit.
        source: which component logs the keys (for error messages).
        fixed_mean: when set, the baseline is fixed (mean = this, sd = the floor) instead of
            measured on the run's baseline window.
        scale: the baseline sd: "measured" (the sample sd of the baseline values) or "bernoulli"
            (sqrt(mu (1 - mu)) of the baseline mean mu: the per-step sd of the indicator a share
            averages, for a share over a trailing window).
    """

    keys: tuple[str, ...]
    direction: int
    transform: Transform
    floor: float
    source: str
    fixed_mean: Optional[float] = None
    scale: Literal["measured", "bernoulli"] = "measured"


SIGNALS: dict[str, SignalDef] = {
    "tool_call_rate": SignalDef(("diag/tool_call_rate",), -1, "raw", 0.05, "LLDMonitor"),
    "answered_rate": SignalDef(("train/answered_rate",), -1, "raw", 0.05, "GRPOModule"),
    "gate_open": SignalDef(("lld/gate_open_actions",), +1, "raw", 0.05, "LLDMonitor(measure_gate=true)"),
    # A share over 30 steps is strongly autocorrelated: divided by its own (small) sd, one ordinary
    # excursion would add up 30 steps' worth of z. The per-step sd of the indicator it averages is
    # the yardstick instead: at p0 = 0.07, C grows only while the share is above ~0.2.
    "delta_negative_share": SignalDef(("lld/delta_correct",), +1, "negative_share", 0.2, "LLDMonitor(measure_delta=true)",
                                      scale="bernoulli"),
    # A measured baseline would be wrong here: while the reward rises the ratio sits at ~1, and on
    # any healthy plateau it drifts below that as the running peak of a noisy mean ratchets up.
    # Fixed mean 1 and scale 0.3: C grows only while the trailing mean is below 1 - k x 0.3 = 85%
    # of its peak (LAB_NOTES §4's a-priori threshold).
    "reward_vs_peak": SignalDef(("train/reward",), -1, "peak_ratio", 0.3, "GRPOModule", fixed_mean=1.0),
    "first_vs_later_logp": SignalDef(("lld/logp_first_action", "lld/logp_later_actions"), -1, "difference", 0.05, "LLDMonitor"),
    "p_search_open": SignalDef(("diag/p_search_open",), -1, "raw", 0.05, "LLDMonitor"),
    "p_answer_close": SignalDef(("diag/p_answer_close",), -1, "raw", 0.05, "LLDMonitor"),
}
DEFAULT_SIGNALS = ["tool_call_rate", "answered_rate", "gate_open", "delta_negative_share", "reward_vs_peak"]
STEP_KEY = "train/reward"  # a training step's row in metrics.csv: GRPOModule logs it every step


@dataclass
class AlarmConfig:
    """The collapse alarm's rule (module docstring). Only ``h`` is meant to be calibrated.

    Args:
        signals: which signals of ``SIGNALS`` vote (default: the five of LAB_NOTES §4).
        baseline_start: first step of the baseline window (steps as fed: the training step index).
        baseline_end: the baseline window ends before this step.
        baseline_min: finite values a signal needs for its baseline (it keeps collecting past
            ``baseline_end`` until it has them).
        k: CUSUM slack, in baseline sds: the drift per step the statistic forgives.
        h: CUSUM threshold, in baseline sds: a signal crosses when C > h. The calibrated parameter.
        votes: signals that must have crossed on the same step ...
        consecutive: ... on this many consecutive steps, for the alarm to fire.
        far: one signal alone fires the alarm when its C > far x h.
        share_window: measured steps in delta_negative_share's trailing share.
        share_min: measured steps delta_negative_share needs before it has a value.
        reward_window: steps in reward_vs_peak's trailing mean (its value is NaN until it is full).
        sd_floor: per-signal overrides of ``SignalDef.floor`` (name -> floor, in the signal's unit).
    """

    signals: list[str] = field(default_factory=lambda: list(DEFAULT_SIGNALS))
    baseline_start: int = 40
    baseline_end: int = 140
    baseline_min: int = 20
    k: float = 0.5
    h: float = 5.0
    votes: int = 2
    consecutive: int = 5
    far: float = 2.0
    share_window: int = 30
    share_min: int = 10
    reward_window: int = 20
    sd_floor: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = "CollapseAlarm.rule"
        unknown = [s for s in self.signals if s not in SIGNALS]
        require(not unknown, f"{p}.signals", f"names from {sorted(SIGNALS)}", unknown)
        require(len(self.signals) >= 1 and len(set(self.signals)) == len(self.signals), f"{p}.signals",
                "a non-empty list without repeats", self.signals)
        require(self.baseline_start >= 0, f"{p}.baseline_start", ">= 0", self.baseline_start)
        require(self.baseline_end > self.baseline_start, f"{p}.baseline_end", f"> baseline_start ({self.baseline_start})", self.baseline_end)
        require(self.baseline_min >= 2, f"{p}.baseline_min", ">= 2 (an sd needs two values)", self.baseline_min)
        require(math.isfinite(self.k) and self.k >= 0, f"{p}.k", ">= 0", self.k)
        require(math.isfinite(self.h) and self.h > 0, f"{p}.h", "> 0", self.h)
        require(1 <= self.votes <= len(self.signals), f"{p}.votes", f"in [1, {len(self.signals)}] (the number of signals)", self.votes)
        require(self.consecutive >= 1, f"{p}.consecutive", ">= 1", self.consecutive)
        require(self.far > 1, f"{p}.far", "> 1", self.far)
        require(self.share_window >= 1, f"{p}.share_window", ">= 1", self.share_window)
        require(1 <= self.share_min <= self.share_window, f"{p}.share_min", f"in [1, share_window={self.share_window}]", self.share_min)
        require(self.reward_window >= 1, f"{p}.reward_window", ">= 1", self.reward_window)
        bad = {k: v for k, v in self.sd_floor.items() if k not in self.signals or not (v > 0)}
        require(not bad, f"{p}.sd_floor", "a map from listed signals to floors > 0", bad)

    def floor(self, name: str) -> float:
        return float(self.sd_floor.get(name, SIGNALS[name].floor))

    def input_keys(self) -> list[str]:
        """Every metric key the listed signals read."""
        return sorted({k for s in self.signals for k in SIGNALS[s].keys})


@dataclass
class AlarmUpdate:
    """What one step of the rule concluded. Per-signal dicts are keyed by signal name.

    Args:
        step: the step fed.
        values: the signal x_t (NaN when missing).
        z: the standardised adverse deviation (NaN while missing or before the baseline).
        cusum: C_t (NaN before the signal's baseline is known).
        crossed: C_t > h.
        votes: how many signals have crossed.
        streak: consecutive steps with >= ``votes`` crossed signals (0 after a firing).
        fired: the alarm fired on this step.
        onset: on a firing, the CUSUM's change-point estimate (first step of the crossed signals'
            excursion, earliest over them); else None.
        reason: on a firing, which condition and which signals.
    """

    step: int
    values: dict[str, float]
    z: dict[str, float]
    cusum: dict[str, float]
    crossed: dict[str, bool]
    votes: int
    streak: int
    fired: bool
    onset: Optional[int] = None
    reason: str = ""

    def log_metrics(self) -> dict[str, float]:
        """The ``alarm/*`` metrics the callback logs for this step (replay_alarm's columns)."""
        out: dict[str, float] = {}
        for name, c in self.cusum.items():
            out[f"alarm/{name}"] = float(c)
            out[f"alarm/{name}_crossed"] = float(self.crossed[name])
        out["alarm/votes"] = float(self.votes)
        out["alarm/fired"] = float(self.fired)
        return out


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


class AlarmRule:
    """The stateful rule: feed one step's metrics at a time with :meth:`update`.

    The state is plain numbers and lists (:meth:`state_dict`), so a checkpointed run resumes
    exactly, and a snapshot can be taken and put back (the Heal callback does).
    """

    def __init__(self, config: Optional[AlarmConfig] = None) -> None:
        self.config = config if config is not None else AlarmConfig()
        self.reset()

    def reset(self) -> None:
        """Forget everything, baselines included (a fresh run)."""
        names = self.config.signals
        self.last_step: Optional[int] = None
        self.baseline_values: dict[str, list[float]] = {n: [] for n in names}
        self.baseline: dict[str, Optional[tuple[float, float]]] = {n: None for n in names}  # (mu, sd used)
        self.cusum: dict[str, float] = {n: 0.0 for n in names}
        self.last_zero: dict[str, Optional[int]] = {n: None for n in names}  # last step C stood at 0
        self.streak = 0
        self.negatives: deque[float] = deque(maxlen=self.config.share_window)  # 1.0 / 0.0 per measured step
        self.rewards: deque[float] = deque(maxlen=self.config.reward_window)
        self.reward_peak: Optional[float] = None
        self.fired_steps: list[int] = []

    def reset_statistics(self, step: Optional[int] = None) -> None:
        """Restart every CUSUM at 0 and the streak (baselines and derived windows stay): after a
        firing, and after a heal rolled the run back. ``step`` is when C is taken to stand at 0."""
        at = step if step is not None else self.last_step
        for n in self.config.signals:
            self.cusum[n] = 0.0
            self.last_zero[n] = at
        self.streak = 0

    # -- the signals --------------------------------------------------------------------------------

    def _values(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        cfg = self.config
        nan = float("nan")
        out: dict[str, float] = {}
        for name in cfg.signals:
            sig = SIGNALS[name]
            raw = [float(metrics[k]) if _finite(metrics.get(k)) else nan for k in sig.keys]
            if sig.transform == "raw":
                out[name] = raw[0]
            elif sig.transform == "difference":
                out[name] = raw[0] - raw[1]  # NaN if either is missing
            elif sig.transform == "negative_share":
                if math.isfinite(raw[0]):
                    self.negatives.append(1.0 if raw[0] < 0 else 0.0)
                out[name] = sum(self.negatives) / len(self.negatives) if len(self.negatives) >= cfg.share_min else nan
            elif sig.transform == "peak_ratio":
                value = nan
                if math.isfinite(raw[0]):
                    self.rewards.append(raw[0])
                    if len(self.rewards) == cfg.reward_window:
                        mean = sum(self.rewards) / len(self.rewards)
                        self.reward_peak = mean if self.reward_peak is None else max(self.reward_peak, mean)
                        value = mean / self.reward_peak if self.reward_peak > 0 else nan
                out[name] = value
        return out

    # -- one step -------------------------------------------------------------------------------------

    def update(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> AlarmUpdate:
        """Feed one training step's metrics (any mapping holding the keys of
        ``config.input_keys()``; missing keys and NaN count as missing data). ``step`` is the
        training step index (default: one after the last step fed, 0 first)."""
        cfg = self.config
        step = int(step) if step is not None else (0 if self.last_step is None else self.last_step + 1)
        self.last_step = step
        values = self._values(metrics)
        z: dict[str, float] = {}
        for name in cfg.signals:
            x = values[name]
            if self.baseline[name] is None:
                z[name] = float("nan")
                fixed = SIGNALS[name].fixed_mean
                if fixed is not None:
                    if step >= cfg.baseline_end - 1:
                        self.baseline[name] = (float(fixed), cfg.floor(name))
                        self.cusum[name] = 0.0
                        self.last_zero[name] = step
                    continue
                if math.isfinite(x) and cfg.baseline_start <= step:
                    collected = self.baseline_values[name]
                    if step < cfg.baseline_end or len(collected) < cfg.baseline_min:
                        collected.append(x)
                # The baseline freezes at the first step past the window with enough values; the
                # statistic starts on the step after (C = 0 here).
                if step >= cfg.baseline_end - 1 and len(self.baseline_values[name]) >= cfg.baseline_min:
                    data = np.asarray(self.baseline_values[name], dtype=np.float64)
                    mu = float(data.mean())
                    sd = math.sqrt(max(mu * (1.0 - mu), 0.0)) if SIGNALS[name].scale == "bernoulli" else float(data.std(ddof=1))
                    self.baseline[name] = (mu, max(sd, cfg.floor(name)))
                    self.cusum[name] = 0.0
                    self.last_zero[name] = step
                continue
            mu, sd = self.baseline[name]
            if not math.isfinite(x):
                z[name] = float("nan")  # missing: C holds
                continue
            z[name] = SIGNALS[name].direction * (x - mu) / sd
            self.cusum[name] = max(0.0, self.cusum[name] + z[name] - cfg.k)
            if self.cusum[name] == 0.0:
                self.last_zero[name] = step

        started = {n: self.baseline[n] is not None for n in cfg.signals}
        cusum = {n: self.cusum[n] if started[n] else float("nan") for n in cfg.signals}
        crossed = {n: started[n] and self.cusum[n] > cfg.h for n in cfg.signals}
        votes = sum(crossed.values())
        self.streak = self.streak + 1 if votes >= cfg.votes else 0
        far = [n for n in cfg.signals if started[n] and self.cusum[n] > cfg.far * cfg.h]
        fired = self.streak >= cfg.consecutive or bool(far)
        onset, reason = None, ""
        if fired:
            involved = far if (far and self.streak < cfg.consecutive) else [n for n in cfg.signals if crossed[n]]
            starts = [self.last_zero[n] + 1 for n in involved if self.last_zero[n] is not None]
            onset = min(starts) if starts else step
            if self.streak >= cfg.consecutive:
                reason = f"{votes} signals above h={cfg.h:g} for {self.streak} steps ({', '.join(n for n in cfg.signals if crossed[n])})"
            else:
                reason = f"{', '.join(far)} above {cfg.far:g} x h={cfg.far * cfg.h:g}"
            self.fired_steps.append(step)
            self.reset_statistics(step)
        return AlarmUpdate(step, values, z, cusum, crossed, votes, self.streak if not fired else 0, fired, onset, reason)

    # -- state ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "signals": list(self.config.signals),
            "last_step": self.last_step,
            "baseline_values": {n: list(v) for n, v in self.baseline_values.items()},
            "baseline": {n: (list(b) if b is not None else None) for n, b in self.baseline.items()},
            "cusum": dict(self.cusum),
            "last_zero": dict(self.last_zero),
            "streak": self.streak,
            "negatives": list(self.negatives),
            "rewards": list(self.rewards),
            "reward_peak": self.reward_peak,
            "fired_steps": list(self.fired_steps),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back a :meth:`state_dict`. The thresholds come from this rule's config, not from the
        state; the signal list must be the same (the per-signal statistics are keyed by it)."""
        if list(state["signals"]) != list(self.config.signals):
            raise ConfigError(
                f"CollapseAlarm.rule.signals must match the checkpoint's ({list(state['signals'])}) to resume the "
                f"alarm's state, got {list(self.config.signals)}"
            )
        self.last_step = state["last_step"]
        self.baseline_values = {n: list(v) for n, v in state["baseline_values"].items()}
        self.baseline = {n: (tuple(b) if b is not None else None) for n, b in state["baseline"].items()}
        self.cusum = dict(state["cusum"])
        self.last_zero = dict(state["last_zero"])
        self.streak = int(state["streak"])
        self.negatives = deque(state["negatives"], maxlen=self.config.share_window)
        self.rewards = deque(state["rewards"], maxlen=self.config.reward_window)
        self.reward_peak = state["reward_peak"]
        self.fired_steps = list(state["fired_steps"])


# -- offline replay ---------------------------------------------------------------------------------------


Columns = Mapping[str, Sequence[Any]]


def _cell(value: Any) -> float:
    if value is None or value == "":
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def read_metrics_csv(path: Union[str, Path]) -> dict[str, list[float]]:
    """A CSVLogger metrics.csv (or the run directory holding it) as columns, one entry per step
    (rows Lightning writes separately for one step are merged: first non-empty value wins), in
    step order. Pure python: no pandas needed."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.csv"
    merged: dict[int, dict[str, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("step"):
                continue
            into = merged.setdefault(int(float(row["step"])), {})
            for key, value in row.items():
                if key != "step" and value not in (None, "") and key not in into:
                    into[key] = _cell(value)
    keys = sorted({k for r in merged.values() for k in r})
    steps = sorted(merged)
    out: dict[str, list[float]] = {"step": [float(s) for s in steps]}
    for key in keys:
        out[key] = [merged[s].get(key, float("nan")) for s in steps]
    return out


def _as_columns(data: Any) -> dict[str, list[float]]:
    if isinstance(data, (str, Path)):
        return read_metrics_csv(data)
    if hasattr(data, "columns") and hasattr(data, "index"):  # a pandas DataFrame
        frame = data
        if "step" in frame.columns:
            frame = frame.dropna(subset=["step"]).groupby("step", sort=True).first()
        steps = [float(s) for s in frame.index]
        out = {"step": steps}
        for key in frame.columns:
            out[str(key)] = [_cell(v) for v in frame[key].tolist()]
        return out
    columns = {str(k): [_cell(v) for v in values] for k, values in dict(data).items()}
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        require(False, "replay_alarm's columns", "of one length", sorted(lengths),
                ", ".join(f"{k} has {len(v)}" for k, v in columns.items()))
    if "step" not in columns:
        columns["step"] = [float(i) for i in range(lengths.pop() if lengths else 0)]
    return columns


def replay_alarm(data: Any, config: Optional[AlarmConfig] = None) -> dict[str, list[float]]:
    """Recompute, offline, what CollapseAlarm logs, under ``config`` (default AlarmConfig()).

    ``data``: a run directory or metrics.csv path, a pandas DataFrame of a metrics.csv (several
    rows per step are merged; e.g. ``pd.read_csv(...)`` or ``plots.read_run(...)``), or a mapping
    of columns (metric key -> per-step values, optional "step"). Every step with a finite
    ``train/reward`` (a training step) is fed in step order, as the callback fed it.

    Returns columns: "step", the ``alarm/*`` keys the callback logs (``AlarmUpdate.log_metrics``),
    plus "alarm/onset" (NaN except on firings) and, per signal, "alarm/<name>_value" (x_t) and
    "alarm/<name>_z". For a run without heals, with the config it ran with, the ``alarm/*`` columns
    equal the logged ones (the callback rounds its inputs to float32 as the logger does).
    """
    config = config if config is not None else AlarmConfig()
    columns = _as_columns(data)
    rule = AlarmRule(config)
    keys = config.input_keys()
    n = len(columns.get("step", []))
    marker = columns.get(STEP_KEY)
    out: dict[str, list[float]] = {"step": []}
    for i in range(n):
        if marker is not None and not math.isfinite(marker[i]):
            continue  # an evaluation-only row
        metrics = {k: columns[k][i] for k in keys if k in columns}
        upd = rule.update(metrics, step=int(columns["step"][i]))
        row = upd.log_metrics()
        row["alarm/onset"] = float(upd.onset) if upd.onset is not None else float("nan")
        for name in config.signals:
            row[f"alarm/{name}_value"] = upd.values[name]
            row[f"alarm/{name}_z"] = upd.z[name]
        out["step"].append(float(upd.step))
        for key, value in row.items():
            out.setdefault(key, []).append(value)
    return out
