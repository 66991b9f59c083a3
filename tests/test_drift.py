"""Drift of a rollout batch's updates: the drift/* metrics, the update's early stop (target_kl) and
AdaptiveRate (lldslight/update.py, lldslight/callbacks/drift.py).

Every expected value is computed here a second way: the KLs from probabilities (not log-prob
differences) in plain Python over the tokens of each mini-batch, with the weights each update saw
recorded as it ran; the early stop against a replay without the bound; the rate rule by hand (the rate setter itself: tests/test_config_groups.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lldslight import update as U
from lldslight.callbacks.drift import AdaptiveRate
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


def test_adaptive_rate_rule_by_hand():
    cb = AdaptiveRate(target_kl=0.01, factor=1.5, lr_min=1e-5, lr_max=2e-3)
    base = 1e-3
    scale = 1.0
    # KL 0.03 > 2 x 0.01: down; 0.01: inside [0.005, 0.02], kept; 0.001 < 0.005: up; nan: down
    for kl, want in ((0.03, 1 / 1.5), (0.01, 1 / 1.5), (0.001, 1.0), (0.001, 1.5), (0.001, 2.0), (float("nan"), 2.0 / 1.5)):
        scale = cb.next_scale(kl, scale, base)
        assert scale == pytest.approx(want)  # 2.0 is lr_max / base: 1.5 x 1.5 = 2.25 clamped
    low = scale
    for _ in range(40):
        low = cb.next_scale(1.0, low, base)
    assert low == pytest.approx(1e-5 / base)  # floored at lr_min


ADAPTIVE = """    - class_path: lldslight.callbacks.AdaptiveRate
      init_args: {target_kl: 1.0e-4, factor: 2.0, lr_min: 1.0e-5, lr_max: 4.0e-3}
"""


@pytest.mark.slow
def test_adaptive_rate_is_logged_and_resumes_exactly(tmp_path):
    """A tiny fit with AdaptiveRate killed at step 2 and resumed logs the same rates, scales and
    drift as the run never interrupted (the scheduler's scaled base_lrs ride in the checkpoint)."""
    from run_helpers import KILL
    from test_resume import KILL_AT, STEPS, fit, metrics

    args = ("--model.update.updates_per_rollout", "2", "--model.update.micro_batch_size", "1")
    full = fit(tmp_path, "full", tmp_path / "full", extra=ADAPTIVE, args=args)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = fit(tmp_path, "killed", tmp_path / "run", extra=ADAPTIVE + KILL.format(step=KILL_AT), args=args)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = fit(tmp_path, "resumed", tmp_path / "run", extra=ADAPTIVE, args=args + ("--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = metrics(tmp_path / "full" / "tiny" / "version_0" / "metrics.csv")
    got = {**metrics(tmp_path / "run" / "tiny" / "version_0" / "metrics.csv"),
           **metrics(tmp_path / "run" / "tiny" / "version_1" / "metrics.csv")}
    assert sorted(got) == sorted(want) == list(range(STEPS))
    scales = [want[s]["drift/lr_scale"] for s in range(STEPS)]
    assert len(set(scales)) > 1, f"the scale never moved: the comparison would be vacuous ({scales})"
    for step in range(STEPS):
        for key in ("train/lr", "drift/lr_scale", "drift/kl_k3", "drift/kl_k3_last", "drift/updates"):
            assert want[step][key] == got[step][key], (step, key, want[step][key], got[step][key])
