"""The frozen bottom of the decoder computed once per rollout batch (lldslight/update/frozen_prefix.py).

Two references, as in test_shared_prefix.py: lldslight's own plain path (every pass runs every
layer: ``frozen_prefix`` off), and transformers' plain forward (full logits, log_softmax, gather:
no lldslight code). The bound: fp32, relative 1e-5 (the same argument as test_shared_prefix.py's:
a few fp32 roundings per accumulation at most; on the machine this was written on the values came
out bit for bit equal, as the boundary is the very tensor the plain forward computes).

Multi-turn rows (prompt, action, observation, action; groups sharing prompts), LoRA on the top 2 of
4 layers, and a full fine-tune with the bottom 2 layers frozen and a separate reference copy.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import TINY_DIMS, tiny_policy_config
from test_shared_prefix import PROMPTS, REL, assert_close, hand_built, transformers_path, weights

from lldslight.update import frozen_prefix
from lldslight.update.logprobs import token_logprobs
from lldslight.policy import LoRAConfig, load_policy
from lldslight.trajectory import Trajectory

LAYERS = 4
TOP = [2, 3]


def config(lora: bool = True, checkpointing=False, **overrides):
    cfg = tiny_policy_config(lora=lora)
    return dataclasses.replace(cfg, random_init={**TINY_DIMS, "num_hidden_layers": LAYERS}, gradient_checkpointing=checkpointing,
                               lora=LoRAConfig(r=4, alpha=8, layers_to_transform=TOP) if lora else None,
                               freeze_bottom_layers=0 if lora else TOP[0], **overrides)


def model_of(lora: bool = True, checkpointing=False):
    model, _ = load_policy(config(lora, checkpointing))
    model.train()
    with torch.no_grad():  # an adapter that is not zero: every adapter weight gets a gradient
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def layer_calls(model) -> tuple[list[int], list]:
    """A counter of each decoder layer's forward calls, and the hooks to remove."""
    layers = list(frozen_prefix._parts(model)[1])
    counts = [0] * len(layers)

    def hook(i):
        def fn(module, args, kwargs, output):
            counts[i] += 1
        return fn

    return counts, [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]


def lldslight_path(model, ids, attn, mask, groups, boundary):
    params = [p for p in model.parameters() if p.requires_grad]
    logp, ent = token_logprobs(model, ids, attn, mask, with_entropy=True, temperature=0.7, groups=groups, boundary=boundary)
    w, v = weights(ids.shape)
    return logp.detach(), ent.detach(), torch.autograd.grad((w * logp).sum() + (v * ent).sum(), params)


@pytest.mark.parametrize("lora, checkpointing, shared", [(True, False, True), (True, False, False), (True, True, True),
                                                          (False, False, True), (False, "auto", False)])
def test_the_stored_boundary_gives_the_plain_logprobs_and_every_gradient(lora, checkpointing, shared):
    model = model_of(lora, checkpointing)
    start, why = frozen_prefix.start_layer(model)
    assert (start, why) == (TOP[0], "")
    ids, attn, mask, groups, _ = hand_built()
    groups = groups if shared else None
    # the boundary computed in other micro-batches than the pass that uses it (as the update does)
    hidden = frozen_prefix.compute(model, ids, attn, groups, start, [torch.tensor([4, 0]), torch.tensor([1, 2, 3, 5])])
    assert hidden.shape == (*ids.shape, TINY_DIMS["hidden_size"])
    counts, hooks = layer_calls(model)
    try:
        got = lldslight_path(model, ids, attn, mask, groups, frozen_prefix.Boundary(hidden, start))
    finally:
        for h in hooks:
            h.remove()
    assert counts[: TOP[0]] == [0] * TOP[0] and all(c >= 1 for c in counts[TOP[0]:]), counts  # the bottom did not run
    assert_close(got, lldslight_path(model, ids, attn, mask, groups, None), "vs every layer")
    assert_close(got, transformers_path(model, ids, attn, mask, temperature=0.7), "vs transformers' forward")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(got[2]) == len(trainable) > 0


