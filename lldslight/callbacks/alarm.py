"""CollapseAlarm: the collapse alarm of lldslight.science.alarm, fed every training step.

Each training step it reads the step's metrics from ``GRPOModule.last_step_metrics`` (train/*) and
``LLDMonitor.last_metrics`` (lld/*, diag/*), feeds them to an :class:`lldslight.science.alarm.AlarmRule`
and logs, in the step's row of metrics.csv:

- ``alarm/<signal>``: the signal's CUSUM statistic C (baseline sds; NaN until its baseline is known);
- ``alarm/<signal>_crossed``: 1 when C > h;
- ``alarm/votes``: how many signals have crossed;
- ``alarm/fired``: 1 on a step where the alarm fired.

The alarm must see the lld/* and diag/* values of the *same* step, which LLDMonitor computes in its
own ``on_train_batch_end``: CollapseAlarm must come after LLDMonitor in ``trainer.callbacks``
(checked at setup; configs/heal.yaml appends it after the base config's callbacks).

Other callbacks react to the alarm through ``fired_at`` / ``fired_steps`` and
:meth:`CollapseAlarm.add_listener` (the Heal callback is one), not by reading its state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import numpy as np

from lldslight.science.alarm import SIGNALS, AlarmConfig, AlarmRule, AlarmUpdate
from lldslight.errors import ConfigError


@dataclass
class AlarmEvent:
    """One firing, as listeners see it.

    Args:
        step: the training step the alarm fired on.
        onset: the CUSUM's change-point estimate (first step of the crossed signals' excursion).
        signals: the signals that had crossed (or crossed far).
        reason: the condition, in words.
    """

    step: int
    onset: int
    signals: list[str]
    reason: str


Listener = Callable[[AlarmEvent, pl.Trainer, pl.LightningModule], None]


def _f32(value: Any) -> float:
    # The logger stores values as float32: feeding the rule the same rounding makes replay_alarm on
    # metrics.csv reproduce the logged statistics exactly.
    try:
        return float(np.float32(float(value)))
    except (TypeError, ValueError):
        return float("nan")


class CollapseAlarm(pl.Callback):
    """Raises an alarm when the signals that moved before past collapses move together.

    Args:
        rule: the rule's signals, baseline window, CUSUM slack k and threshold h, votes,
            consecutive steps and "far" factor (lldslight.science.alarm.AlarmConfig).
        print_fired: print one line when the alarm fires.
    """

    def __init__(self, rule: AlarmConfig = AlarmConfig(), print_fired: bool = True) -> None:
        self.config = rule
        self.print_fired = print_fired
        self.rule = AlarmRule(rule)
        self.events: list[AlarmEvent] = []  # every firing of this run (checkpointed)
        self.last_update: Optional[AlarmUpdate] = None
        self._listeners: list[Listener] = []
        self._monitor = None

    # -- the interface other callbacks use -----------------------------------------------------------

    @property
    def fired_steps(self) -> list[int]:
        """The training steps on which the alarm fired, in order."""
        return [e.step for e in self.events]

    @property
    def fired_at(self) -> Optional[int]:
        """The first step the alarm fired on, or None."""
        return self.events[0].step if self.events else None

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, trainer, pl_module)`` on every firing, at the end of the step that fired,
        after the alarm logged it (a listener may then roll the run back)."""
        if fn not in self._listeners:
            self._listeners.append(fn)

    def rule_state(self) -> dict[str, Any]:
        """A copy of the rule's state (baselines, statistics, windows), for snapshots."""
        return self.rule.state_dict()

    def load_rule_state(self, state: dict[str, Any]) -> None:
        """Put back a :meth:`rule_state` (the firing history, ``events``, is kept)."""
        self.rule.load_state_dict(state)

    def reset_statistics(self, step: Optional[int] = None) -> None:
        """Restart every CUSUM at 0 (baselines stay): after a heal rolled the run back."""
        self.rule.reset_statistics(step)

    # -- wiring ------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lldslight.callbacks.monitor import LLDMonitor

        callbacks = list(trainer.callbacks)
        mine = callbacks.index(self)
        monitors = [i for i, cb in enumerate(callbacks) if isinstance(cb, LLDMonitor)]
        needs = [s for s in self.config.signals if SIGNALS[s].source.startswith("LLDMonitor")]
        if needs and not monitors:
            raise ConfigError(
                f"CollapseAlarm.rule.signals {needs} read metrics LLDMonitor logs: add lldslight.callbacks.LLDMonitor to "
                "trainer.callbacks before CollapseAlarm (configs/monitor.yaml)"
            )
        if monitors and monitors[0] > mine:
            raise ConfigError(
                "CollapseAlarm must come after LLDMonitor in trainer.callbacks: it reads the lld/* and diag/* values "
                "LLDMonitor computes at the end of the same step"
            )
        self._monitor = callbacks[monitors[0]] if monitors else None
        if self._monitor is not None:
            if "gate_open" in self.config.signals and not self._monitor.measure_gate:
                raise ConfigError("CollapseAlarm.rule.signals has gate_open, which needs LLDMonitor.measure_gate: true")
            if "delta_negative_share" in self.config.signals and not self._monitor.measure_delta:
                raise ConfigError("CollapseAlarm.rule.signals has delta_negative_share, which needs LLDMonitor.measure_delta: true")

    # -- per step ------------------------------------------------------------------------------------------

    def step_inputs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """This step's values of the rule's input keys (NaN for missing), rounded as logged."""
        step = trainer.global_step - 1
        metrics = dict(getattr(pl_module, "last_step_metrics", {}) or {})
        monitor = self._monitor
        if monitor is not None and getattr(monitor, "last_step", None) == step:
            metrics.update(monitor.last_metrics)  # a monitor that skipped this step left stale values: not used
        return {k: _f32(metrics.get(k, float("nan"))) for k in self.config.input_keys()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # this step's row in metrics.csv (global_step counts it already)
        update = self.rule.update(self.step_inputs(trainer, pl_module), step=step)
        self.last_update = update
        # Every rank feeds the same reduced metrics, so every rank fires on the same step.
        pl_module.log_dict(update.log_metrics(), on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
        if not update.fired:
            return
        crossed = [n for n in self.config.signals if update.crossed[n]]
        event = AlarmEvent(step=step, onset=int(update.onset if update.onset is not None else step), signals=crossed, reason=update.reason)
        self.events.append(event)
        if self.print_fired and trainer.is_global_zero:
            values = "  ".join(
                f"{n} {update.values[n]:.3f}" for n in self.config.signals if math.isfinite(update.values[n])
            )
            print(
                f"[lldslight] COLLAPSE ALARM at step {step}: {event.reason}; change began about step {event.onset}. "
                f"{values}",
                flush=True,
            )
        for fn in list(self._listeners):
            fn(event, trainer, pl_module)

    # -- checkpoint state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"rule": self.rule.state_dict(), "events": [vars(e).copy() for e in self.events]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rule.load_state_dict(state_dict["rule"])
        self.events = [AlarmEvent(**e) for e in state_dict.get("events", [])]
