"""The collapse lab's controls on hand-worked cases: shared-prefix negatives, positive-only GRPO,
mini-batches that keep a prompt's rollouts together."""
from __future__ import annotations

import torch

from lldslight.update import objectives as obj
from lldslight.update.train import minibatch_order


def _rows(*rows: list[int], width: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    att = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
    return ids, att


def test_shared_prefix_negatives_by_hand():
    # prompt = positions 0-1 (tokens 9 9); group 0: row 0 correct, rows 1-2 wrong; group 1: row 3
    # wrong, row 4 wrong (no correct row: nothing masked).
    ids, att = _rows([9, 9, 5, 6, 7], [9, 9, 5, 6, 8, 8], [9, 9, 4, 6, 7], [9, 9, 5, 6], [9, 9, 5, 6])
    loss_mask = att.bool().clone()
    loss_mask[:, :2] = False
    group = torch.tensor([0, 0, 0, 1, 1])
    adv = torch.tensor([1.0, -0.5, -0.5, -0.1, 0.0])
    out = obj.shared_prefix_negatives(ids, att, loss_mask, group, adv)
    expected = torch.zeros_like(out)
    expected[1, 2:4] = True  # row 1 shares 5 6 with row 0 after the prompt, then differs (8 vs 7)
    # row 2 differs at its first model token (4 vs 5): nothing shared; the 7 at position 4 comes
    # after the prefix broke, so it is not masked although it equals row 0's token there.
    assert torch.equal(out, expected)


def test_shared_prefix_takes_the_longest_over_correct_rows():
    ids, att = _rows([1, 5, 6, 7], [1, 5, 3, 3], [1, 5, 6, 2], width=4)
    loss_mask = att.bool().clone()
    loss_mask[:, 0] = False
    out = obj.shared_prefix_negatives(ids, att, loss_mask, torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, -1.0]))
    assert out[2].tolist() == [False, True, True, False]  # 5 6 shared with row 0 (row 1 shares only 5)


def test_policy_gradient_weight_modes():
    adv = torch.tensor([1.0, -1.0, 0.0])
    mask = torch.ones(3, 2, dtype=torch.bool)
    assert obj.policy_gradient_weight(adv, mask, "keep") is None
    assert obj.policy_gradient_weight(adv, mask, "drop").tolist() == [[1, 1], [0, 0], [1, 1]]
    shared = torch.tensor([[False, False], [True, False], [False, False]])
    assert obj.policy_gradient_weight(adv, mask, "unshared", shared).tolist() == [[1, 1], [0, 1], [1, 1]]


def test_drop_equals_grpo_with_negative_advantages_zeroed():
    """Positive-only GRPO's gradient, by the weight, equals plain GRPO's gradient with the negative
    advantages set to 0 by hand (an independent path), with the same normaliser."""
    torch.manual_seed(0)
    logp = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    old = logp.detach() + 0.05 * torch.randn(4, 5, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.7, -0.5, 0.0], dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2, 3:] = False
    pg, _, _ = obj.clipped_surrogate(logp, old, adv)
    w = obj.policy_gradient_weight(adv, mask, "drop").to(torch.float64)
    (g1,) = torch.autograd.grad(obj.aggregate(pg * w, mask, "seq-mean-token-mean", 4.0), logp)
    pg2, _, _ = obj.clipped_surrogate(logp, old, adv.clamp(min=0))
    (g2,) = torch.autograd.grad(obj.aggregate(pg2, mask, "seq-mean-token-mean", 4.0), logp)
    assert torch.allclose(g1, g2) and g1[1].abs().sum() == 0 and g1[0].abs().sum() > 0


def test_minibatch_order_keeps_groups_together():
    group = torch.tensor([7, 7, 3, 3, 5, 5, 7, 3, 5])
    torch.manual_seed(1)
    order = minibatch_order(group, shuffle=True, by_prompt=True)
    assert sorted(order.tolist()) == list(range(9))
    seq = group[order].tolist()
    runs = [seq[0]] + [b for a, b in zip(seq, seq[1:]) if a != b]
    assert sorted(runs) == [3, 5, 7]  # each group one contiguous run
    assert minibatch_order(group, shuffle=False, by_prompt=True).tolist() == [2, 3, 7, 4, 5, 8, 0, 1, 6]
    assert minibatch_order(group, shuffle=False, by_prompt=False).tolist() == list(range(9))
