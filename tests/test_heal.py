"""Heal on a real tiny model and GRPOModule: a forced alarm rolls weights, optimiser, scheduler, RNG
and detector state back exactly to the chosen snapshot (compared with copies an independent
recorder took at each step start), applies each remedy, stops at its cap, keeps the remedies across
a checkpoint resume, and keeps snapshots on disk beyond its memory budget.

Rollouts are hand-made (tests/test_guard.py's make_rollout); the alarm is the real CollapseAlarm,
forced by a callback that writes answered_rate = 0 into the step's metrics before the alarm reads
them."""
from __future__ import annotations

import copy
import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lldslight.science.alarm import AlarmConfig
from lldslight.callbacks import LLDS, CollapseAlarm, GradientSpikeGuard, Heal, LLDMonitor
from lldslight.science.diagnostics import PhaseConfig
from lldslight.errors import ConfigError
from lldslight.module import GRPOModule
from lldslight.update.optim import OptimConfig
from lldslight.policy import load_policy
from lldslight.update import UpdateConfig
from test_guard import make_rollout, same_state, small_config

# One signal, a 4-step baseline at answered_rate 1.0 (sd floored to 0.05): a step at 0 is z = 20,
# C = 19.5 > h, so the alarm fires on that very step with onset = that step.
RULE = AlarmConfig(signals=["answered_rate"], baseline_start=0, baseline_end=4, baseline_min=2, votes=1, consecutive=1, h=1.0)
LR, WARMUP = 1e-2, 20


class Feed(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.rollout_batch = make_rollout()


class Force(pl.Callback):
    """Writes answered_rate = 0 into the metrics of the steps in ``at`` (after LLDMonitor, before the alarm)."""

    def __init__(self, at: set[int]) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step - 1 in self.at:
            pl_module.last_step_metrics["train/answered_rate"] = 0.0


class Record(pl.Callback):
    """First in the list: at each step start, copies of the state (independent of Heal's own), and
    as a step gate, each update's rate."""

    def __init__(self) -> None:
        self.start: dict[int, dict] = {}
        self.lrs: dict[int, list[float]] = {}

    def setup(self, trainer, pl_module, stage) -> None:
        self.module = pl_module
        pl_module.add_step_gate("record", self.gate)

    def gate(self, ctx) -> bool:
        lr = ctx.module.optimizers(use_pl_optimizer=False).param_groups[0]["lr"]
        self.lrs.setdefault(ctx.module.global_step, []).append(float(lr))
        return True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, LLDMonitor))
        self.start[trainer.global_step] = {
            "params": [p.detach().clone() for p in pl_module.trainable_parameters()],
            "adam": copy.deepcopy(optimizer.state_dict()["state"]),
            "rng": torch.get_rng_state(),  # the module put back the step's starting RNG just before
            "last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "detector": copy.deepcopy(monitor.detector.state_dict()),
        }


@pytest.fixture(scope="module")
def policies():
    return {"lora": load_policy(small_config())}


def run(policy, tmp_path: Path, heal: Heal, steps: int, force: set[int], ckpt: str | None = None, kl_coef: float = 0.0, llds: bool = True,
        module_kwargs: dict | None = None, guard: GradientSpikeGuard | None = None, extra: tuple = ()):
    torch.manual_seed(0)
    config = policy[2] if len(policy) > 2 else small_config()
    module = GRPOModule(policy=config, optim=OptimConfig(lr=LR, warmup_steps=WARMUP),
                        update=UpdateConfig(updates_per_rollout=2, micro_batch_size=2, kl_coef=kl_coef), **(module_kwargs or {}))
    module.policy, module.tokenizer = copy.deepcopy(policy[0]), policy[1]
    record = Record()
    alarm = CollapseAlarm(rule=RULE)
    guard = guard if guard is not None else GradientSpikeGuard(factor=10.0, window=8, warmup=2)
    callbacks = [record, Feed(), *extra] + ([LLDS(coef=0.2)] if llds else []) + [
        LLDMonitor(plot=False, phases=PhaseConfig(window=3, patience=1)), Force(force), alarm, guard, heal]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=pl.loggers.CSVLogger(tmp_path, name="run"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        log_every_n_steps=1, default_root_dir=tmp_path, callbacks=callbacks,
    )
    # weights_only=False: these hand-built modules keep a PolicyConfig object in their hyperparameters.
    trainer.fit(module, train_dataloaders=DataLoader(list(range(64)), batch_size=1, collate_fn=lambda b: b), ckpt_path=ckpt,
                weights_only=False if ckpt else None)
    return trainer, module, record, alarm, guard


