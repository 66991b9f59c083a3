"""Drift of a rollout batch's updates: the drift/* metrics, the update's early stop (target_kl) and
whether a batch's drift carries signal (lldslight/update/train.py; the rate controller that reads them:
tests/test_rate_controller.py).

Every expected value is computed here a second way: the KLs from probabilities (not log-prob
differences) in plain Python over the tokens of each mini-batch, with the weights each update saw
recorded as it ran; the early stop against a replay without the bound; the signal flag from the
batch's rewards and the updates that ran, decided by hand per case.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from lldslight.update import train as U
from lldslight.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
V = 6  # the toy policy's vocabulary


def test_drift_shares_by_hand():
    # two rows, three positions; row 0's last position is not a model token
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.2, -0.5, -9.0], [-0.1, -2.0, -1.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    d = [0.2, 0.0, -0.1, -1.0, 0.5]  # log r on the 5 model tokens, by hand
    n = 10.0  # the mini-batch's token total (these rows are half of it)
    out = {k: float(v) for k, v in U.drift_shares(logp, old, mask, n).items()}
    assert out["drift/kl_k1"] == pytest.approx(sum(-x for x in d) / n)
    assert out["drift/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / n)
    assert out["drift/log_ratio_m2"] == pytest.approx(sum(x * x for x in d) / n)
    assert out["drift/ratio_m2"] == pytest.approx(sum(math.exp(2 * x) for x in d) / n)


class ToyLearner:
    """A context-free policy over V tokens, log pi(t) = log_softmax(theta)[t]: the update's
    Learner protocol with nothing else in the way. Its step gate records the weights each update's
    forward used (the gate runs after that forward, before the step)."""

    def __init__(self, cfg: U.UpdateConfig) -> None:
        g = torch.Generator().manual_seed(0)
        self.theta = torch.nn.Parameter(torch.randn(V, generator=g, dtype=torch.float64))
        self.cfg, self.vetoed_updates, self.seen = cfg, 0, []

    update_config = property(lambda self: self.cfg)
    loss_terms = property(lambda self: {})
    step_gates = property(lambda self: {"record": self._record})
    device = property(lambda self: torch.device("cpu"))
    global_step = property(lambda self: 0)

    def _record(self, ctx) -> bool:
        self.seen.append(self.theta.detach().clone())
        return True

    def logprobs(self, traj, reference=False, with_entropy=False):
        lp = torch.log_softmax(self.theta, -1)  # [V]
        logp = lp[traj.input_ids] * traj.loss_mask  # [b, T]
        entropy = -(lp.exp() * lp).sum() * traj.loss_mask.double()
        return logp, entropy

    def trainable_parameters(self):
        return [self.theta]

    def with_frozen_prefix(self, traj, micro):
        return traj  # no layers: nothing to reuse

    def manual_backward(self, loss):
        loss.backward()

    def gradient_sync(self, enabled):
        return contextlib.nullcontext()


def toy_trajectory() -> Trajectory:
    """8 rows of 5 tokens (the first is the prompt), 4 groups of 2 with one right and one wrong row."""
    g = torch.Generator().manual_seed(3)
    B, T = 8, 5
    ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    loss_mask[:, 0] = False
    return Trajectory(
        input_ids=ids, attention_mask=torch.ones(B, T, dtype=torch.long), prompt_len=torch.ones(B, dtype=torch.long),
        loss_mask=loss_mask, action_id=torch.where(loss_mask, 0, -1), answer_mask=torch.zeros(B, T, dtype=torch.bool),
        group_id=torch.arange(B) // 2, reward=torch.tensor([1.0, 0.0] * 4, dtype=torch.float64),
        num_searches=torch.zeros(B, dtype=torch.long), num_invalid=torch.zeros(B, dtype=torch.long),
        num_actions=torch.ones(B, dtype=torch.long), finish_reason=["answer"] * B, data_source=["t"] * B, responses=[""] * B,
    )


def train(cfg: U.UpdateConfig) -> tuple[ToyLearner, U.RolloutUpdates]:
    module = ToyLearner(cfg)
    optimizer = torch.optim.SGD([module.theta], lr=2.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return module, U.train_on_rollout(module, toy_trajectory(), optimizer, scheduler)


def k3_by_hand(theta_old: torch.Tensor, theta_new: torch.Tensor, rows: list[int]) -> float:
    """Mean over the rows' model tokens of r - 1 - log r, r = p_new / p_old, from probabilities."""
    traj = toy_trajectory()
    p_old, p_new = torch.softmax(theta_old, -1).tolist(), torch.softmax(theta_new, -1).tolist()
    terms = []
    for b in rows:
        for t in range(1, traj.input_ids.shape[1]):
            r = p_new[int(traj.input_ids[b, t])] / p_old[int(traj.input_ids[b, t])]
            terms.append(r - 1 - math.log(r))
    return sum(terms) / len(terms)


BASE = dict(updates_per_rollout=4, micro_batch_size=1, shuffle_minibatches=False, kl_coef=0.0, grad_clip=0.0, clip_eps=10.0)


