"""The GRPO formulas on hand-computed tensors (docs/algorithm.md §2)."""
import math

import pytest
import torch

from lldslight.update import objectives as obj


def test_group_advantages_unbiased_std_and_equal_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 9])
    adv = obj.group_advantages(rewards, groups)
    # group 7: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = torch.tensor([(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), 0, 0, 0, 0])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_group_advantages_without_std_normalisation():
    adv = obj.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), normalize_std=False)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_clipped_surrogate_picks_pessimistic_branch():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros(1, 3)
    loss, ratio, clipped = obj.clipped_surrogate(logp, old, torch.tensor([1.0]), eps_low=0.2)
    # A>0: min(r A, clip(r) A) -> 1.2 for r=1.5 (clipped), 0.5 for r=0.5, 1.1 for r=1.1
    assert torch.allclose(loss, -torch.tensor([[1.2, 0.5, 1.1]]), atol=1e-6)
    assert clipped.tolist() == [[True, False, False]]
    loss_neg, _, clipped_neg = obj.clipped_surrogate(logp, old, torch.tensor([-1.0]), eps_low=0.2, eps_high=0.3)
    # A<0: min(-r, -clip(r)) -> -1.5 (unclipped), -0.8 (clipped at 1-0.2), -1.1
    assert torch.allclose(loss_neg, torch.tensor([[1.5, 0.8, 1.1]]), atol=1e-6)
    assert clipped_neg.tolist() == [[False, True, False]]
    assert torch.allclose(ratio, torch.tensor([[1.5, 0.5, 1.1]]))


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [10.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert obj.aggregate(loss, mask, "token-mean", 4).item() == pytest.approx((1 + 2 + 3 + 10) / 4)
    # per sequence: 2.0 and 10.0; the empty third row does not count
    assert obj.aggregate(loss, mask, "seq-mean-token-mean", 2).item() == pytest.approx(6.0)
    # The normaliser is the mini-batch's: these rows as half of a mini-batch of 8 tokens / 4 rows.
    assert obj.aggregate(loss, mask, "token-mean", 8).item() == pytest.approx(16 / 8)
    assert obj.aggregate(loss, mask, "seq-mean-token-mean", 4).item() == pytest.approx(12 / 4)
    with pytest.raises(ValueError, match="aggregation"):
        obj.aggregate(loss, mask, "sum", 1)


def test_ratio_clamp_caps_the_ratio_before_the_clip():
    """The official LLDS code caps gamma at 100: A < 0 with gamma = e^6 ~ 403 costs 100|A|, not
    403|A|, and the capped token gets no gradient."""
    logp = torch.tensor([[6.0, 0.1]], requires_grad=True)
    old = torch.zeros(1, 2)
    loss, ratio, _ = obj.clipped_surrogate(logp, old, torch.tensor([-2.0]), ratio_clamp=100.0)
    assert loss.tolist()[0] == pytest.approx([200.0, 2 * math.exp(0.1)], rel=1e-6)
    assert ratio[0, 0].item() == pytest.approx(math.exp(6.0))  # the ratio itself is reported uncapped
    loss.sum().backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(2 * math.exp(0.1), rel=1e-6)
    free, _, _ = obj.clipped_surrogate(logp.detach(), old, torch.tensor([-2.0]))
    assert free[0, 0].item() == pytest.approx(2 * math.exp(6.0), rel=1e-6)


def test_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(obj.kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    d = ref - logp
    assert torch.allclose(obj.kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    far = obj.kl_penalty(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3")
    assert far.item() == 10.0  # clamped


def test_masked_mean_empty_is_zero():
    assert obj.masked_mean(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)).item() == 0.0
