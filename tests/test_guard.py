"""GradientSpikeGuard and the module's non-finite handling, on a real tiny model and GRPOModule.

Rollouts are hand-made Trajectory batches (generation is not under test here and is the slow
part); everything from log-probs to the optimiser step is the real code. Faults are injected with
gradient hooks on the trainable parameters (a NaN or x100 gradient at chosen updates) and by
writing NaN into log-probs, never by replacing the guard.
"""
from __future__ import annotations

import copy
import dataclasses
import csv
import math
import statistics
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lldslight.callbacks import GradientSpikeGuard
from lldslight.module import GRPOModule
from lldslight.policy import LoRAConfig, PolicyConfig, load_policy
from lldslight.trajectory import Trajectory
from lldslight.update import UpdateConfig
from lldslight.update.optim import OptimConfig

# Smaller than conftest's tiny policy (1 layer, width 32): these tests run a dozen updates each,
# and the 49k-token output projection dominates their cost.
SMALL = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}


def small_config() -> PolicyConfig:
    return PolicyConfig(model="smollm2-135m-instruct", precision="fp32", random_init=dict(SMALL),
                        lora=LoRAConfig(r=4, alpha=8), gradient_checkpointing=False)


@pytest.fixture(scope="module")
def small_policy():
    return load_policy(small_config())


def make_rollout(seed: int = 0) -> Trajectory:
    """Four rollouts in two groups with rewards (1, 0): every mini-batch has a real gradient.

    Layout per row: 6 prompt tokens, a 6-token action, a 4-token observation, a 5-token final action
    whose last 2 tokens are the answer, then padding that differs per row.
    """
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 24
    ids = torch.randint(10, 1000, (B, T), generator=g)
    lengths = [21, 20, 21, 19]
    attn = torch.zeros(B, T, dtype=torch.long)
    action = torch.full((B, T), -1)
    answer = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
        action[b, 6:12] = 0
        action[b, 16:n] = 1
        answer[b, n - 2 : n] = True
    return Trajectory(
        input_ids=ids, attention_mask=attn, prompt_len=torch.full((B,), 6), loss_mask=action >= 0,
        action_id=action, answer_mask=answer, group_id=torch.tensor([0, 0, 1, 1]),
        reward=torch.tensor([1.0, 0.0, 0.0, 1.0]), num_searches=torch.ones(B, dtype=torch.long),
        num_invalid=torch.zeros(B, dtype=torch.long), num_actions=torch.full((B,), 2),
        finish_reason=["answer"] * B, data_source=["t"] * B, responses=[""] * B,
    )


class FeedRollouts(pl.Callback):
    """Hands the module a fresh copy of the same rollout batch every step (SearchRollout's job)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.rollout_batch = make_rollout()


class Faults(pl.Callback):
    """Multiplies the gradient of every trainable parameter by ``plan[update]`` (NaN, 100, ...),
    where update counts optimiser updates over the run: step * updates_per_rollout + update_index."""

    def __init__(self, plan: dict[int, float]) -> None:
        self.plan = plan
        self.factor = 1.0
        self.hooked = False

    def setup(self, trainer, pl_module, stage) -> None:
        self.module = pl_module
        # A loss term runs before each micro-batch's backward: the moment to choose the factor.
        pl_module.add_loss_term("faults", self.arm)

    def arm(self, ctx) -> torch.Tensor:
        if not self.hooked:
            for p in self.module.trainable_parameters():
                p.register_hook(lambda grad: grad * self.factor)
            self.hooked = True
        update = self.module.global_step * self.module.update_config.updates_per_rollout + ctx.update_index
        self.factor = self.plan.get(update, 1.0)
        return ctx.logp.new_zeros(())


class Recorder(pl.Callback):
    """A step gate after the guard: copies parameters and Adam state as they are before each step
    (= after the previous update) and whether the update was vetoed. Never vetoes itself."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.add_step_gate("recorder", self.record)

    def record(self, ctx) -> bool:
        module = ctx.module
        optimizer = module.optimizers(use_pl_optimizer=False)
        self.records.append({
            "vetoed": ctx.vetoed,
            "grad_norm": float(ctx.grad_norm),
            "params": [p.detach().clone() for p in module.trainable_parameters()],
            "adam": copy.deepcopy(optimizer.state_dict()["state"]),
        })
        return True


