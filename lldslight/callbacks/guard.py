"""GradientSpikeGuard: keeps non-finite and spiking gradients away from the optimiser.

A step gate (``GRPOModule.add_step_gate``): it runs after backward and before the optimiser step
of every update, on the total pre-clip gradient norm, which is global under DDP (gradients are
all-reduced) and FSDP2 (the module reduces the sharded norm). Every rank sees the same norm and
window, so every rank takes the same decision. A vetoed update changes neither the weights nor
the optimiser state (the module zeroes the gradients and skips the step).

Why: in the collapse phase of GRPO on search agents (docs/algorithm.md §3) gradient norms spike while
entropy explodes; one such update can wreck a run that a skipped update would have saved.

The window holds only the norms of single updates that were accepted as they came: not the norms
of empty updates (a mini-batch whose groups all tie has no policy gradient: norm 0, or a KL-only
trickle), which would pull the median to 0 once most mini-batches tie, exactly around a collapse,
and then veto every update that carries signal ("2.2 > 10 x median 0"); and not a spike that was
vetoed or clipped (a clipped spike used to enter the window as the median itself). So every veto
compares one update's norm with the median of single, ordinary updates' norms.
"""
from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any, Literal, Optional, Protocol, get_args, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lldslight.errors import ConfigError, require
from lldslight.run.events import log_event

SpikeAction = Literal["veto", "clip"]
GiveUpAction = Literal["stop", "restore", "heal"]
RestoreSource = Literal["memory", "checkpoint"]


@runtime_checkable
class Healer(Protocol):
    """What ``on_give_up: heal`` needs from the callback that heals (lldslight.callbacks.Heal): the
    guard declares it rather than importing Heal, which itself finds the guard to reset its window."""

    def heal_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, onset: int, reason: str) -> bool: ...


