"""A callback for the resume-settings tests (run by the real CLI as a subprocess, PYTHONPATH=tests)."""
from __future__ import annotations

import lightning.pytorch as pl


class HalveLR(pl.Callback):
    """At the end of step ``step`` (0-based), halve the optimiser's lr and the scheduler's base_lrs,
    as a callback that heals a run by lowering its rate would: a plain resume must keep the lower rate."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step - 1 != self.step:
            return
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        for group in optimizer.param_groups:
            group["lr"] /= 2
            group["initial_lr"] = group.get("initial_lr", group["lr"]) / 2
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [lr / 2 for lr in config.scheduler.base_lrs]
