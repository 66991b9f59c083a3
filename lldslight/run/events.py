"""Metrics of events (a heal, a probe, a guard's stop): written once, on the row of their step.

Through ``LightningModule.log`` a key logged on one step only is written again on the rows after
it until Lightning's result collection is reset (seen in the lab: 15 rows of one probe), which a
reader of metrics.csv would take for 15 events. Events go to the loggers directly instead.
"""
from __future__ import annotations

from typing import Mapping


def log_event(trainer, metrics: Mapping[str, float], step: int) -> None:
    """Write ``metrics`` at ``step`` (the 0-based training step they belong to) on rank 0."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(dict(metrics), step=step)