def same_state(a: dict, b: dict) -> bool:
    if not all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])):
        return False
    if a["adam"].keys() != b["adam"].keys():
        return False
    return all(
        torch.equal(a["adam"][k][name], b["adam"][k][name]) for k in a["adam"] for name in a["adam"][k]
    )


def fit(small_policy, tmp_path: Path, guard: GradientSpikeGuard, plan: dict[int, float], max_steps: int,
        module_cls: type = GRPOModule) -> tuple[pl.Trainer, GRPOModule, Recorder]:
    torch.manual_seed(0)
    module = module_cls(policy=small_config(), optim=OptimConfig(lr=1e-2),
                        update=UpdateConfig(updates_per_rollout=2, micro_batch_size=2, kl_coef=0.0,
                                            shuffle_minibatches=False))
    # A fresh copy of the module-scoped policy (configure_model keeps a policy it already has).
    module.policy, module.tokenizer = copy.deepcopy(small_policy[0]), small_policy[1]
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=pl.loggers.CSVLogger(tmp_path, name="run"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, log_every_n_steps=1, default_root_dir=tmp_path,
        callbacks=[FeedRollouts(), Faults(plan), guard, recorder],
    )
    loader = DataLoader(list(range(64)), batch_size=1, collate_fn=lambda b: b)
    trainer.fit(module, train_dataloaders=loader)
    return trainer, module, recorder


def test_nan_and_spike_are_vetoed_bit_identically_then_k_vetoes_stop(small_policy, tmp_path):
    nan = float("nan")
    # Updates 0-2 warm the guard up; 3 is NaN, 5 is x100; 7, 8, 9 are NaN: the third in a row
    # trips the guard (K=3) in step 4, which then ends with a checkpoint and a stop.
    plan = {3: nan, 5: 100.0, 7: nan, 8: nan, 9: nan}
    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=3, max_consecutive_vetoes=3, checkpoint_dir=str(tmp_path / "ckpt"))
    trainer, module, rec = fit(small_policy, tmp_path, guard, plan, max_steps=8)
    r = rec.records
    vetoed = [i for i, x in enumerate(r) if x["vetoed"]]
    assert vetoed == [3, 5, 7, 8, 9]
    assert not math.isfinite(r[3]["grad_norm"])
    assert r[5]["grad_norm"] > 10 * max(r[i]["grad_norm"] for i in (2, 4, 6))
    # A vetoed update changes neither weights nor Adam state (moments and step count), bit for bit;
    # the accepted updates around them do change both, so the comparison can fail.
    for i in (3, 5):
        assert same_state(r[i], r[i + 1]), f"vetoed update {i} changed the state"
        assert not same_state(r[i - 1], r[i]) and not same_state(r[i + 1], r[i + 2])
    # Training went on between the faults, then stopped early with a checkpoint and a message.
    assert trainer.global_step == 5 < 8
    assert guard.stop_checkpoint is not None and Path(guard.stop_checkpoint).is_file()
    assert "3 consecutive vetoed updates" in guard.message and guard.stop_checkpoint in guard.message
    assert module.vetoed_updates == 5
    # The rolling window is checkpoint state: the saved copy resumes the same median.
    saved = torch.load(guard.stop_checkpoint, map_location="cpu", weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("GradientSpikeGuard"))
    resumed = GradientSpikeGuard(factor=10.0, window=8, warmup=3)
    resumed.load_state_dict(state)
    assert list(resumed.history) == list(guard.history) and len(guard.history) == 5
    assert resumed.median() == guard.median() and resumed.accepted == guard.accepted == 5
    # The metrics went through the logger.
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert any(row.get("guard/stopped") == "1.0" for row in rows)
    by_step = {int(row["step"]): row for row in rows if row.get("guard/vetoed")}
    assert float(by_step[1]["guard/vetoed"]) == 0.5 and float(by_step[0]["guard/vetoed"]) == 0.0
    assert float(by_step[2]["guard/median"]) > 0


