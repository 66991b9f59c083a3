"""The training progress bar counts steps (rollout batches) out of ``trainer.max_steps``.

Lightning's bars count batches of the current epoch and name the epoch out of ``max_epochs - 1``:
with ``max_steps`` set (every lldslight config) ``max_epochs`` is -1, so the bar read "Epoch 0/-2",
and its total was the epoch's batch count, which has nothing to do with when training stops.
These subclasses show "Step" with ``global_step`` of ``max_steps`` across epochs and resumes
(without ``max_steps`` they behave as Lightning's). ``GRPOModule.configure_callbacks`` swaps them in
for Lightning's default bars (:func:`step_bar_for`); a bar configured in YAML is left alone.
"""
from __future__ import annotations

import copy
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar


def _max_steps(trainer: "pl.Trainer") -> int:
    return int(trainer.max_steps) if trainer.max_steps is not None and trainer.max_steps > 0 else 0


class _Steps:
    """What both bars share: the total is max_steps, the count is global_step."""

    trainer: "pl.Trainer"

    @property
    def total_train_batches(self) -> Union[int, float]:
        steps = _max_steps(self.trainer)
        return steps if steps else super().total_train_batches  # type: ignore[misc]


class StepTQDMProgressBar(_Steps, TQDMProgressBar):
    """TQDMProgressBar showing ``Step global_step/max_steps``."""

    def on_train_epoch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        steps = _max_steps(trainer)
        if not steps:
            return super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        if bar.total != steps:  # the first epoch of this fit; later epochs carry on counting
            bar.reset(total=steps)
            bar.n = trainer.global_step  # a resumed run starts where it was
            bar.set_description("Step")
            bar.refresh()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if not _max_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        if bar is not None and self._should_update(trainer.global_step, bar.total):
            if not bar.disable:
                bar.n = trainer.global_step
                bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))


class StepRichProgressBar(_Steps, RichProgressBar):
    """RichProgressBar showing ``Step global_step/max_steps``."""

    def _get_train_description(self, current_epoch: int) -> str:
        if not _max_steps(self.trainer):
            return super()._get_train_description(current_epoch)
        text = "Step"
        return f"{text:{len(self.validation_description)}}"  # padded as Lightning pads "Epoch N"

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if _max_steps(trainer):
            self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if not _max_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # resumed mid-epoch
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)


def step_bar_for(bar: Optional[ProgressBar]) -> Optional[ProgressBar]:
    """The step-counting version of one of Lightning's default bars, with its settings (refresh
    rate, theme, ...); None for no bar or a bar of any other class (the user chose it)."""
    kinds = {TQDMProgressBar: StepTQDMProgressBar, RichProgressBar: StepRichProgressBar}
    kind = kinds.get(type(bar))
    if kind is None:
        return None
    # Before training starts a bar holds only its settings: a shallow copy with the subclass
    # keeps them all without naming each constructor argument.
    step_bar = copy.copy(bar)
    step_bar.__class__ = kind
    return step_bar