def test_where_it_does_not_apply():
    every_layer, _ = load_policy(tiny_policy_config(lora=True))  # LoRA on every layer: layer 0 trains
    assert frozen_prefix.start_layer(every_layer) == (None, "")
    full, _ = load_policy(tiny_policy_config(lora=False))  # full fine-tuning: the embeddings train
    assert frozen_prefix.start_layer(full) == (None, "")
    top = model_of(lora=True)
    assert frozen_prefix.reference_shares(top, None, TOP[0])  # no adapter below layer 2
    assert not frozen_prefix.reference_shares(every_layer, None, 1)  # disabling layer 0's adapter changes it
    bottom_frozen = model_of(lora=False)
    ref = copy.deepcopy(bottom_frozen)
    assert frozen_prefix.reference_shares(bottom_frozen, ref, TOP[0])
    with torch.no_grad():
        next(frozen_prefix._parts(ref)[1][0].parameters()).add_(1e-3)  # a reference loaded from other weights
    assert not frozen_prefix.reference_shares(bottom_frozen, ref, TOP[0])


# -- the whole update: k = 1 and k = 8, with the reference and LLDMonitor's after-step forward --------


def rollout() -> Trajectory:
    """12 multi-turn rows in 6 groups (hand_built's rows twice, other tokens the second time), so
    that 8 updates get a mini-batch each."""
    first, second = hand_built(seed=0), hand_built(seed=5)
    width = max(first[0].shape[1], second[0].shape[1])

    def padded(x):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    ids, attn, mask = (torch.cat([padded(a), padded(b)]) for a, b in zip(first[:3], second[:3]))
    groups = torch.cat([first[3], second[3] + 3])
    B = len(ids)
    traj = Trajectory(
        input_ids=ids, attention_mask=attn, prompt_len=torch.tensor([PROMPTS[g % 3] for g in groups.tolist()]), loss_mask=mask,
        action_id=torch.where(mask, 0, -1), answer_mask=torch.zeros_like(mask), group_id=groups,
        reward=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]), num_searches=torch.ones(B, dtype=torch.long),
        num_invalid=torch.zeros(B, dtype=torch.long), num_actions=torch.ones(B, dtype=torch.long), finish_reason=["answer"] * B,
        data_source=["t"] * B, responses=[""] * B,
    )
    traj.check()
    return traj


def learner(lora: bool, reuse: bool, k: int):
    """A GRPOModule outside a Trainer (its backward is plain autograd), on the same weights each time."""
    from lldslight.module import GRPOModule
    from lldslight.update import UpdateConfig

    class Module(GRPOModule):
        def manual_backward(self, loss):
            loss.backward()

        def gradient_sync(self, enabled):
            import contextlib

            return contextlib.nullcontext()

    torch.manual_seed(0)
    module = Module(policy=config(lora), update=UpdateConfig(updates_per_rollout=k, micro_batch_size=2, kl_coef=0.05,
                                                           entropy_coef=0.01, frozen_prefix=reuse))
    module.policy = model_of(lora)
    if not lora:
        module.reference = copy.deepcopy(module.policy).eval().requires_grad_(False)
    return module


