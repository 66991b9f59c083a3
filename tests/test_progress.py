"""The training bar shows steps of max_steps (it read "Epoch 0/-2" before), across epochs."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lldslight.callbacks.progress import StepRichProgressBar, StepTQDMProgressBar, step_bar_for


class _Steps(pl.LightningModule):
    """One optimiser step per batch, as GRPOModule counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, float, str]] = []

    def training_step(self, batch, batch_idx):
        return (self.w - 1).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        bar = self.trainer.progress_bar_callback
        if isinstance(bar, StepTQDMProgressBar):
            self.seen.append((bar.train_progress_bar.n, bar.train_progress_bar.total, bar.train_progress_bar.desc.rstrip(": ")))
        else:
            task = bar.progress.tasks[bar.train_progress_bar_id]
            self.seen.append((task.completed, task.total, task.description.strip()))


@pytest.mark.parametrize("kind", [StepTQDMProgressBar, StepRichProgressBar])
def test_bar_counts_steps_of_max_steps_across_epochs(kind):
    module = _Steps()
    # 3 batches an epoch, 7 steps: the run crosses two epoch boundaries.
    trainer = pl.Trainer(accelerator="cpu", max_steps=7, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=[kind()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(torch.zeros(3, 1), batch_size=1))
    assert trainer.global_step == 7
    # Callbacks' on_train_batch_end run before the module's: at step k the bar reads k of 7.
    counts = [int(n) for n, _, _ in module.seen]
    assert counts == list(range(1, 8))
    assert {total for _, total, _ in module.seen} == {7}
    assert {desc for _, _, desc in module.seen} == {"Step"}
    bar = trainer.progress_bar_callback
    final = bar.train_progress_bar.n if kind is StepTQDMProgressBar else bar.progress.tasks[bar.train_progress_bar_id].completed
    assert final == 7


def test_grpo_module_swaps_in_the_step_bar_for_lightnings_defaults():
    from lldslight.module import GRPOModule

    for default, step in [(TQDMProgressBar(refresh_rate=3), StepTQDMProgressBar), (RichProgressBar(leave=True), StepRichProgressBar)]:
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[default])
        module = GRPOModule()
        module.trainer = trainer
        bar, *others = module.configure_callbacks()
        assert type(bar) is step and [type(c).__name__ for c in others] == ["GroupSignal", "StepRow"]  # test_signal.py, test_resume.py
        assert bar.__dict__ == default.__dict__  # its settings kept (refresh rate, leave, ...)
    module = GRPOModule()
    module.trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False)
    assert [type(c).__name__ for c in module.configure_callbacks()] == ["GroupSignal", "StepRow"]
    assert step_bar_for(StepTQDMProgressBar()) is None  # a bar the user chose stays as it is