def test_clip_mode_rescales_the_spike_to_the_median(small_policy, tmp_path):
    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=3, on_spike="clip")
    trainer, module, rec = fit(small_policy, tmp_path, guard, {4: 100.0}, max_steps=3)
    r = rec.records
    assert not any(x["vetoed"] for x in r)
    median = sorted(x["grad_norm"] for x in r[:4])[1:3]  # the window's median after 4 updates
    assert r[4]["grad_norm"] == pytest.approx(sum(median) / 2, rel=1e-5)  # the recorder sees the clipped norm
    assert not same_state(r[4], r[5])  # the clipped update went through


def test_restore_goes_back_to_the_last_clean_rollout_batch(small_policy, tmp_path):
    nan = float("nan")
    # Step 1: update 2 accepted, 3 NaN; step 2: update 4 NaN -> 2 in a row (K=2), update 5 vetoed.
    # At the end of step 2 the guard restores the state saved at the end of step 0 (the last batch
    # with no veto), undoing update 2, and training continues.
    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=2, max_consecutive_vetoes=2, on_give_up="restore")
    trainer, module, rec = fit(small_policy, tmp_path, guard, {3: nan, 4: nan}, max_steps=4)
    r = rec.records
    assert [i for i, x in enumerate(r) if x["vetoed"]] == [3, 4, 5]
    assert guard.restores == 1 and "restored" in guard.message
    assert not same_state(r[2], r[3])  # update 2 did change the state ...
    assert same_state(r[2], r[6])  # ... and the restore undid it, bit for bit
    assert not same_state(r[6], r[7])  # training continued
    assert trainer.global_step == 4


class NaNLogprobs(GRPOModule):
    """Writes NaN into chosen tokens' log-probs: training log-probs of rollout row 0 (group 0,
    reward 1) and old log-probs of rollout row 1 (group 0, reward 0)."""

    def __init__(self, update: UpdateConfig, **kwargs):
        # Old log-probs must all come from the no-grad pass before the updates, where the NaNs go.
        super().__init__(update=dataclasses.replace(update, reuse_onpolicy_logp=False), **kwargs)

    def logprobs(self, traj, reference=False, with_entropy=False):
        logp, entropy = super().logprobs(traj, reference=reference, with_entropy=with_entropy)
        poison = torch.zeros_like(logp)
        if with_entropy:  # a training pass
            poison[(traj.group_id == 0) & (traj.reward == 1), 7:9] = float("nan")
        elif not reference:  # the old log-probs
            row = (traj.group_id == 0) & (traj.reward == 0)
            poison[row, 17] = float("nan")
            poison[row, 10] = float("-inf")
        return logp + poison, entropy


def test_nonfinite_logprobs_are_dropped_and_counted(small_policy, tmp_path):
    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=2)
    trainer, module, rec = fit(small_policy, tmp_path, guard, {}, max_steps=2, module_cls=NaNLogprobs)
    r = rec.records
    assert not any(x["vetoed"] for x in r) and all(math.isfinite(x["grad_norm"]) and x["grad_norm"] > 0 for x in r)
    assert not same_state(r[0], r[1]) and not same_state(r[2], r[3])
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    step = next(row for row in rows if row.get("train/nonfinite_tokens"))
    # Per step: rows 0 and 1 are in update 0 (no shuffling); 2 NaN logp + 2 non-finite old_logp.
    assert float(step["train/nonfinite_tokens"]) == 4
    assert math.isfinite(float(step["train/pg_loss"])) and float(step["train/vetoed_updates"]) == 0


def test_guard_options_are_checked():
    with pytest.raises(ValueError, match="on_spike"):
        GradientSpikeGuard(on_spike="skip")
    with pytest.raises(ValueError, match="factor"):
        GradientSpikeGuard(factor=0.5)


# -- issue 20: empty updates and like-with-like medians ------------------------------------------------


class _Ctx:
    """The parts of update.StepContext the gate reads, for feeding it a hand-made norm sequence."""

    def __init__(self, norm: float) -> None:
        self.grad_norm = torch.tensor(norm)
        self.metrics: dict[str, float] = {}
        self.vetoed = False
        self.update_index = 0
        self.module = type("M", (), {"global_step": 0})()


