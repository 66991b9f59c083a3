"""Heal: a run that rolls itself back and changes course when the collapse alarm fires.

Every ``every`` steps Heal takes a snapshot of what the run's future depends on: the trainable
weights, the optimiser state, the scheduler state, the RNG streams (torch, numpy, python, CUDA:
the ones the module restores at each step start), the LLDMonitor phase detector's state and the
CollapseAlarm rule's state. The newest ``depth`` snapshots are kept, in memory while they fit in
``memory_budget_mb`` and on disk beyond it (``disk_dir``).

When CollapseAlarm fires (or GradientSpikeGuard gives up with ``on_give_up: heal``), Heal, at the
end of that step:

1. picks the newest snapshot taken at or before ``onset - margin``, where ``onset`` is the alarm's
   change-point estimate (the step after the crossed signals' CUSUM statistics last stood at 0),
   or the oldest one kept when none is that old, and puts its state back;
2. drops the snapshots newer than it (they belong to the abandoned path), resets the guard's
   window and restarts the alarm's statistics (its baselines stay);
3. applies the remedies configured, each relative to the values in force at the alarm:
   ``lr_factor`` (with ``end_warmup``: the rate the optimiser was about to use times the factor,
   held constant from then on; both ``param_groups[*]["lr"]`` and the scheduler's ``base_lrs``
   are set, and the warm-up lambda is replaced by a constant), ``llds_coef_factor`` (the LLDS
   callback's coef), ``updates_factor`` (``model.update.updates_per_rollout``, at least 1), ``kl_coef``
   (a KL anchor: ``model.update.kl_coef`` raised to it; under full fine-tuning without a reference yet,
   the reference becomes a frozen copy of the rolled-back weights; under LoRA it stays the base
   model with the adapter off), in any combination;
4. logs ``heal/*`` in the step's row and prints one line. At most ``max_heals`` heals; later alarms
   are logged (``heal/skipped``) and change nothing.

What is *not* rolled back: the trainer's clock (global_step, the logger's steps, max_steps and
max_time keep counting: a heal costs the steps it undoes), and the data stream (the sampler keeps
going forward, so the rolled-back model sees the next prompts rather than the same ones again:
rewinding Lightning's live data iterator mid-epoch has no public hook; the data position is in
every checkpoint as before).

Remedies survive resumes: the values applied are part of Heal's checkpoint state and are put back
at ``on_train_start`` (after Lightning restored the optimiser and scheduler; idempotent), whatever
the resumed command line says for those keys. The snapshot ring itself is not checkpointed: after
a resume it starts again (a snapshot is taken at the first step).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lldslight.run.checkpoint_io import capture_rng, restore_rng
from lldslight.errors import ConfigError, require
from lldslight.run.events import log_event
from lldslight.update.optim import scheduler_of, set_learning_rate


def _held(step: int) -> float:
    """The scheduler multiplier after a heal ended the warm-up: the healed rate, held. A plain
    function, so LambdaLR leaves it out of its state_dict (Heal puts it back on resume)."""
    return 1.0


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors inside a nested dict/list/tuple structure."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@dataclass
class Snapshot:
    """One entry of the ring: the run's state after ``step`` steps, in memory or in a file.

    Args:
        step: trainer.global_step when it was taken (steps completed; the next step run was ``step``).
        nbytes: the bytes of its tensors.
        data: the state, when in memory.
        path: the file holding it, when on disk.
    """

    step: int
    nbytes: int
    data: Optional[dict[str, Any]] = None
    path: Optional[Path] = None

    def load(self) -> dict[str, Any]:
        if self.data is not None:
            return self.data
        return torch.load(self.path, map_location="cpu", weights_only=False)

    def discard(self) -> None:
        self.data = None
        if self.path is not None and self.path.exists():
            self.path.unlink()


class Heal(pl.Callback):
    """Rolls the run back to a snapshot from before the alarm's change point and changes its dynamics.

    Args:
        every: take a snapshot every this many steps (and at the first step of a fit).
        depth: snapshots kept (the oldest is dropped); ``every x depth`` steps is how far back a
            heal can go.
        margin: roll back to the newest snapshot at or before ``onset - margin`` steps.
        max_heals: heals allowed in a run (later alarms change nothing; resumes keep the count).
        memory_budget_mb: snapshots are kept in memory while their total stays under this; the
            rest go to ``disk_dir``.
        disk_dir: where snapshots beyond the memory budget go (default: the run directory's
            ``heal_snapshots``). Files are deleted when their snapshot leaves the ring.
        lr_factor: multiply the learning rate by this at a heal (null = leave the rate alone).
        end_warmup: hold the rate constant from the heal on (the warm-up, or whatever remains of
            the schedule, ends).
        llds_coef_factor: multiply the LLDS callback's coef by this (null = leave it; needs LLDS).
        updates_factor: multiply ``model.update.updates_per_rollout`` by this, rounded, at least 1 (null = leave).
        kl_coef: raise ``model.update.kl_coef`` to this KL anchor (null = leave).
        print_heals: print one line per heal (and per skipped heal).
    """

    def __init__(
        self,
        every: int = 10,
        depth: int = 20,
        margin: int = 10,
        max_heals: int = 2,
        memory_budget_mb: float = 1024.0,
        disk_dir: Optional[str] = None,
        lr_factor: Optional[float] = 0.5,
        end_warmup: bool = True,
        llds_coef_factor: Optional[float] = None,
        updates_factor: Optional[float] = None,
        kl_coef: Optional[float] = None,
        print_heals: bool = True,
    ) -> None:
        require(every >= 1, "Heal.every", ">= 1", every)
        require(depth >= 1, "Heal.depth", ">= 1", depth)
        require(margin >= 0, "Heal.margin", ">= 0", margin)
        require(max_heals >= 0, "Heal.max_heals", ">= 0", max_heals)
        require(memory_budget_mb >= 0, "Heal.memory_budget_mb", ">= 0", memory_budget_mb)
        require(lr_factor is None or 0 < lr_factor, "Heal.lr_factor", "> 0 or null", lr_factor)
        require(llds_coef_factor is None or llds_coef_factor >= 0, "Heal.llds_coef_factor", ">= 0 or null", llds_coef_factor)
        require(updates_factor is None or 0 < updates_factor <= 1, "Heal.updates_factor", "in (0, 1] or null (fewer updates)", updates_factor)
        require(kl_coef is None or kl_coef > 0, "Heal.kl_coef", "> 0 or null", kl_coef)
        self.every = every
        self.depth = depth
        self.margin = margin
        self.max_heals = max_heals
        self.memory_budget_mb = memory_budget_mb
        self.disk_dir = disk_dir
        self.lr_factor = lr_factor
        self.end_warmup = end_warmup
        self.llds_coef_factor = llds_coef_factor
        self.updates_factor = updates_factor
        self.kl_coef = kl_coef
        self.print_heals = print_heals
        # Checkpointed (state_dict): what was healed, and the remedies in force.
        self.heals: list[dict[str, Any]] = []
        self.applied: dict[str, Any] = {}
        self.anchor: Optional[dict[str, torch.Tensor]] = None  # the KL reference Heal made (full fine-tuning)
        # Per process.
        self.ring: list[Snapshot] = []
        self.snapshot_bytes: Optional[int] = None  # the size of the last snapshot taken
        self._reapply = False
        self._alarm = self._monitor = self._guard = self._llds = None

    # -- wiring -------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lldslight.callbacks.alarm import CollapseAlarm
        from lldslight.callbacks.guard import GradientSpikeGuard
        from lldslight.callbacks.llds import LLDS
        from lldslight.callbacks.monitor import LLDMonitor

        def find(cls):
            found = [cb for cb in trainer.callbacks if isinstance(cb, cls)]
            return found[0] if found else None

        self._alarm, self._monitor, self._guard, self._llds = find(CollapseAlarm), find(LLDMonitor), find(GradientSpikeGuard), find(LLDS)
        guard_heals = self._guard is not None and self._guard.on_give_up == "heal"
        if self._alarm is None and not guard_heals:
            raise ConfigError(
                "Heal needs a trigger: add lldslight.callbacks.CollapseAlarm to trainer.callbacks (configs/heal.yaml), "
                "or a GradientSpikeGuard with on_give_up: heal"
            )
        if self.llds_coef_factor is not None and self._llds is None:
            raise ConfigError("Heal.llds_coef_factor is set but trainer.callbacks has no lldslight.callbacks.LLDS (configs/llds.yaml)")
        from lldslight.callbacks.drift import AdaptiveRate

        if (self.lr_factor is not None or self.end_warmup) and any(isinstance(cb, AdaptiveRate) for cb in trainer.callbacks):
            # Both set the base rate: the controller would scale from a rate a heal replaced, or undo its cut.
            raise ConfigError(f"Heal's rate remedy (lr_factor {self.lr_factor}, end_warmup {self.end_warmup}) with AdaptiveRate "
                              "(configs/stable.yaml): both set the base rate, so they are not to be combined; give Heal "
                              "lr_factor: null and end_warmup: false to keep its other remedies (docs/stability.md)")
        if self._alarm is not None:
            self._alarm.add_listener(self._on_alarm)

    # -- snapshots ----------------------------------------------------------------------------------------

    def capture(self, trainer: pl.Trainer, pl_module) -> dict[str, Any]:
        """The run's state now (between two steps), as a detached copy."""
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        scheduler = scheduler_of(trainer)
        rng = pl_module.rng_after_step
        state: dict[str, Any] = {
            "params": [p.detach().clone() for p in pl_module.trainable_parameters()],
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            # The next step starts from the module's saved RNG state (GRPOModule.on_after_batch_transfer).
            "rng": copy.deepcopy(rng) if rng is not None else capture_rng(),
        }
        if self._monitor is not None:
            state["monitor"] = copy.deepcopy(self._monitor.detector.state_dict())
        if self._alarm is not None:
            state["alarm"] = self._alarm.rule_state()
        return state

    def _directory(self, trainer: pl.Trainer) -> Path:
        if self.disk_dir is not None:
            return Path(self.disk_dir)
        return Path(trainer.log_dir or trainer.default_root_dir) / "heal_snapshots"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Nothing has changed the weights, optimiser, detectors or saved RNG since the last step
        # ended: a snapshot here holds step ``global_step``'s starting state whatever the callback order.
        step = trainer.global_step
        if self.ring and (step % self.every or self.ring[-1].step == step):
            return
        data = self.capture(trainer, pl_module)
        nbytes = tensor_bytes(data)
        first = self.snapshot_bytes is None
        self.snapshot_bytes = nbytes
        in_memory = sum(s.nbytes for s in self.ring if s.data is not None)
        snap = Snapshot(step=step, nbytes=nbytes)
        if in_memory + nbytes <= self.memory_budget_mb * 2**20:
            snap.data = data
        else:
            directory = self._directory(trainer)
            directory.mkdir(parents=True, exist_ok=True)
            snap.path = directory / f"snapshot-step{step}-rank{trainer.global_rank}.pt"
            torch.save(data, snap.path)
        self.ring.append(snap)
        while len(self.ring) > self.depth:
            self.ring.pop(0).discard()
        if first and self.print_heals:
            rank_zero_info(f"[lldslight] Heal: snapshots of {nbytes / 2**20:.2f} MiB every {self.every} steps, {self.depth} kept")

    # -- healing ---------------------------------------------------------------------------------------------

    def _on_alarm(self, event, trainer: pl.Trainer, pl_module) -> None:
        self.heal_now(trainer, pl_module, step=event.step, onset=event.onset, reason=f"collapse alarm: {event.reason}")

    def heal_now(self, trainer: pl.Trainer, pl_module, step: int, onset: int, reason: str) -> bool:
        """Roll back to the newest snapshot at or before ``onset - margin`` and apply the remedies.
        Called at the end of training step ``step``. Returns whether it healed."""
        if len(self.heals) >= self.max_heals or not self.ring:
            why = f"cap of {self.max_heals} heal(s) reached" if self.ring else "no snapshot yet"
            log_event(trainer, {"heal/skipped": 1.0, "heal/count": float(len(self.heals))}, step)
            if self.print_heals and trainer.is_global_zero:
                print(f"[lldslight] HEAL skipped at step {step}: {why} ({reason})", flush=True)
            return False
        target = onset - self.margin
        older = [s for s in self.ring if s.step <= target]
        snap = older[-1] if older else self.ring[0]
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        scheduler = scheduler_of(trainer)
        before = self._settings(trainer, pl_module, optimizer)

        data = snap.load()
        with torch.no_grad():
            for p, saved in zip(pl_module.trainable_parameters(), data["params"]):
                p.copy_(saved)
        optimizer.load_state_dict(copy.deepcopy(data["optimizer"]))
        if scheduler is not None and data["scheduler"] is not None:
            scheduler.load_state_dict(copy.deepcopy(data["scheduler"]))  # keeps the lambdas in force (a held rate stays held)
        pl_module.rng_after_step = copy.deepcopy(data["rng"])
        restore_rng(data["rng"])
        if self._monitor is not None and "monitor" in data:
            self._monitor.detector.load_state_dict(copy.deepcopy(data["monitor"]))
        if self._alarm is not None and "alarm" in data:
            self._alarm.load_rule_state(copy.deepcopy(data["alarm"]))
            self._alarm.reset_statistics(step)  # onsets after the heal cannot predate it
        if self._guard is not None:
            self._guard.reset_window()
        for dropped in [s for s in self.ring if s.step > snap.step]:
            dropped.discard()
        self.ring = [s for s in self.ring if s.step <= snap.step]

        self._remedy(trainer, pl_module, optimizer, scheduler, before)
        after = self._settings(trainer, pl_module, optimizer)
        record = {"step": step, "onset": onset, "rolled_back_to": snap.step, "reason": reason, "before": before, "after": after}
        self.heals.append(record)
        nan = float("nan")
        log_event(trainer, {
            "heal/count": float(len(self.heals)),
            "heal/skipped": 0.0,
            "heal/rolled_back_to": float(snap.step),
            "heal/onset": float(onset),
            "heal/lr": after["lr"],
            "heal/llds_coef": after["llds_coef"] if after["llds_coef"] is not None else nan,
            "heal/updates_per_rollout": float(after["updates_per_rollout"]),
            "heal/kl_coef": after["kl_coef"],
            "heal/snapshot_mb": snap.nbytes / 2**20,
        }, step)
        if self.print_heals and trainer.is_global_zero:
            print(f"[lldslight] HEAL {len(self.heals)}/{self.max_heals} at step {step}: rolled back to the snapshot of step "
                  f"{snap.step} (onset {onset} - margin {self.margin}); {self._describe(before, after)}; {reason}", flush=True)
        return True

    def _settings(self, trainer: pl.Trainer, pl_module, optimizer) -> dict[str, Any]:
        """The values the remedies act on, as they are now."""
        scheduler = scheduler_of(trainer)
        return {
            "lr": float(optimizer.param_groups[0]["lr"]),
            "param_lrs": [float(g["lr"]) for g in optimizer.param_groups],
            "base_lrs": [float(b) for b in scheduler.base_lrs] if scheduler is not None else None,
            "llds_coef": float(self._llds.coef) if self._llds is not None else None,
            "updates_per_rollout": int(pl_module.update_config.updates_per_rollout),
            "kl_coef": float(pl_module.update_config.kl_coef),
        }

    def _describe(self, before: dict, after: dict) -> str:
        parts = [f"lr {before['lr']:.3g} -> {after['lr']:.3g}" + (" (held)" if self.applied.get("held") else "")]
        if after["llds_coef"] is not None:
            parts.append(f"LLDS coef {before['llds_coef']:g} -> {after['llds_coef']:g}")
        parts.append(f"updates/rollout {before['updates_per_rollout']} -> {after['updates_per_rollout']}")
        parts.append(f"KL coef {before['kl_coef']:g} -> {after['kl_coef']:g}")
        return ", ".join(parts)

    def _remedy(self, trainer, pl_module, optimizer, scheduler, before: dict[str, Any]) -> None:
        """Change the dynamics, relative to ``before`` (the values in force at the alarm), and
        record the absolute values in ``applied`` (re-applied on resume)."""
        applied = self.applied
        if self.lr_factor is not None or self.end_warmup:
            factor = self.lr_factor if self.lr_factor is not None else 1.0
            if self.end_warmup:
                # The rate the optimiser was about to use, times the factor, from now on.
                applied["base_lrs"] = [lr * factor for lr in before["param_lrs"]]
                applied["held"] = True
            else:
                # The schedule goes on from the snapshot's point, scaled.
                applied["base_lrs"] = [b * factor for b in (before["base_lrs"] or before["param_lrs"])]
                applied["held"] = bool(applied.get("held", False))
        if self.llds_coef_factor is not None:
            applied["llds_coef"] = float(before["llds_coef"]) * self.llds_coef_factor
        if self.updates_factor is not None:
            applied["updates_per_rollout"] = max(1, int(round(before["updates_per_rollout"] * self.updates_factor)))
        if self.kl_coef is not None:
            applied["kl_coef"] = max(float(before["kl_coef"]), self.kl_coef)
        self.apply(trainer, pl_module, create_anchor=True)

    def apply(self, trainer: pl.Trainer, pl_module, create_anchor: bool = False) -> None:
        """Put the remedies in ``applied`` in force (idempotent): after a heal, and on resume."""
        applied = self.applied
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        scheduler = scheduler_of(trainer)
        if "base_lrs" in applied:
            if scheduler is not None and applied.get("held") and hasattr(scheduler, "lr_lambdas"):
                scheduler.lr_lambdas = [_held] * len(scheduler.lr_lambdas)
            set_learning_rate(optimizer, scheduler, list(applied["base_lrs"]))
        if "llds_coef" in applied and self._llds is not None:
            self._llds.coef = float(applied["llds_coef"])
        if "updates_per_rollout" in applied:
            pl_module.reconfigure_update(updates_per_rollout=int(applied["updates_per_rollout"]))
        if "kl_coef" in applied:
            pl_module.reconfigure_update(kl_coef=float(applied["kl_coef"]))
            self._anchor(pl_module, create=create_anchor)

    def _anchor(self, pl_module, create: bool) -> None:
        from lldslight.policy.load import has_adapter

        if has_adapter(pl_module.policy):
            return  # the reference is the base model with the adapter off
        if pl_module.reference is None and (create or self.anchor is not None):
            # No reference yet (kl_coef was 0 under full fine-tuning): anchor to the rolled-back weights.
            pl_module.reference = copy.deepcopy(pl_module.policy).eval()
            pl_module.reference.requires_grad_(False)
            if self.anchor is None:
                self.anchor = {k: v.detach().clone() for k, v in pl_module.reference.state_dict().items()}
        if self.anchor is not None and pl_module.reference is not None:
            pl_module.reference.load_state_dict(self.anchor)

    # -- resume -------------------------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        # After Lightning restored the optimiser and scheduler (which hold a healed rate already,
        # but not the held lambda) and whatever the resumed command line set for the other keys.
        if not self._reapply:
            return
        self._reapply = False
        self.apply(trainer, pl_module)
        if self.applied and trainer.is_global_zero:
            shown = {k: v for k, v in self.applied.items()}
            print(f"[lldslight] Heal: {len(self.heals)} heal(s) in the checkpoint; remedies in force again: {shown}", flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"heals": copy.deepcopy(self.heals), "applied": copy.deepcopy(self.applied), "anchor": self.anchor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.heals = list(state_dict.get("heals", []))
        self.applied = dict(state_dict.get("applied", {}))
        self.anchor = state_dict.get("anchor")
        self._reapply = True
