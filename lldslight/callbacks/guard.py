"""GradientSpikeGuard: keeps non-finite and spiking gradients away from the optimiser.

A step gate (``GRPOModule.add_step_gate``): it runs after backward and before the optimiser step
of every update, on the total pre-clip gradient norm, which is global under DDP (gradients are
all-reduced) and FSDP2 (the module reduces the sharded norm). Every rank sees the same norm and
window, so every rank takes the same decision. A vetoed update changes neither the weights nor
the optimiser state (the module zeroes the gradients and skips the step).

Why: in the collapse phase of GRPO on search agents (docs/algorithm.md §3) gradient norms spike while
entropy explodes; one such update can wreck a run that a skipped update would have saved.
"""
from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


class GradientSpikeGuard(pl.Callback):
    """Vetoes (or clips) updates whose gradient norm is non-finite or spikes above the recent median.

    Args:
        factor: a norm above ``factor`` x the median of the window is a spike.
        window: how many recent accepted updates the median is taken over.
        warmup: accepted updates to see before spikes are judged (non-finite norms always are).
        on_spike: "veto" skips the update; "clip" rescales the gradient to the median's norm and
            lets the update through.
        max_consecutive_vetoes: after this many vetoed updates in a row, ``on_give_up`` happens
            (0 = never).
        on_give_up: "stop" saves a checkpoint and stops the run with a message; "restore" goes back
            to the last good state and carries on (at most ``max_restores`` times, then stops).
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
        on_spike: Literal["veto", "clip"] = "veto",
        max_consecutive_vetoes: int = 5,
        on_give_up: Literal["stop", "restore"] = "stop",
        restore_from: Literal["memory", "checkpoint"] = "memory",
        max_restores: int = 3,
        checkpoint_dir: Optional[str] = None,
    ) -> None:
        if factor <= 1.0:
            raise ValueError(f"GradientSpikeGuard.factor must be > 1, got {factor}")
        if window < 1 or warmup < 0 or max_consecutive_vetoes < 0 or max_restores < 0:
            raise ValueError(
                "GradientSpikeGuard: window must be >= 1 and warmup, max_consecutive_vetoes, "
                f"max_restores >= 0 (got {window}, {warmup}, {max_consecutive_vetoes}, {max_restores})"
            )
        for name, value, allowed in (
            ("on_spike", on_spike, ("veto", "clip")),
            ("on_give_up", on_give_up, ("stop", "restore")),
            ("restore_from", restore_from, ("memory", "checkpoint")),
        ):
            if value not in allowed:
                raise ValueError(f"GradientSpikeGuard.{name} must be one of {allowed}, got {value!r}")
        self.factor = factor
        self.window = window
        self.warmup = warmup
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
        self.restores = 0
        # Per-run state.
        self._tripped: Optional[str] = None  # why the guard gave up, acted on at the batch end
        self._batch_vetoes = 0
        self._snapshot: Optional[dict[str, Any]] = None
        self.stop_checkpoint: Optional[str] = None
        self.message: Optional[str] = None

    # -- wiring ---------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "add_step_gate"):
            raise TypeError(f"GradientSpikeGuard needs a module with add_step_gate (GRPOModule), got {type(pl_module).__name__}")
        pl_module.add_step_gate("gradient_spike_guard", self.gate)

    def median(self) -> Optional[float]:
        """The median of the window once warm-up is over, else None (no spike judgement yet)."""
        if self.accepted < self.warmup or not self.history:
            return None
        return statistics.median(self.history)

    # -- the gate -------------------------------------------------------------------------------------

    def gate(self, ctx) -> bool:
        norm = float(ctx.grad_norm)
        median = self.median()
        ctx.metrics["guard/grad_norm"] = norm
        if median is not None:
            ctx.metrics["guard/median"] = median
        reason = None
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
            else:
                reason = f"gradient norm {norm:.4g} > {self.factor:g} x median {median:.4g}"
        if reason is None:
            self.history.append(float(ctx.grad_norm))
            self.accepted += 1
            self.consecutive_vetoes = 0
            ctx.metrics["guard/vetoed"] = 0.0
            return True
        self.total_vetoes += 1
        self._batch_vetoes += 1
        ctx.metrics["guard/vetoed"] = 1.0
        if self._tripped is None:
            self.consecutive_vetoes += 1
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
            "train/grad_norm, train/entropy and the log-prob metrics, then resume from the "
            "checkpoint with a lower lr, a larger LLDS coef, or a higher guard factor."
        )
        self._log(trainer, "guard/stopped", 1.0)
        rank_zero_warn(self.message)

    def _log(self, trainer: pl.Trainer, key: str, value: float) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({key: value}, step=trainer.global_step)

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
            "restores": self.restores,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = deque(state_dict["history"], maxlen=self.window)
        self.accepted = int(state_dict["accepted"])
        self.consecutive_vetoes = int(state_dict["consecutive_vetoes"])
        self.total_vetoes = int(state_dict["total_vetoes"])
        self.restores = int(state_dict["restores"])
