"""The optimiser's settings (``model.optim.*``), the optimiser and its warm-up schedule, and the one
way to change the learning rate of a run in progress.

``OptimConfig`` is to the optimiser what ``update.UpdateConfig`` is to the update: every knob typed,
documented by the docstring under it (jsonargparse shows it in ``--help``; docs/configuration.md
lists them), checked when it is built. GRPOModule takes it whole as ``model.optim``.

:func:`set_learning_rate` is the rate change every caller shares (a resume that overrides
``model.optim.lr``, Heal's remedy, a rate controller): torch's LambdaLR keeps the rate in three
places (each group's ``lr``, the scheduler's ``base_lrs``, and what ``get_last_lr()`` reports) and
has no public setter, so it is written once, here, through public attributes only.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from lldslight.errors import require, require_choice

OptimizerName = Literal["adamw", "adamw8bit"]


@dataclass(frozen=True)
class OptimConfig:
    """The optimiser and its learning-rate schedule (``model.optim.<field>`` in YAML): AdamW, a
    linear warm-up from 1/warm-up of the rate, then constant (the paper's and Search-R1's schedule)."""

    lr: float = 1e-6
    """Learning rate after the warm-up (paper: 1e-6 full fine-tuning; LoRA wants ~1e-5..1e-4)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    warmup_steps: Optional[int] = None
    """Linear warm-up length in training steps (rollout batches); null uses ``warmup_ratio``."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of ``trainer.max_steps`` (paper: 0.285), when ``warmup_steps`` is null."""
    optimizer: OptimizerName = "adamw"
    """"adamw" (torch) or "adamw8bit" (bitsandbytes' 8-bit AdamW, CPU or GPU)."""

    def __post_init__(self) -> None:
        require(self.lr > 0, "model.optim.lr", "> 0", self.lr)
        require(self.weight_decay >= 0, "model.optim.weight_decay", ">= 0", self.weight_decay)
        betas = tuple(self.betas)
        require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "model.optim.betas", "two numbers in [0, 1)", self.betas)
        object.__setattr__(self, "betas", betas)  # a YAML list becomes the tuple torch expects
        require(self.warmup_steps is None or self.warmup_steps >= 0, "model.optim.warmup_steps", ">= 0 or null", self.warmup_steps)
        require(0 <= self.warmup_ratio <= 1, "model.optim.warmup_ratio", "in [0, 1]", self.warmup_ratio)
        require_choice(self.optimizer, "model.optim.optimizer", OptimizerName)

    def warmup(self, max_steps: int) -> int:
        """The warm-up length in steps for a run of ``max_steps`` (<= 0: unknown, no ratio warm-up)."""
        if self.warmup_steps is not None:
            return int(self.warmup_steps)
        return int(round(self.warmup_ratio * max(max_steps, 0)))


def build_optimizer(params: list, config: OptimConfig, max_steps: int):
    """(optimizer, LambdaLR scheduler) for ``params`` (parameters, or torch's parameter-group
    dicts): the rate ramps linearly to ``config.lr`` over the warm-up, then stays. The scheduler steps once per training step (update.train_on_rollout)."""
    if config.optimizer == "adamw8bit":
        from lldslight.policy.load import require_bitsandbytes

        bnb = require_bitsandbytes("model.optim.optimizer: adamw8bit")
        optimizer = bnb.optim.AdamW8bit(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    warmup = config.warmup(max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)
    return optimizer, scheduler


def scheduler_of(trainer) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
    """The run's learning-rate scheduler (the first one Lightning configured), None without one."""
    configs = trainer.lr_scheduler_configs
    return configs[0].scheduler if configs else None


def set_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Optional[torch.optim.lr_scheduler.LRScheduler],
                      lr: float | Sequence[float]) -> list[float]:
    """Make ``lr`` the run's base learning rate from now on (one number for every parameter group,
    or one per group) and return the rates in force, one per group.

    With a LambdaLR (GRPOModule's), the schedule goes on as if the run had started with ``lr``: each
    group's rate becomes ``lr x multiplier(current step)``, its ``base_lrs`` and each group's
    ``initial_lr`` become ``lr``, and ``get_last_lr()`` reports the new rates. Without a scheduler,
    each group's rate is ``lr``. The optimiser's state (moments, step counts) is untouched.
    """
    groups = optimizer.param_groups
    rates = [float(lr)] * len(groups) if isinstance(lr, (int, float)) else [float(x) for x in lr]
    require(len(rates) == len(groups), "set_learning_rate lr", f"one rate or {len(groups)} (one per parameter group)", lr)
    require(all(r >= 0 for r in rates), "set_learning_rate lr", ">= 0", lr)
    if scheduler is None:
        for group, rate in zip(groups, rates):
            group["lr"] = rate
        return rates
    require(isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR), "set_learning_rate scheduler",
            "a LambdaLR (a rate times a multiplier of the step) or None", type(scheduler).__name__)
    scheduler.base_lrs = list(rates)
    for group, rate in zip(groups, rates):
        group["initial_lr"] = rate
    # Evaluate the schedule again at the step it is at: step() recomputes every group's rate from
    # base_lrs and sets what get_last_lr() reports (no public setter exists for that); stepping
    # back first keeps the step count. The warning it may raise (a step() before optimizer.step())
    # is about training order, which this does not change.
    scheduler.last_epoch -= 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        scheduler.step()
    return [float(group["lr"]) for group in groups]
