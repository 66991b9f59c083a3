"""Test-only callback for the tiny CLI runs of tests/test_heal_cli.py (PYTHONPATH=tests)."""
from __future__ import annotations

import lightning.pytorch as pl


class ForceMetric(pl.Callback):
    """Overwrites ``key`` in the step's ``GRPOModule.last_step_metrics`` with ``values[step]`` on
    the steps listed. Put it after LLDMonitor and before CollapseAlarm: the alarm then sees a
    chosen series (a forced alarm) while the module logged the real values."""

    def __init__(self, key: str, values: dict[int, float]) -> None:
        self.key = key
        self.values = {int(k): float(v) for k, v in values.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1
        if step in self.values:
            pl_module.last_step_metrics[self.key] = self.values[step]
