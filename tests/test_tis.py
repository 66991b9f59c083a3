"""Truncated importance sampling (model.update.tis_cap; objectives.truncated_importance_weight),
the correction for a sampler whose log-probs are not the trainer's (vLLM), on a hand-worked batch.

Two rows, on-policy (logp = old_logp: ratio 1, so each token's PPO loss is -A), advantages +1 and
-0.5, token-mean over 5 model tokens. The sampler's log-probs are set so that pi_old / q is, per
token, 1.5 and 3 (row 0; the third position is padding) and 0.5, 1 and 2 (row 1). With cap 2 the
weights are 1.5, 2 | 0.5, 1, 2, so the token losses are -1.5, -2 | 0.25, 0.5, 1.0:

    loss = (-1.5 - 2 + 0.25 + 0.5 + 1.0) / 5 = -0.35      (without TIS: (-1 - 1 + 0.5 * 3) / 5 = -0.1)

and the gradient with respect to each token's log-prob is the token loss / 5: -0.3, -0.4 | 0.05, 0.1, 0.2.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lldslight.errors import ConfigError
from lldslight.update.train import Totals, micro_batch_loss
from lldslight.update import UpdateConfig

OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -3.0]], dtype=torch.float64)
RAW_WEIGHT = torch.tensor([[1.5, 3.0, 1.0], [0.5, 1.0, 2.0]], dtype=torch.float64)  # pi_old / q per token
MASK = torch.tensor([[True, True, False], [True, True, True]])


def _loss(tis_cap):
    cfg = UpdateConfig(kl_coef=0.0, aggregation="token-mean", tis_cap=tis_cap)
    module = SimpleNamespace(update_config=cfg, loss_terms={})
    sample = (OLD - RAW_WEIGHT.log()).masked_fill(~MASK, 0.0)
    sub = SimpleNamespace(loss_mask=MASK, old_logp=OLD, ref_logp=None, advantage=torch.tensor([1.0, -0.5], dtype=torch.float64),
                          pg_weight=None, sample_logp=sample, action_id=None, answer_mask=None, num_searches=None)
    logp = OLD.clone().requires_grad_(True)
    loss, _ = micro_batch_loss(module, sub, logp, torch.zeros_like(OLD), Totals(tokens=5.0, rows=2.0, preserving_tokens=2.0), 0.0, 0)
    loss.backward()
    return float(loss), logp.grad


def test_tis_weights_the_policy_gradient_as_worked_by_hand():
    loss, grad = _loss(2.0)
    assert math.isclose(loss, -0.35, abs_tol=1e-12)
    assert torch.allclose(grad, torch.tensor([[-0.3, -0.4, 0.0], [0.05, 0.1, 0.2]], dtype=torch.float64), atol=1e-12), grad
    off, grad_off = _loss(None)
    assert math.isclose(off, -0.1, abs_tol=1e-12)
    assert torch.allclose(grad_off, torch.tensor([[-0.2, -0.2, 0.0], [0.1, 0.1, 0.1]], dtype=torch.float64), atol=1e-12)


def test_a_cap_below_one_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^model\.update\.tis_cap must be >= 1 .*got 0\.5$"):
        UpdateConfig(tis_cap=0.5)
