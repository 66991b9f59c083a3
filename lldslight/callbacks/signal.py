"""GroupSignal: says when GRPO's groups carry little or no learning signal, once in words and then
every step as a metric. On in every training run (GRPOModule adds it; configure your own instance
in ``trainer.callbacks`` to change its settings).

GRPO learns from reward differences inside a group: a group whose G rewards are all equal (it
*ties*) gives each of its rollouts advantage 0, so it adds nothing to the policy gradient. At a
success rate p a group of G ties with probability p^G + (1 - p)^G: half the groups at G = 2 and
p = 0.5, more as p moves from 0.5, an eighth at G = 4. Two situations, each warned about once:

- **Most groups of a window tie** (``signal/starved``): over the last ``window`` steps more than
  ``max_tied_share`` of the groups tied. The updates then come from the few mixed groups, and the
  KL, entropy and LLDS terms act almost alone on the rest.
- **Groups smaller than ``min_group_size`` with LLDS or a drift bound on** (``signal/small_groups``):
  LLDS preserves the likelihood of every response with A >= 0, tied ones included, so when most
  groups tie its pull towards pi_old makes up most of the update (a published LLDS port trained
  with G = 2 lost all its exact match); a drift bound (``model.update.target_kl``, AdaptiveRate)
  reads the KL of mini-batches made mostly of tied rows, which barely move, so the early stop
  comes late and AdaptiveRate keeps the rate high while the few mixed groups take the steps.

It reads ``train/zero_var_groups`` from the module's reduced step metrics (the same on every
rank), so every rank decides alike; its window is checkpointed, so a resumed run goes on with it.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lldslight.callbacks.drift import AdaptiveRate
from lldslight.callbacks.llds import LLDS
from lldslight.errors import require


def tie_probability(group_size: int, success: float) -> float:
    """The chance that a group of ``group_size`` rollouts with success rate ``success`` ties
    (all right or all wrong, binary rewards)."""
    return success**group_size + (1 - success) ** group_size


class GroupSignal(pl.Callback):
    """Warns once, then logs every step, when the groups carry little GRPO signal.

    Args:
        window: steps over which the share of tied groups is taken.
        max_tied_share: ``signal/starved`` is 1 (and the warning is shown once) when more than this
            share of the window's groups tied, once the window is full.
        min_group_size: the smallest group that LLDS or a drift bound is run with without a warning.
    """

    def __init__(self, window: int = 10, max_tied_share: float = 0.5, min_group_size: int = 4) -> None:
        require(window >= 1, "GroupSignal.window", ">= 1 (steps)", window)
        require(0.0 <= max_tied_share < 1.0, "GroupSignal.max_tied_share", "in [0, 1)", max_tied_share)
        require(min_group_size >= 2, "GroupSignal.min_group_size", ">= 2", min_group_size)
        self.window = window
        self.max_tied_share = max_tied_share
        self.min_group_size = min_group_size
        self.shares: deque[float] = deque(maxlen=window)  # train/zero_var_groups of the last steps
        self.warned_starved = False
        self.warned_small = False

    # -- what is on ------------------------------------------------------------------------------------

    @staticmethod
    def amplifiers(trainer: pl.Trainer, pl_module: Any) -> list[str]:
        """The settings that a small group size makes worse: LLDS (coef > 0) and the drift bound."""
        found = []
        if any(isinstance(cb, LLDS) and cb.coef > 0 for cb in trainer.callbacks):
            found.append("LLDS")
        update = getattr(pl_module, "update_config", None)
        if getattr(update, "target_kl", None) is not None:
            found.append("model.update.target_kl")
        if any(isinstance(cb, AdaptiveRate) for cb in trainer.callbacks):
            found.append("AdaptiveRate")
        return found

    # -- each step -------------------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = getattr(pl_module, "last_step_metrics", None) or {}
        traj = getattr(pl_module, "last_rollout", None)
        if "train/zero_var_groups" not in metrics or traj is None:
            return
        self.shares.append(float(metrics["train/zero_var_groups"]))
        tied = sum(self.shares) / len(self.shares)
        starved = len(self.shares) == self.window and tied > self.max_tied_share
        group_size = int(torch.unique(traj.group_id, return_counts=True)[1].min())
        amplifiers = self.amplifiers(trainer, pl_module)
        small = group_size < self.min_group_size and bool(amplifiers)
        if starved and not self.warned_starved:
            self.warned_starved = True
            rank_zero_warn(self.starved_message(tied, group_size, amplifiers))
        if small and not self.warned_small:
            self.warned_small = True
            rank_zero_warn(self.small_message(group_size, amplifiers))
        pl_module.log_dict({"signal/tied_share": tied, "signal/starved": float(starved), "signal/small_groups": float(small)},
                           on_step=True, on_epoch=False, batch_size=1, sync_dist=False)  # from reduced metrics

    def starved_message(self, tied: float, group_size: int, amplifiers: list[str]) -> str:
        worse = (f" With {' and '.join(amplifiers)} on, those terms then make up most of each update "
                 "(docs/guards.md)." if amplifiers else "")
        return (f"no GRPO signal: {tied:.0%} of the groups of the last {self.window} steps tied (all {group_size} rewards "
                f"of a group equal, so advantage 0 for each of its rollouts); the policy gradient comes from the other "
                f"{1 - tied:.0%} only, and the KL, entropy and loss terms act alone on the rest.{worse} Raise "
                "rollout.group_size, turn on dynamic sampling (configs/dynamic_sampling.yaml) or warm-start (lldslight sft). "
                "Shown once; signal/starved marks every such step.")

    def small_message(self, group_size: int, amplifiers: list[str]) -> str:
        what = []
        if "LLDS" in amplifiers:
            what.append("LLDS preserves every response with A >= 0, tied ones included, so its pull towards pi_old "
                        "makes up most of the update (a published LLDS port run with G = 2 lost all its exact match)")
        if any(a != "LLDS" for a in amplifiers):
            what.append("the drift bound reads the KL of mini-batches made mostly of tied rows, which barely move, so the "
                        "early stop comes late and AdaptiveRate keeps the rate high while the few mixed groups take the steps")
        return (f"rollout.group_size {group_size} < {self.min_group_size} with {' and '.join(amplifiers)} on: a group of "
                f"{group_size} ties with probability {tie_probability(group_size, 0.5):.0%} at a success rate of 0.5 and "
                f"{tie_probability(group_size, 0.2):.0%} at 0.2, so most groups carry no GRPO signal; "
                f"{'; '.join(what)}. Use rollout.group_size >= {self.min_group_size} (the paper: 5). "
                "Shown once; signal/small_groups marks every step.")

    # -- resume ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"shares": list(self.shares)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.shares = deque(state_dict.get("shares", []), maxlen=self.window)
