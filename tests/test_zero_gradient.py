"""model.update.zero_gradient (lldslight/update/train.py ``step``): an update whose gradient is exactly
zero does not step under ``skip``; under ``step`` (the default, as TRL and veRL) AdamW moves the
policy along its momentum. Checked on the toy policy of tests/test_drift.py: 4 groups of 2, one
group per mini-batch, groups 0-1 mixed (a gradient) and groups 2-3 tied (none), against AdamW's
update written out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from lldslight.errors import ConfigError
from lldslight.update import train as U
from tests.test_drift import ToyLearner, toy_trajectory_with

BASE = dict(updates_per_rollout=4, micro_batch_size=1, shuffle_minibatches=False, kl_coef=0.0, grad_clip=0.0, clip_eps=10.0)
REWARD = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # groups 0-1 mixed, 2 all right, 3 all wrong
LR, BETAS, EPS, WD = 0.05, (0.9, 0.999), 1e-8, 0.1


def run(mode: str):
    module = ToyLearner(U.UpdateConfig(**BASE, zero_gradient=mode))
    optimizer = torch.optim.AdamW([module.theta], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    result = U.train_on_rollout(module, toy_trajectory_with(REWARD), optimizer, scheduler)
    return module, optimizer, result


def adamw_zero_gradient_steps(theta: torch.Tensor, state: dict, n: int) -> torch.Tensor:
    """AdamW (Loshchilov & Hutter; torch.optim.AdamW's defaults) for ``n`` steps with gradient 0,
    written out: decay the weights, decay both moments, step on the bias-corrected ratio."""
    theta, m, v, t = theta.clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), int(state["step"])
    for _ in range(n):
        t += 1
        theta = theta * (1 - LR * WD)
        m, v = BETAS[0] * m, BETAS[1] * v
        m_hat, v_hat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
        theta = theta - LR * m_hat / (v_hat.sqrt() + EPS)
    return theta


def test_skip_leaves_weights_and_adams_state_where_the_last_gradient_left_them():
    stepped, stepped_opt, stepped_result = run("step")
    skipped, skipped_opt, skipped_result = run("skip")
    # the two updates with a gradient are the same in both modes (the weights each update's forward saw)
    assert all(torch.equal(a, b) for a, b in zip(stepped.seen[:3], skipped.seen[:3]))
    assert stepped_result.shared["grad_norm"][2:] == skipped_result.shared["grad_norm"][2:] == [0.0, 0.0]
    assert min(stepped_result.shared["grad_norm"][:2]) > 0
    # skip: the weights after update 1 are the final ones, and Adam has counted two steps, not four
    after_1 = skipped.seen[2]
    assert torch.equal(skipped.theta.detach(), after_1) and torch.equal(skipped.seen[3], after_1)
    state = skipped_opt.state[skipped.theta]
    assert int(state["step"]) == 2
    # step: the policy moved on momentum alone, exactly as two AdamW steps with gradient 0 from that state
    assert int(stepped_opt.state[stepped.theta]["step"]) == 4
    by_hand = adamw_zero_gradient_steps(after_1, state, 2)
    moved = float((stepped.theta.detach() - after_1).abs().max())
    assert moved > 1e-3, "momentum should move the toy policy: the comparison would be vacuous"
    assert torch.allclose(stepped.theta.detach(), by_hand, rtol=0, atol=1e-12)
    # what each logs
    skipped_metrics, _ = skipped_result.step_metrics()
    stepped_metrics, _ = stepped_result.step_metrics()
    assert skipped_metrics["train/skipped_updates"] == 2.0 and skipped_metrics["train/vetoed_updates"] == 0.0
    assert "train/skipped_updates" not in stepped_metrics
    assert skipped_result.shared["skipped"] == [0.0, 0.0, 1.0, 1.0]


def test_skip_changes_nothing_when_every_update_has_a_gradient():
    mixed = [1.0, 0.0] * 4
    outcomes = []
    for mode in ("step", "skip"):
        module = ToyLearner(U.UpdateConfig(**BASE, zero_gradient=mode))
        optimizer = torch.optim.AdamW([module.theta], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        result = U.train_on_rollout(module, toy_trajectory_with(mixed), optimizer, scheduler)
        outcomes.append((module.theta.detach().clone(), result.step_metrics()[0]))
    (theta_step, _), (theta_skip, metrics_skip) = outcomes
    assert torch.equal(theta_step, theta_skip) and metrics_skip["train/skipped_updates"] == 0.0


def test_a_tied_batch_under_skip_has_no_signal_and_does_not_move():
    module = ToyLearner(U.UpdateConfig(**BASE, zero_gradient="skip"))
    theta0 = module.theta.detach().clone()
    optimizer = torch.optim.AdamW([module.theta], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics, _ = U.train_on_rollout(module, toy_trajectory_with([1.0] * 8), optimizer, scheduler).step_metrics()
    assert torch.equal(module.theta.detach(), theta0) and optimizer.state[module.theta] == {}
    assert (metrics["train/skipped_updates"], metrics["drift/signal"], metrics["drift/kl_k3_last"]) == (4.0, 0.0, 0.0)


def test_an_unknown_zero_gradient_choice_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"model\.update\.zero_gradient must be one of \('step', 'skip'\), got 'hold'"):
        U.UpdateConfig(zero_gradient="hold")


def test_the_preset_skips():
    import yaml

    from tests.conftest import ROOT

    preset = yaml.safe_load((ROOT / "configs" / "stable.yaml").read_text())
    assert preset["model"]["update"]["zero_gradient"] == "skip"
    assert U.UpdateConfig().zero_gradient == "step" and math.isfinite(preset["model"]["update"]["target_kl"])
