"""LLDProbe on a tiny real model: it leaves the weights and every random stream as they were, and
its per-group verdict equals an independent first-order computation (the sign of the inner
product between each group's correct-response log-likelihood gradient and the probe's step)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import tiny_policy_config
from run_helpers import ParityReward

from lldslight.update import objectives as obj
from lldslight.callbacks.probe import LLDProbe
from lldslight.data.formats import load_examples
from lldslight.module import GRPOModule
from lldslight.rollout import RolloutConfig, RolloutEngine
from lldslight.update import UpdateConfig


@pytest.fixture(scope="module")
def setup(synth_kb, bm25):
    torch.manual_seed(0)
    module = GRPOModule(policy=tiny_policy_config(lora=False), update=UpdateConfig(kl_coef=0.0))
    module.configure_model()
    module.policy.double()  # float64: the first-order check below is then not drowned in rounding
    engine = RolloutEngine(module.tokenizer, bm25, ParityReward(), RolloutConfig(group_size=4, max_turns=1, max_new_tokens=8,
                                                                              max_obs_tokens=16, max_response_tokens=40, topk=1))
    examples = load_examples(synth_kb["train_jsonl"])[:6]
    for gid, e in enumerate(examples):
        e.group_id = gid
    return module, engine, examples


def test_probe_restores_weights_grads_and_rng(setup) -> None:
    module, engine, examples = setup
    before = [p.detach().clone() for p in module.trainable_parameters()]
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    result = LLDProbe(questions=6, step_norm=0.05).probe(module, engine, examples)
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (expect[0].tolist(), expect[1], expect[2])
    assert all(torch.equal(a, p) and p.grad is None for a, p in zip(before, module.trainable_parameters()))
    assert result["mixed_groups"] > 0 and 0.0 <= result["lld_share"] <= 1.0
    again = LLDProbe(questions=6, step_norm=0.05).probe(module, engine, examples)
    assert again == result  # seeded: the same weights give the same probe


def test_probe_verdict_equals_first_order_inner_products(setup) -> None:
    module, engine, examples = setup
    probe = LLDProbe(questions=6, step_norm=1e-5)
    result = probe.probe(module, engine, examples)
    # Independent route: the same rollouts (same seed), then per mixed group the gradient of its
    # correct responses' mean token log-prob, against the GRPO gradient g: Delta ~ -step * <grad, g> / |g|.
    torch.manual_seed(probe.seed)
    traj = engine.generate(module.policy, examples, group_size=None)
    adv = obj.group_advantages(traj.reward, traj.group_id)
    params = module.trainable_parameters()
    logp, _ = module.logprobs(traj)
    mask = traj.loss_mask
    mixed = [g for g in torch.unique(traj.group_id).tolist() if bool((adv[traj.group_id == g] > 0).any()) and bool((adv[traj.group_id == g] < 0).any())]
    rows = torch.cat([(traj.group_id == g).nonzero()[:, 0] for g in mixed])
    keep = torch.zeros(len(traj), dtype=torch.bool)
    keep[rows] = True
    m = mask & keep.unsqueeze(-1)
    # the GRPO surrogate at ratio 1, seq-mean-token-mean, over the mixed groups' rows only
    per_row = (-(adv.unsqueeze(-1) * logp) * m).sum(-1) / m.sum(-1).clamp(min=1)
    g = torch.autograd.grad(per_row[keep].sum() / float(m.any(-1).sum()), params, retain_graph=True)
    signs = []
    for group in mixed:
        pos = m & ((traj.group_id == group) & (adv > 0)).unsqueeze(-1)
        mean_logp = (logp * pos).sum() / pos.sum()
        grad = torch.autograd.grad(mean_logp, params, retain_graph=True)
        inner = sum(float((a * b).sum()) for a, b in zip(grad, g))
        signs.append(inner > 0)  # a step along -g lowers the correct responses' likelihood when <grad, g> > 0
    assert result["mixed_groups"] == len(mixed)
    assert result["lld_share"] == pytest.approx(sum(signs) / len(signs))