def test_zero_norm_updates_never_enter_the_median():
    # LAB_NOTES §6: 20 ordinary updates, then a collapsing run's tied mini-batches (norm 0) outnumber
    # them in the window. Before the fix the median became 0 and the next real update (2.2) was
    # vetoed as "2.2 > 10 x median 0".
    guard = GradientSpikeGuard(factor=10.0, window=20, warmup=5)
    norms = [1.0 + 0.05 * i for i in range(20)] + [0.0] * 15 + [2.2]
    decisions = [guard.gate(_Ctx(n)) for n in norms]
    assert all(decisions), [i for i, d in enumerate(decisions) if not d]
    assert 0.0 not in guard.history and len(guard.history) == 20 and guard.empty_updates == 15
    assert guard.median() == pytest.approx(statistics.median([1.0 + 0.05 * i for i in range(1, 20)] + [2.2]))
    # A KL-only trickle of a tied mini-batch (1e-4 of the median) is empty too; a real spike still is one.
    assert guard.gate(_Ctx(1e-4)) and guard.empty_updates == 16 and 1e-4 not in guard.history
    assert not guard.gate(_Ctx(40.0))


def test_tied_rollout_batches_do_not_make_the_guard_veto_real_updates(small_policy, tmp_path):
    # Steps 0-1 have mixed groups; steps 2-5 tie every group (all updates have norm exactly 0, the
    # window of 8 would hold only zeros); step 6 is mixed again. None of its updates may be vetoed.
    tied = {2, 3, 4, 5}

    class Schedule(FeedRollouts):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            traj = make_rollout()
            if trainer.global_step in tied:
                traj.reward = torch.ones_like(traj.reward)
            pl_module.rollout_batch = traj

    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=2)
    torch.manual_seed(0)
    module = GRPOModule(policy=small_config(), update=UpdateConfig(updates_per_rollout=2, micro_batch_size=2, kl_coef=0.0, shuffle_minibatches=False), optim=OptimConfig(lr=1e-2))
    module.policy, module.tokenizer = copy.deepcopy(small_policy[0]), small_policy[1]
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=7, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[Schedule(), guard, recorder],
    )
    trainer.fit(module, train_dataloaders=DataLoader(list(range(64)), batch_size=1, collate_fn=lambda b: b))
    r = recorder.records
    assert [x["grad_norm"] for x in r[4:12]] == [0.0] * 8  # the tied steps really had no gradient
    assert all(x["grad_norm"] > 0 for x in r[:4] + r[12:])
    assert not any(x["vetoed"] for x in r), [i for i, x in enumerate(r) if x["vetoed"]]
    assert list(guard.history) == [x["grad_norm"] for x in r[:4] + r[12:]] and guard.empty_updates == 8


def test_clipped_spike_stays_out_of_the_window(small_policy, tmp_path):
    # Like with like: the window holds the measured norms of single ordinary updates. A clipped spike
    # entered it as the median itself before the fix.
    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=3, on_spike="clip")
    trainer, module, rec = fit(small_policy, tmp_path, guard, {4: 100.0}, max_steps=3)
    r = rec.records
    assert r[4]["grad_norm"] < r[5]["grad_norm"] * 10  # the recorder saw the clipped norm
    assert list(guard.history) == [r[i]["grad_norm"] for i in (0, 1, 2, 3, 5)]
    assert guard.accepted == 5


def test_reset_window_restarts_the_warm_up():
    guard = GradientSpikeGuard(factor=10.0, window=8, warmup=2)
    for n in (1.0, 1.1, 1.2):
        guard.gate(_Ctx(n))
    assert guard.median() == pytest.approx(1.1)
    guard.reset_window()
    assert guard.median() is None and not guard.history and guard.consecutive_vetoes == 0
    assert guard.gate(_Ctx(50.0))  # no judgement during the new warm-up


def test_guard_give_up_heal_needs_a_heal_callback():
    from lldslight.errors import ConfigError

    guard = GradientSpikeGuard(on_give_up="heal")
    trainer = type("T", (), {"callbacks": [guard]})()
    module = type("M", (), {"add_step_gate": lambda self, name, fn: None})()
    with pytest.raises(ConfigError, match="Heal"):
        guard.setup(trainer, module, "fit")
    with pytest.raises(ConfigError, match="empty_below"):
        GradientSpikeGuard(empty_below=0.5)