@pytest.mark.parametrize("lora, k", [(True, 1), (True, 8), (False, 8)])
def test_an_update_with_the_boundary_is_the_plain_update(lora, k):
    """Every update's loss, KL and gradient norm, and the weights after all k updates, equal with
    frozen_prefix on and off; with it on the bottom layers run once per rollout batch (one no-grad
    pass), not in pi_old's, the reference's and each training pass; LLDMonitor's after-step
    forward (batch_logprobs on the prepared rows) reuses the stored boundary too."""
    from lldslight.update import train as update
    from lldslight.update.optim import OptimConfig, build_optimizer

    out = {}
    for reuse in (True, False):
        module = learner(lora, reuse, k)
        opt, sched = build_optimizer(module.trainable_parameters(), OptimConfig(lr=1e-2, warmup_steps=0), 10)
        counts, hooks = layer_calls(module.policy)
        torch.manual_seed(1)  # the mini-batch shuffle
        try:
            result = update.train_on_rollout(module, rollout(), opt, sched)
            calls_update = list(counts)
            after = module.batch_logprobs(result.trajectory.select([0, 2, 4]))
        finally:
            for h in hooks:
                h.remove()
        out[reuse] = (result, calls_update, list(counts), after, [p.detach().clone() for p in module.trainable_parameters()])
    (got, calls, calls_after, after, weights_), (want, calls_plain, _, after_plain, weights_plain) = out[True], out[False]
    # fp32 rounding of the two summation orders compounds over the k Adam steps at lr 1e-2 (Adam's
    # m / sqrt(v) magnifies it where a gradient is near 0): after 8, up to 5.4e-5 of the largest weight
    # on an AVX2-only EPYC, whose kernels block sums differently from AVX512's; a wrong boundary moves
    # these values by orders of magnitude more than 1e-4.
    REL = globals()["REL"] if k == 1 else 10 * globals()["REL"]
    assert got.trajectory.frozen_hidden is not None and got.trajectory.frozen_start == TOP[0]
    assert want.trajectory.frozen_hidden is None
    for key in ("loss", "kl", "pg_loss", "entropy"):
        a, b = torch.tensor(got.summed[key]), torch.tensor(want.summed[key])
        assert len(a) == k and (a - b).abs().max() <= REL * b.abs().max().clamp(min=1e-12), key
    a, b = torch.tensor(got.shared["grad_norm"]), torch.tensor(want.shared["grad_norm"])
    assert (a - b).abs().max() <= REL * b.abs().max() and b.min() > 0
    for a, b in zip(weights_, weights_plain):
        # Adam's step is ~lr per weight whatever the gradient's size, so after k = 8 the weights are
        # compared to a tenth of one step (1e-3 at lr 1e-2; seen: up to 2.4e-5 between two runs of this
        # test on a loaded 2-core EPYC); a wrong boundary changes gradients, and so steps, by ~lr.
        assert (a - b).abs().max() <= (REL * b.abs().max() if k == 1 else 0.1 * 1e-2)
    assert (after - after_plain).abs().max() <= REL * after_plain.abs().max()
    bottom = TOP[0]
    # with the boundary: layer 0 runs in the boundary's one no-grad pass only (micro-batches of 2
    # rows); without: in pi_old's and the reference's passes and every training forward as well
    assert calls[0] == len(rollout()) // 2 and calls_after[0] == calls[0], calls
    # (plain: each update's micro-batches, pi_old's for the off-policy rows, the adapter-off reference's)
    assert calls_plain[0] >= 2 * calls[0], calls_plain
    assert calls[:bottom] == [calls[0]] * bottom and calls[bottom] == calls_plain[bottom]


def test_a_budget_too_small_falls_back_and_says_so(capsys):
    from lldslight.update import train as update
    from lldslight.update.optim import OptimConfig, build_optimizer
    from lldslight.update import UpdateConfig

    module = learner(True, True, 2)
    module.update_config = UpdateConfig(updates_per_rollout=2, micro_batch_size=2, frozen_prefix_max_mb=1e-4)
    frozen_prefix._SAID.discard("budget")
    opt, sched = build_optimizer(module.trainable_parameters(), OptimConfig(lr=1e-2, warmup_steps=0), 10)
    result = update.train_on_rollout(module, rollout(), opt, sched)
    assert result.trajectory.frozen_hidden is None
    assert "over frozen_prefix_max_mb" in capsys.readouterr().out


def test_freeze_bottom_layers_is_checked():
    from lldslight.errors import ConfigError

    with pytest.raises(ConfigError, match="policy.freeze_bottom_layers"):
        dataclasses.replace(tiny_policy_config(lora=True), freeze_bottom_layers=2)
    with pytest.raises(ConfigError, match="policy.freeze_bottom_layers"):
        load_policy(dataclasses.replace(tiny_policy_config(lora=False), freeze_bottom_layers=TINY_DIMS["num_hidden_layers"]))

