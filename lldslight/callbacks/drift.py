"""AdaptiveRate: set the learning rate once per rollout batch from how far that batch moved the policy.

The lab found the collapse here governed by off-policy drift times the rate: 8 updates per rollout
batch at 7e-4 died where one update (the on-policy twin) or half the rate held (docs/collapse_lab.md).
A fixed rate that is safe must be guessed; this callback measures the drift instead and keeps it
near a target, as rsl_rl's "adaptive" schedule does for PPO from the KL it measures (there between
Gaussian policies; here the token-level estimate the update logs).

Each training step, after the rollout batch's updates, it reads the batch's drift, the k3 estimate of
KL(pi_old || pi_theta) on the last update's mini-batch before its step (``drift/kl_k3_last``,
lldslight/update.py ``drift_shares``; reduced over ranks, so every rank decides alike), and sets the
factor ``scale`` on the schedule's base rate for the next rollout batch:

- KL > ``high`` x ``target_kl``: ``scale /= factor`` (the batch moved too far);
- KL < ``low`` x ``target_kl``: ``scale *= factor`` (room to move);
- then the base rate x ``scale`` is kept within [``lr_min``, ``lr_max``].

Coherent with the scheduler: the scheduler's ``base_lrs`` become the configured base rates x
``scale``, and the optimiser's current rates the scheduler's multiplier at this step x those, so a
warm-up or decay keeps its shape, scaled. Both live in the scheduler's and optimiser's states, which
Lightning checkpoints, so a resumed run continues with exactly the rate it had; ``scale`` is also
this callback's own state. Logged: ``drift/lr_scale`` and ``drift/target_kl`` (docs/metrics.md).

Pair it with the update's own early stop (``model.update.target_kl``: no further update of a rollout batch
once a mini-batch's KL passes 1.5 x the target) for the two halves of a drift bound.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Protocol

import lightning.pytorch as pl

from lldslight.errors import require
from lldslight.optim import scheduler_of, set_learning_rate


class DriftMeasured(Protocol):
    """What AdaptiveRate needs from the module: the last step's metrics, reduced over ranks
    (GRPOModule.last_step_metrics)."""

    last_step_metrics: dict[str, float]


class AdaptiveRate(pl.Callback):
    """Scale the learning rate each rollout batch to keep its measured drift near ``target_kl``.

    Args:
        target_kl: the drift aimed at: KL(pi_old || pi_theta) per model token, in nats, of a
            rollout batch's last update (typical values 0.005-0.05).
        factor: the multiplicative step of the scale (rsl_rl: 1.5).
        high: the scale falls when the KL exceeds ``high x target_kl`` (rsl_rl: 2).
        low: the scale rises when the KL is below ``low x target_kl`` (rsl_rl: 0.5).
        lr_min: the smallest base rate the scale may reach.
        lr_max: the largest base rate the scale may reach.
        metric: the step metric read as the batch's drift.
    """

    def __init__(self, target_kl: float, factor: float = 1.5, high: float = 2.0, low: float = 0.5, lr_min: float = 1e-6,
                 lr_max: float = 1e-3, metric: str = "drift/kl_k3_last") -> None:
        require(math.isfinite(target_kl) and target_kl > 0, "AdaptiveRate.target_kl", "> 0 (nats per token, e.g. 0.01)", target_kl)
        require(math.isfinite(factor) and factor > 1, "AdaptiveRate.factor", "> 1 (rsl_rl uses 1.5)", factor)
        require(0 < low < high, "AdaptiveRate.low/high", "0 < low < high (rsl_rl: 0.5 and 2)", (low, high))
        require(0 < lr_min <= lr_max and math.isfinite(lr_max), "AdaptiveRate.lr_min/lr_max", "0 < lr_min <= lr_max", (lr_min, lr_max))
        self.target_kl, self.factor, self.high, self.low = float(target_kl), float(factor), float(high), float(low)
        self.lr_min, self.lr_max, self.metric = float(lr_min), float(lr_max), metric
        self.scale = 1.0
        self.base: Optional[list[float]] = None  # the configured base rates (scale 1), from the first step
        self.last_kl: Optional[float] = None

    # -- the rule ----------------------------------------------------------------------------------

    def next_scale(self, kl: float, scale: float, base: float) -> float:
        """The scale for the next rollout batch, from this batch's KL (a non-finite KL lowers it:
        a step that cannot be measured is treated as too far)."""
        if not math.isfinite(kl) or kl > self.high * self.target_kl:
            scale /= self.factor
        elif kl < self.low * self.target_kl:
            scale *= self.factor
        return min(max(scale, self.lr_min / base), self.lr_max / base)

    # -- Lightning hooks ---------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: DriftMeasured, outputs: Any, batch: Any, batch_idx: int) -> None:
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        scheduler = scheduler_of(trainer)
        if self.base is None:
            self.base = list(scheduler.base_lrs) if scheduler is not None else [float(g["lr"]) for g in optimizer.param_groups]
        kl = pl_module.last_step_metrics.get(self.metric)
        require(kl is not None, "AdaptiveRate.metric", f"a logged step metric (the update logs {self.metric!r} since the drift "
                "metrics; is the module a GRPOModule?)", self.metric)
        self.last_kl = float(kl)
        self.scale = self.next_scale(self.last_kl, self.scale, max(self.base))
        set_learning_rate(optimizer, scheduler, [b * self.scale for b in self.base])
        pl_module.log_dict({"drift/lr_scale": self.scale, "drift/target_kl": self.target_kl}, on_step=True, on_epoch=False,
                           batch_size=1, sync_dist=False)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "base": self.base, "last_kl": self.last_kl}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The rates themselves come back with the optimiser's and scheduler's states; the scale
        # and the configured base rates so that the next decision continues from them.
        self.scale = float(state_dict.get("scale", 1.0))
        self.base = state_dict.get("base")
        self.last_kl = state_dict.get("last_kl")

