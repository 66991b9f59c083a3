"""policy.gradient_checkpointing: auto (lldslight/policy/activation_checkpointing.py): decoder layers keep their
activations while they fit in the byte budget, the rest are checkpointed; the gradient is the same
whatever the budget. Float64, so the comparisons measure the checkpointing, not fp32 rounding."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_policy_config
from lldslight.policy.activation_checkpointing import activation_budget
from lldslight.update.logprobs import token_logprobs
from lldslight.policy import PolicyConfig, load_policy

LAYERS = 4


def _model(checkpointing):
    cfg = dataclasses.replace(tiny_policy_config(), gradient_checkpointing=checkpointing)
    cfg.random_init = dict(cfg.random_init, num_hidden_layers=LAYERS)
    model, tok = load_policy(cfg)
    model.double().train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a non-zero adapter: every LoRA matrix gets a gradient
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model, tok


def _grads_and_recomputes(model, ids, budget_bytes):
    """Gradient of a loss on log-probs and entropies, and how often each layer's attention ran
    (1: activations kept, 2: recomputed in the backward)."""
    calls = [0] * LAYERS
    decoder = model.get_base_model().model
    hooks = [layer.self_attn.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(decoder.layers)]
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :5] = False
    try:
        with activation_budget(model, budget_bytes) as stats:
            logp, ent = token_logprobs(model, ids, torch.ones_like(ids), mask, with_entropy=True)
        loss = (logp * torch.linspace(-1, 1, ids.shape[1], dtype=logp.dtype)).sum() + 0.1 * ent.sum()
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params)
    finally:
        for h in hooks:
            h.remove()
    return grads, calls, stats


def test_auto_checkpointing_keeps_what_fits_and_gives_the_same_gradient():
    ids = torch.randint(0, 49152, (3, 24), generator=torch.Generator().manual_seed(0))
    plain, _ = _model(False)
    want, calls, _ = _grads_and_recomputes(plain, ids, None)
    assert calls == [1] * LAYERS

    model, _ = _model("auto")
    # budget None: gradient_checkpointing as loaded (every layer recomputed)
    got, calls, _ = _grads_and_recomputes(model, ids, None)
    assert calls == [2] * LAYERS
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    # everything fits: nothing is recomputed
    got, calls, stats = _grads_and_recomputes(model, ids, 2**40)
    assert calls == [1] * LAYERS and stats["plain"] == LAYERS
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    per_layer = model._lldslight_layer_bytes_per_token * ids.numel()
    assert 0 < per_layer * LAYERS < stats["saved"]  # the saved bytes include what the layers saved

    # room for two layers and a half: the first two keep their activations, the rest are recomputed
    got, calls, stats = _grads_and_recomputes(model, ids, 2.5 * per_layer)
    assert calls == [1, 1, 2, 2] and stats["plain"] == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    # no room: every layer is recomputed (the layer size is known from the calls above)
    got, calls, stats = _grads_and_recomputes(model, ids, 0)
    assert calls == [2] * LAYERS and stats["plain"] == 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the flags are restored: outside the budget, layers checkpoint as configured
    assert all(layer.gradient_checkpointing for layer in model.get_base_model().model.layers)


def test_checkpointing_setting_is_checked():
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        PolicyConfig(gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match="activation_budget_mb"):
        PolicyConfig(activation_budget_mb=-1)
