"""StepRow: a checkpoint carries the metrics row of its own step, and a resume writes that row back
when the run never wrote it. On in every fit (GRPOModule adds it).

Lightning writes a step's checkpoint in ``on_train_batch_end`` and hands the step's metrics to the
loggers just after; a process killed in between (SIGKILL, a power cut) left a ``last.ckpt`` of step N
and no row of step N in ``metrics.csv`` or TensorBoard. A resume from that checkpoint starts at step
N + 1, so the row was never written at all, while a resume promises one row a step, bit for bit
(docs/errors_and_resume.md). The row is known when the checkpoint is written (Lightning's logger
connector holds the step's logged values until it hands them over), so it is saved with it.

A run stopped by Ctrl-C or an error in that same gap writes the row itself: Lightning calls
``on_exception`` before it finalises the loggers, and the row of the checkpoint just written is
logged there when Lightning has not logged it yet (so a stopped run's CSV ends with its last
checkpoint's step without waiting for a resume).
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl

KEY = "lldslight_step_row"


def _has_row(path: Path, step: int, keys: set[str]) -> bool:
    """Whether ``path`` (a metrics.csv) holds a row of ``step`` with any of ``keys`` filled."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            for row in csv.DictReader(f):
                try:
                    same = row.get("step") not in (None, "") and int(float(row["step"])) == step
                except ValueError:
                    continue
                if same and any(row.get(k) not in (None, "") for k in keys):
                    return True
    except OSError:
        return True  # unreadable: nothing to decide from; add nothing
    return False


class StepRow(pl.Callback):
    """Saves the step's metrics row in each checkpoint written during training; after a resume,
    logs it to every logger when the checkpoint's run has no row of that step."""

    def __init__(self) -> None:
        self.pending: Optional[dict[str, Any]] = None
        # The row of the checkpoint written in this step's on_train_batch_end, until Lightning logs it.
        self.unlogged: Optional[dict[str, Any]] = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if not trainer.training:
            return
        from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

        try:
            # What Lightning hands the loggers right after this hook: its logger connector's view of
            # the step's logged values (private; Lightning has no public view of a row before it is logged).
            logged = trainer._logger_connector.metrics["log"]
        except Exception:  # noqa: BLE001 - another Lightning: no row saved, nothing else changes
            return
        if not logged:
            return
        row = convert_tensors_to_scalars(dict(logged))
        row.setdefault("epoch", trainer.current_epoch)  # as Lightning's log_metrics adds it
        checkpoint[KEY] = {"step": int(trainer.fit_loop.epoch_loop._batches_that_stepped), "metrics": row}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        # Saved from a batch's end hooks (the batch processed, not yet completed): Lightning logs the row next.
        self.unlogged = checkpoint[KEY] if progress.processed > progress.completed else None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation inside fit runs after the step's row was handed to the loggers.
        self.unlogged = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        unlogged, self.unlogged = self.unlogged, None
        # Lightning logs a step's row, then (after validation, if any) counts the step: a count still
        # at the row's step, with no validation since, means the row never reached the loggers.
        if not unlogged or not trainer.is_global_zero or trainer.fit_loop.epoch_loop._batches_that_stepped != unlogged["step"]:
            return
        for logger in trainer.loggers:
            logger.log_metrics(unlogged["metrics"], step=unlogged["step"])

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.pending = checkpoint.get(KEY)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pending, self.pending = self.pending, None
        ckpt = getattr(trainer, "ckpt_path", None)
        if not pending or not ckpt or not trainer.is_global_zero:
            return
        step, row = pending["step"], pending["metrics"]
        # The checkpoint's run directory (Lightning's layout, version_N/checkpoints/) and this run's CSV files.
        files = [Path(ckpt).parent.parent / "metrics.csv"]
        files += [Path(str(lg.log_dir)) / "metrics.csv" for lg in trainer.loggers if getattr(lg, "log_dir", None)]
        files = [f for f in dict.fromkeys(files) if f.is_file()]
        keys = set(row) - {"epoch"}
        if not files or any(_has_row(f, step, keys) for f in files):
            return  # written (or no metrics.csv to tell from)
        for logger in trainer.loggers:
            logger.log_metrics(row, step=step)
            logger.save()
        print(f"[lldslight] resuming: the metrics of step {step} were not written before the run stopped; "
              f"written now, from {ckpt}", file=sys.stderr, flush=True)
