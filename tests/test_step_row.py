"""StepRow when a run stops between a step's checkpoint and its metrics row: a plain LightningModule,
Lightning's own ModelCheckpoint and CSVLogger, the stop raised at a chosen point; the CSV read back
with the csv module and each row's value predicted by hand."""
from __future__ import annotations

import csv
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lldslight.callbacks.step_row import StepRow


class Tiny(pl.LightningModule):
    """Logs ``train/value`` = batch index + 0.5 each step; raises KeyboardInterrupt (what Ctrl-C
    raises) at batch ``stop_at``, either in its batch-end hook (after the callbacks' batch-end hooks,
    ModelCheckpoint's save among them, and before Lightning hands the row to the loggers) or in the
    validation that follows that batch (after the row was handed over)."""

    def __init__(self, stop_at: int, where: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.stop_at, self.where, self.batch = stop_at, where, -1

    def training_step(self, batch, batch_idx):
        self.batch = batch_idx
        self.log("train/value", batch_idx + 0.5)
        return self.layer(batch).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.where == "batch_end" and batch_idx == self.stop_at:
            raise KeyboardInterrupt

    def validation_step(self, batch, batch_idx) -> None:
        if self.where == "validation" and self.batch == self.stop_at:
            raise KeyboardInterrupt

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.ones(8, 2), batch_size=1)

    def val_dataloader(self):
        return DataLoader(torch.ones(1, 2), batch_size=1)


def _stopped_fit(tmp_path: Path, where: str, stop_at: int = 2, step_row: bool = True) -> dict[int, list[float]]:
    """Fit until the stop; {step: [train/value of each CSV row of that step]}."""
    logger = CSVLogger(tmp_path, name="tiny", version=0, flush_logs_every_n_steps=100)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True)]
    callbacks += [StepRow()] if step_row else []
    trainer = pl.Trainer(max_steps=8, logger=logger, callbacks=callbacks, log_every_n_steps=1, val_check_interval=1,
                         limit_val_batches=1, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after KeyboardInterrupt
            trainer.fit(Tiny(stop_at, where))
    finally:
        signal.signal(signal.SIGINT, before)  # Lightning ignores further Ctrl-C during its shutdown
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == stop_at + 1
    rows: dict[int, list[float]] = {}
    with open(tmp_path / "tiny" / "version_0" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("train/value"):
                rows.setdefault(int(row["step"]), []).append(float(row["train/value"]))
    return rows


def test_a_stop_between_a_checkpoint_and_its_row_still_writes_the_row(tmp_path):
    rows = _stopped_fit(tmp_path, "batch_end")
    assert rows == {0: [0.5], 1: [1.5], 2: [2.5]}


def test_without_step_row_that_stop_loses_the_row(tmp_path):
    """The gap is real: Lightning alone writes no row of the checkpoint's step."""
    assert _stopped_fit(tmp_path, "batch_end", step_row=False) == {0: [0.5], 1: [1.5]}


def test_a_stop_after_the_row_was_logged_writes_it_once(tmp_path):
    """Stopped in the validation after batch 2: Lightning had logged the row, so StepRow adds none."""
    rows = _stopped_fit(tmp_path, "validation")
    assert rows == {0: [0.5], 1: [1.5], 2: [2.5]}