def test_drift_per_update_matches_an_independent_computation():
    module, result = train(U.UpdateConfig(**BASE))
    theta0 = module.seen[0]
    measured = result.summed["drift/kl_k3"]  # per update, this (only) rank's share = the mini-batch mean
    assert len(measured) == len(module.seen) == 4
    expected = [k3_by_hand(theta0, module.seen[u], [2 * u, 2 * u + 1]) for u in range(4)]
    assert measured[0] == 0.0  # the on-policy mini-batch: its own log-probs are the old ones
    assert expected[1] > 1e-4, "the updates should move the policy: the comparison would be vacuous"
    assert measured == pytest.approx(expected, rel=1e-9, abs=1e-15)
    metrics, summed = result.step_metrics()
    assert metrics["drift/kl_k3"] == pytest.approx(sum(expected) / 4)
    assert metrics["drift/kl_k3_last"] == pytest.approx(expected[-1])
    assert {"drift/kl_k3", "drift/kl_k3_last", "drift/kl_k1", "drift/log_ratio_m2", "drift/ratio_m2", "drift/clip_frac"} <= summed
    assert (metrics["drift/updates"], metrics["drift/stopped"]) == (4.0, 0.0)


def test_target_kl_stops_the_rollout_batch_before_the_update_that_passes_it():
    free, free_result = train(U.UpdateConfig(**BASE))
    kls = free_result.summed["drift/kl_k3"]
    assert max(kls[1:3]) < kls[3], kls  # the sequence this test is worked out on
    target = (max(kls[1:3]) + kls[3]) / 2 / 1.5  # 1.5 x target: above updates 1 and 2's KL, below update 3's
    bound, result = train(U.UpdateConfig(**BASE, target_kl=target))
    metrics, _ = result.step_metrics()
    assert (metrics["drift/updates"], metrics["drift/stopped"]) == (3.0, 1.0)
    assert result.summed["drift/kl_k3"] == pytest.approx(kls, rel=1e-12)  # update 3 measured, then stopped
    assert len(result.shared["grad_norm"]) == 3  # only the applied updates stepped
    # The weights are those after exactly three updates of the unbounded run (update 3 not applied).
    assert torch.equal(bound.theta.detach(), free.seen[3])
    # A bound no update reaches changes nothing; the on-policy update is never stopped.
    _, loose = train(U.UpdateConfig(**BASE, target_kl=10 * max(kls)))
    assert loose.step_metrics()[0]["drift/updates"] == 4.0
    _, tight = train(U.UpdateConfig(**BASE, target_kl=1e-12))
    assert tight.step_metrics()[0]["drift/updates"] == 1.0


@pytest.mark.parametrize("bad", [{"target_kl": 0.0}, {"target_kl": -1.0}, {"target_kl": float("nan")}, {"target_kl_factor": 0.5}])
def test_a_bad_drift_bound_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="model.update.target_kl"):
        U.UpdateConfig(**bad)


def toy_trajectory_with(reward: list[float]) -> Trajectory:
    import dataclasses
    return dataclasses.replace(toy_trajectory(), reward=torch.tensor(reward, dtype=torch.float64))


def signal_of(cfg: U.UpdateConfig, reward=None, gate=None) -> tuple[float, dict]:
    module = ToyLearner(cfg)
    if gate is not None:
        module._record = gate
    optimizer = torch.optim.SGD([module.theta], lr=2.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    traj = toy_trajectory() if reward is None else toy_trajectory_with(reward)
    metrics, _ = U.train_on_rollout(module, traj, optimizer, scheduler).step_metrics()
    return metrics["drift/signal"], metrics


def test_drift_signal_by_case():
    # mixed groups, 4 updates: update 0 stepped with a gradient before the last KL was measured
    assert signal_of(U.UpdateConfig(**BASE))[0] == 1.0
    # every group tied (all right): advantages 0, no gradient; the last KL measures nothing
    tied, metrics = signal_of(U.UpdateConfig(**BASE), reward=[1.0] * 8)
    assert tied == 0.0 and metrics["train/grad_norm_max"] == 0.0
    # one group mixed is enough
    assert signal_of(U.UpdateConfig(**BASE), reward=[1.0, 0.0] + [1.0] * 6)[0] == 1.0
    # one update per rollout batch: its KL is measured before its (only) step
    # (reuse_onpolicy_logp off: the toy's float64 log-probs would not fit the float32 buffer it fills)
    assert signal_of(U.UpdateConfig(**{**BASE, "updates_per_rollout": 1, "reuse_onpolicy_logp": False}))[0] == 0.0
    # stopped at update 1 by the bound: update 0 stepped before that KL, so it measures update 0
    stopped, metrics = signal_of(U.UpdateConfig(**BASE, target_kl=1e-12))
    assert (stopped, metrics["drift/updates"], metrics["drift/stopped"]) == (1.0, 1.0, 1.0)
    # every update vetoed: nothing stepped
    assert signal_of(U.UpdateConfig(**BASE), gate=lambda ctx: False)[0] == 0.0
    # only the last update let through: the last KL was measured before it
    assert signal_of(U.UpdateConfig(**BASE), gate=lambda ctx: ctx.update_index == 3)[0] == 0.0
    # update 2 let through: it stepped before update 3's KL
    assert signal_of(U.UpdateConfig(**BASE), gate=lambda ctx: ctx.update_index == 2)[0] == 1.0


def test_drift_has_signal_by_hand():
    shared = {"grad_norm": [0.5, 0.0, 0.3], "vetoed": [1.0, 0.0, 0.0]}
    # measured 3 (no stop): updates 0 and 1 came before the last; 0 was vetoed, 1 had no gradient
    assert not U.drift_has_signal(4.0, 3, shared)
    # measured 4 (update 3 stopped by the bound): update 2 stepped with a gradient before it
    assert U.drift_has_signal(4.0, 4, shared)
    assert not U.drift_has_signal(0.0, 4, shared)  # no row with an advantage
    assert not U.drift_has_signal(4.0, 4, {"grad_norm": [float("nan"), float("inf"), 0.0], "vetoed": [0.0, 0.0, 0.0]})