class GradientSpikeGuard(pl.Callback):
    """Vetoes (or clips) updates whose gradient norm is non-finite or spikes above the recent median.

    Args:
        factor: a norm above ``factor`` x the median of the window is a spike.
        window: how many recent accepted, non-empty updates the median is taken over.
        warmup: such updates to see before spikes are judged (non-finite norms always are).
        empty_below: an update whose norm is 0, or at most ``empty_below`` x the window's median,
            is empty (all its groups tied: no policy gradient). It is accepted but never enters
            the window nor counts toward warm-up (0 = only exact zeros are empty).
        on_spike: "veto" skips the update; "clip" rescales the gradient to the median's norm and
            lets the update through.
        max_consecutive_vetoes: after this many vetoed updates in a row, ``on_give_up`` happens
            (0 = never).
        on_give_up: "stop" saves a checkpoint and stops the run with a message; "restore" goes back
            to the last good state and carries on (at most ``max_restores`` times, then stops);
            "heal" hands the run to the Heal callback (trainer.callbacks must hold one), which rolls
            back further (to a snapshot from before the vetoes began, minus its margin) and changes
            the dynamics (its remedies); once Heal's cap is reached the guard stops the run.
        restore_from: "memory" keeps a copy of the trainable parameters and optimiser state at the
            end of every rollout batch whose updates were all accepted (costs one copy of both);
            "checkpoint" reloads them from the checkpoint callback's last saved file (a single-file
            checkpoint; a sharded FSDP checkpoint directory is not reloaded and the run stops).
        max_restores: restores allowed before giving up with "stop".
        checkpoint_dir: where the stop checkpoint goes (default: the checkpoint callback's dirpath,
            else the logger's directory).
    """

    def __init__(
        self,
        factor: float = 10.0,
        window: int = 50,
        warmup: int = 10,
        empty_below: float = 1e-3,
        on_spike: SpikeAction = "veto",
        max_consecutive_vetoes: int = 5,
        on_give_up: GiveUpAction = "stop",
        restore_from: RestoreSource = "memory",
        max_restores: int = 3,
        checkpoint_dir: Optional[str] = None,
    ) -> None:
        require(factor > 1.0, "GradientSpikeGuard.factor", "> 1", factor)
        require(window >= 1, "GradientSpikeGuard.window", ">= 1", window)
        for name, value in (("warmup", warmup), ("max_consecutive_vetoes", max_consecutive_vetoes), ("max_restores", max_restores)):
            require(value >= 0, f"GradientSpikeGuard.{name}", ">= 0", value)
        require(0.0 <= empty_below < 1.0 / factor, "GradientSpikeGuard.empty_below", f"in [0, 1/factor = {1.0 / factor:g})", empty_below,
                "an empty update must be far below a spike")
        for name, value, choices in (("on_spike", on_spike, SpikeAction), ("on_give_up", on_give_up, GiveUpAction),
                                     ("restore_from", restore_from, RestoreSource)):
            require(value in get_args(choices), f"GradientSpikeGuard.{name}", f"one of {get_args(choices)}", value)
        self.factor = factor
        self.window = window
        self.warmup = warmup
        self.empty_below = empty_below
        self.on_spike = on_spike
        self.max_consecutive_vetoes = max_consecutive_vetoes
        self.on_give_up = on_give_up
        self.restore_from = restore_from
        self.max_restores = max_restores
        self.checkpoint_dir = checkpoint_dir
        # Checkpointed state (see state_dict): the rolling window and the counters.
        self.history: deque[float] = deque(maxlen=window)
        self.accepted = 0
        self.consecutive_vetoes = 0
        self.total_vetoes = 0
        self.empty_updates = 0
        self.restores = 0
        # Per-run state.
        self._tripped: Optional[str] = None  # why the guard gave up, acted on at the batch end
        self._batch_vetoes = 0
        self._snapshot: Optional[dict[str, Any]] = None
        self.stop_checkpoint: Optional[str] = None
        self.message: Optional[str] = None
        self._heal = None  # the Heal callback, with on_give_up: heal
        self._streak_start = 0  # the step the current run of vetoes began in

    # -- wiring ---------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require(hasattr(pl_module, "add_step_gate"), "model (for GradientSpikeGuard)", "a module with add_step_gate (GRPOModule)",
                type(pl_module).__name__)
        pl_module.add_step_gate("gradient_spike_guard", self.gate)
        if self.on_give_up == "heal":
            heals = [cb for cb in trainer.callbacks if isinstance(cb, Healer)]
            if not heals:
                raise ConfigError("GradientSpikeGuard.on_give_up: heal needs a lldslight.callbacks.Heal in trainer.callbacks (configs/heal.yaml)")
            self._heal = heals[0]

    def reset_window(self) -> None:
        """Forget the window and the veto streak (warm-up starts again): after a heal changed the
        rate, old norms are not like the new ones. A pending give-up and the restore copy go too."""
        self.history.clear()
        self.accepted = 0
        self.consecutive_vetoes = 0
        self._tripped = None
        self._snapshot = None

    def median(self) -> Optional[float]:
        """The median of the window once warm-up is over, else None (no spike judgement yet)."""
        if self.accepted < self.warmup or not self.history:
            return None
        return statistics.median(self.history)

    # -- the gate -------------------------------------------------------------------------------------

    def is_empty(self, norm: float) -> bool:
        """An update with no policy gradient (its groups all tied): norm 0, or a trickle (a KL or
        entropy term alone) at most ``empty_below`` x the window's median."""
        if norm == 0.0:
            return True
        return bool(self.history) and norm <= self.empty_below * statistics.median(self.history)

    def gate(self, ctx) -> bool:
        norm = float(ctx.grad_norm)
        median = self.median()
        ctx.metrics["guard/grad_norm"] = norm
        if median is not None:
            ctx.metrics["guard/median"] = median
        ctx.metrics["guard/empty"] = 0.0
        reason = None
        spike = False
        if self._tripped is not None:
            reason = "the guard already gave up in this rollout batch"
        elif not math.isfinite(norm):
            reason = f"non-finite gradient norm ({norm})"
        elif ctx.vetoed:
            reason = "rejected before the guard (non-finite loss or another gate)"
        elif median is not None and norm > self.factor * median:
            if self.on_spike == "clip":
                # Rescale in place to the median's norm; the module then applies its own clip to it.
                params = [p for p in ctx.module.trainable_parameters() if p.grad is not None]
                torch.nn.utils.clip_grads_with_norm_(params, median, ctx.grad_norm)
                ctx.grad_norm = torch.as_tensor(median, dtype=ctx.grad_norm.dtype, device=ctx.grad_norm.device)
                ctx.metrics["guard/clipped"] = 1.0
                spike = True
            else:
                reason = f"gradient norm {norm:.4g} > {self.factor:g} x median {median:.4g}"
        if reason is None:
            if self.is_empty(norm):
                self.empty_updates += 1
                ctx.metrics["guard/empty"] = 1.0
            elif not spike:
                # The norm as measured, never the clipped one: a window of single ordinary updates.
                self.history.append(norm)
                self.accepted += 1
            self.consecutive_vetoes = 0
            ctx.metrics["guard/vetoed"] = 0.0
            return True
        self.total_vetoes += 1
        self._batch_vetoes += 1
        ctx.metrics["guard/vetoed"] = 1.0
        if self._tripped is None:
            self.consecutive_vetoes += 1
            if self.consecutive_vetoes == 1:
                self._streak_start = int(ctx.module.global_step)  # the step being trained (counted after it)
            rank_zero_info(f"[GradientSpikeGuard] vetoed update {ctx.update_index} of step {ctx.module.global_step}: {reason}")
            if self.max_consecutive_vetoes and self.consecutive_vetoes >= self.max_consecutive_vetoes:
                self._tripped = f"{self.consecutive_vetoes} consecutive vetoed updates (last: {reason})"
        return False

    # -- giving up and restoring (at the batch boundary, so checkpoints and rollouts stay coherent) --

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_vetoes = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._tripped is None:
            if self.on_give_up == "restore" and self.restore_from == "memory" and self._batch_vetoes == 0:
                self._snapshot = self._capture(pl_module)
            return
        why, self._tripped = self._tripped, None
        self.consecutive_vetoes = 0
        if self.on_give_up == "heal":
            step = trainer.global_step - 1
            # Heal goes back to a snapshot from before the step the vetoes began in, minus its margin.
            onset = min(self._streak_start, step)
            if self._heal.heal_now(trainer, pl_module, step=step, onset=onset, reason=f"GradientSpikeGuard gave up: {why}"):
                self.message = f"GradientSpikeGuard: {why}; the Heal callback rolled the run back and continuing"
                rank_zero_warn(self.message)
                return
            why += "; the Heal callback could not heal (cap reached or no snapshot)"
        if self.on_give_up == "restore" and self.restores < self.max_restores:
            source = self._restore(trainer, pl_module)
            if source is not None:
                self.restores += 1
                self._log(trainer, "guard/restored", 1.0)
                self.message = f"GradientSpikeGuard: {why}; restored the last good state ({source}) and continuing"
                rank_zero_warn(self.message)
                return
            why += "; no good state to restore"
        elif self.on_give_up == "restore":
            why += f"; already restored {self.restores} times"
        self._stop(trainer, why)

    def _stop(self, trainer: pl.Trainer, why: str) -> None:
        directory = self.checkpoint_dir
        if directory is None:
            ckpt_cb = trainer.checkpoint_callback
            directory = getattr(ckpt_cb, "dirpath", None) or trainer.log_dir or trainer.default_root_dir
        path = Path(directory) / f"guard-stop-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(str(path))
        trainer.should_stop = True
        self.stop_checkpoint = str(path)
        self.message = (
            f"GradientSpikeGuard stopped the run at step {trainer.global_step}: {why}. "
            f"Saved {path}. The gradient norm kept exploding or turning non-finite; look at "
            "train/grad_norm, train/entropy and the log-prob metrics. Resuming from the checkpoint "
            "with a larger LLDS coef or a higher guard factor takes effect (callback arguments); a "
            "lower model.optim.lr given on resume does not by itself (the checkpoint's hyperparameters and "
            "scheduler base_lrs win): to lower the rate inside the run, use the Heal callback "
            "(configs/heal.yaml, docs/alarm_and_healing.md)."
        )
        self._log(trainer, "guard/stopped", 1.0)
        rank_zero_warn(self.message)

    def _log(self, trainer: pl.Trainer, key: str, value: float) -> None:
        log_event(trainer, {key: value}, trainer.global_step)

    @staticmethod
    def _capture(pl_module) -> dict[str, Any]:
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        return {
            "params": [p.detach().clone() for p in pl_module.trainable_parameters()],
            "optimizer": copy.deepcopy(optimizer.state_dict()),
        }

    def _restore(self, trainer: pl.Trainer, pl_module) -> Optional[str]:
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        if self.restore_from == "memory":
            if self._snapshot is None:
                return None
            with torch.no_grad():
                for p, saved in zip(pl_module.trainable_parameters(), self._snapshot["params"]):
                    p.copy_(saved)
            optimizer.load_state_dict(copy.deepcopy(self._snapshot["optimizer"]))
            return "in-memory copy"
        ckpt_cb = trainer.checkpoint_callback
        path = getattr(ckpt_cb, "last_model_path", "") or getattr(ckpt_cb, "best_model_path", "")
        if not path or not Path(path).is_file():
            return None
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        pl_module.load_state_dict(checkpoint["state_dict"], strict=False)
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        return path

    # -- checkpoint state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "accepted": self.accepted,
            "consecutive_vetoes": self.consecutive_vetoes,
            "total_vetoes": self.total_vetoes,
            "empty_updates": self.empty_updates,
            "restores": self.restores,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = deque(state_dict["history"], maxlen=self.window)
        self.accepted = int(state_dict["accepted"])
        self.consecutive_vetoes = int(state_dict["consecutive_vetoes"])
        self.total_vetoes = int(state_dict["total_vetoes"])
        self.empty_updates = int(state_dict.get("empty_updates", 0))
        self.restores = int(state_dict["restores"])
        # Checkpoints written before empty updates were kept out may hold zeros: drop them.
        self.history = deque((v for v in self.history if v > 0.0), maxlen=self.window)