def rows(trainer) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(Path(trainer.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            out.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    return out


def test_a_forced_alarm_rolls_back_exactly_applies_every_remedy_and_stops_at_the_cap(policies, tmp_path):
    heal = Heal(every=2, depth=10, margin=2, max_heals=1, lr_factor=0.5, end_warmup=True, llds_coef_factor=2.0,
                updates_factor=0.5, kl_coef=0.05)
    trainer, module, rec, alarm, guard = run(policies["lora"], tmp_path / "a", heal, steps=11, force={6, 9})
    assert alarm.fired_steps == [6, 9]
    # Heal at the end of step 6: onset 6 - margin 2 -> the snapshot taken at step 4 (every 2 steps).
    assert len(heal.heals) == 1 and heal.heals[0]["rolled_back_to"] == 4 and heal.heals[0]["step"] == 6
    s = rec.start
    # Step 7 starts exactly where step 4 started: weights, Adam moments and counts, RNG, detector.
    assert same_state({"params": s[7]["params"], "adam": s[7]["adam"]}, {"params": s[4]["params"], "adam": s[4]["adam"]})
    assert torch.equal(s[7]["rng"], s[4]["rng"]) and s[7]["detector"] == s[4]["detector"] and s[7]["last_epoch"] == 4
    # ... which the steps in between had changed (the comparison can fail).
    assert not same_state({"params": s[6]["params"], "adam": s[6]["adam"]}, {"params": s[4]["params"], "adam": s[4]["adam"]})
    assert not torch.equal(s[6]["rng"], s[4]["rng"]) and s[6]["detector"] != s[4]["detector"]
    # Remedies: the rate step 6 ended with (LR x 8/20, the warm-up's next value) halved and held;
    # LLDS coef x 2; 2 -> 1 update per rollout batch; a KL anchor (LoRA: the adapter-off base).
    assert rec.lrs[6] == [pytest.approx(LR * 7 / WARMUP)] * 2
    for step in (7, 8, 9, 10):
        assert rec.lrs[step] == [pytest.approx(0.5 * LR * 8 / WARMUP)], step
    llds = next(cb for cb in trainer.callbacks if isinstance(cb, LLDS))
    assert llds.coef == pytest.approx(0.4) and module.hparams["update"].updates_per_rollout == 1 and module.hparams["update"].kl_coef == 0.05
    assert module.reference is None  # LoRA: the reference is the base model with the adapter off
    logged = rows(trainer)
    assert "train/kl" in logged[7] and "train/kl" not in logged[6]  # the module computed reference log-probs
    assert logged[6]["heal/count"] == 1 and logged[6]["heal/rolled_back_to"] == 4 and logged[6]["heal/onset"] == 6
    assert logged[6]["heal/lr"] == pytest.approx(0.5 * LR * 8 / WARMUP) and logged[6]["heal/updates_per_rollout"] == 1
    assert logged[6]["heal/llds_coef"] == pytest.approx(0.4) and logged[6]["heal/kl_coef"] == pytest.approx(0.05)
    # The cap: the second alarm (step 9) is logged as skipped and changes nothing.
    assert logged[9]["heal/skipped"] == 1 and logged[9]["heal/count"] == 1
    assert not same_state({"params": s[10]["params"], "adam": s[10]["adam"]}, {"params": s[4]["params"], "adam": s[4]["adam"]})
    # The guard's window restarted at the heal: it holds only the 4 updates of steps 7-10.
    assert len(guard.history) == 4
    # The ring lost the snapshot of the abandoned step 6 and went on (8 and 10 were taken after).
    assert [snap.step for snap in heal.ring] == [0, 2, 4, 8, 10]

    # Resume from a checkpoint with fresh callbacks configured as before the heal: the remedies come back.
    path = tmp_path / "after_heal.ckpt"
    trainer.save_checkpoint(path)
    heal2 = Heal(every=2, depth=10, margin=2, max_heals=1, lr_factor=0.5, end_warmup=True, llds_coef_factor=2.0,
                 updates_factor=0.5, kl_coef=0.05)
    trainer2, module2, rec2, alarm2, _ = run(policies["lora"], tmp_path / "b", heal2, steps=14, force={12}, ckpt=str(path))
    llds2 = next(cb for cb in trainer2.callbacks if isinstance(cb, LLDS))
    assert llds2.coef == pytest.approx(0.4) and module2.hparams["update"].updates_per_rollout == 1 and module2.hparams["update"].kl_coef == 0.05
    # Without the held rate the restored warm-up lambda would give LR_healed x 12/20 at step 11.
    for step in (11, 12, 13):
        assert rec2.lrs[step] == [pytest.approx(0.5 * LR * 8 / WARMUP)], step
    assert len(heal2.heals) == 1 and alarm2.fired_steps == [6, 9, 12]
    assert rows(trainer2)[12]["heal/skipped"] == 1  # the cap survived the resume too


def test_full_fine_tuning_anchor_schedule_rollback_and_disk_snapshots(tmp_path):
    from lldslight.policy import PolicyConfig

    full = PolicyConfig(model="smollm2-135m-instruct", precision="fp32", random_init=dict(small_config().random_init), lora=None,
                        gradient_checkpointing=False)
    policy = (*load_policy(full), full)
    # No lr remedy: the schedule goes back with the snapshot. Disk only (budget 0), 3 kept.
    heal = Heal(every=2, depth=3, margin=2, max_heals=2, memory_budget_mb=0, disk_dir=str(tmp_path / "snaps"), lr_factor=None,
                end_warmup=False, kl_coef=0.05)
    trainer, module, rec, alarm, _ = run(policy, tmp_path / "a", heal, steps=9, force={6}, llds=False)
    s = rec.start
    assert heal.heals[0]["rolled_back_to"] == 4
    assert same_state({"params": s[7]["params"], "adam": s[7]["adam"]}, {"params": s[4]["params"], "adam": s[4]["adam"]})
    # The scheduler went back too: step 7 runs at the warm-up value of step 4.
    assert rec.lrs[7] == [pytest.approx(LR * 5 / WARMUP)] * 2 and rec.lrs[8] == [pytest.approx(LR * 6 / WARMUP)] * 2
    # The anchor is a frozen copy of the rolled-back weights, and stays so while training goes on.
    assert module.reference is not None and not any(p.requires_grad for p in module.reference.parameters())
    ref = list(module.reference.parameters())
    assert len(ref) == len(s[4]["params"]) and all(torch.equal(a, b) for a, b in zip(ref, s[4]["params"]))
    assert not all(torch.equal(a, b) for a, b in zip(module.trainable_parameters(), s[4]["params"]))
    assert "train/kl" in rows(trainer)[7]
    # On disk: only the ring's files remain (step 6's was dropped by the rollback, older ones by depth).
    files = sorted(p.name for p in (tmp_path / "snaps").iterdir())
    assert files == sorted(f"snapshot-step{snap.step}-rank0.pt" for snap in heal.ring) and all(snap.data is None for snap in heal.ring)
    assert [snap.step for snap in heal.ring] == [2, 4, 8] and heal.snapshot_bytes >= 3 * sum(p.numel() * 4 for p in s[4]["params"])

    # A resumed run without kl_coef in its config gets the anchor back (the same weights).
    path = tmp_path / "healed.ckpt"
    trainer.save_checkpoint(path)
    heal2 = Heal(every=2, depth=3, margin=2, max_heals=2, memory_budget_mb=0, disk_dir=str(tmp_path / "snaps2"), lr_factor=None,
                 end_warmup=False, kl_coef=0.05)
    trainer2, module2, _, _, _ = run(policy, tmp_path / "b", heal2, steps=10, force=set(), ckpt=str(path), llds=False)
    assert module2.hparams["update"].kl_coef == 0.05 and module2.reference is not None
    assert all(torch.equal(a, b) for a, b in zip(module2.reference.parameters(), s[4]["params"]))
    assert "train/kl" in rows(trainer2)[9]


def test_a_guard_that_gives_up_hands_the_run_to_heal(policies, tmp_path):
    from test_guard import Faults

    # Updates 12 and 13 (both of step 6) have NaN gradients: 2 vetoes in a row trip the guard, which
    # asks Heal to go back before step 6 (minus the margin): the snapshot of step 4.
    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=2, max_consecutive_vetoes=2, on_give_up="heal")
    heal = Heal(every=2, depth=10, margin=2, max_heals=1, lr_factor=0.5)
    nan = float("nan")
    trainer, module, rec, alarm, _ = run(policies["lora"], tmp_path, heal, steps=9, force=set(), guard=guard,
                                         extra=(Faults({12: nan, 13: nan}),))
    assert alarm.fired_steps == [] and len(heal.heals) == 1
    assert heal.heals[0]["rolled_back_to"] == 4 and heal.heals[0]["reason"].startswith("GradientSpikeGuard gave up")
    s = rec.start
    assert same_state({"params": s[7]["params"], "adam": s[7]["adam"]}, {"params": s[4]["params"], "adam": s[4]["adam"]})
    assert rec.lrs[7] == [pytest.approx(0.5 * LR * 8 / WARMUP)] * 2 and trainer.global_step == 9
    assert guard.stop_checkpoint is None and "Heal callback rolled the run back" in guard.message


def test_heal_config_errors():
    with pytest.raises(ConfigError, match="Heal.every"):
        Heal(every=0)
    with pytest.raises(ConfigError, match="Heal.updates_factor"):
        Heal(updates_factor=2.0)
    with pytest.raises(ConfigError, match="Heal.lr_factor"):
        Heal(lr_factor=0.0)
    heal = Heal()
    trainer = type("T", (), {"callbacks": [heal]})()
    with pytest.raises(ConfigError, match="trigger"):
        heal.setup(trainer, None, "fit")
    trainer.callbacks = [CollapseAlarm(rule=AlarmConfig(signals=["answered_rate"], votes=1)), Heal(llds_coef_factor=2.0)]
    with pytest.raises(ConfigError, match="LLDS"):
        trainer.callbacks[1].setup(trainer, None, "fit")
