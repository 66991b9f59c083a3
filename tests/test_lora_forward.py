"""lora_forward.lean_adapters: the sampler's LoRA forward without peft's per-call bookkeeping.

The reference is peft itself: every check runs the same model through peft's own LoRA forward and
through the lean one and asks for the same bits (torch.equal), never a tolerance; the adapters are
non-zero, so the adapter path changes the outputs (checked). Then the sampler: the rollout engine's
greedy and sampled tokens and their log-probs with the lean forward (the default) equal those with
peft's forward, under bf16-mixed, where the sampler runs the adapter path.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import TINY_DIMS
from lldslight.policy.lora_forward import lean_adapters
from lldslight.policy import LoRAConfig, PolicyConfig, load_policy, precision_autocast


def _policy(precision: str = "bf16-mixed", **lora):
    cfg = PolicyConfig(model="smollm2-135m-instruct", precision=precision, random_init=dict(TINY_DIMS),
                       lora=LoRAConfig(**{"r": 4, "alpha": 8, **lora}), gradient_checkpointing=False)
    model, tok = load_policy(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)  # a zero B (peft's init) would make the adapter path invisible
    return model, tok


def _lora_layers(model):
    from peft.tuners.lora.layer import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def _logits(model, ids):
    with torch.no_grad(), precision_autocast(model):
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_lean_forward_gives_peft_bits(precision):
    model, _ = _policy(precision)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 17))
    peft_logits = _logits(model, ids)
    with lean_adapters(model) as switched:
        assert switched == len(_lora_layers(model)) > 0
        assert all("forward" in m.__dict__ for m in _lora_layers(model))
        lean_logits = _logits(model, ids)
    assert torch.equal(lean_logits, peft_logits)
    with model.disable_adapter():
        assert not torch.equal(_logits(model, ids), peft_logits)  # the adapter path mattered
    assert not any("forward" in m.__dict__ for m in _lora_layers(model))  # peft's forward is back


def test_lean_forward_with_an_adapter_bias_and_dropout_in_eval_mode():
    model, _ = _policy("bf16-mixed", dropout=0.1)
    from peft.tuners.lora.layer import Linear

    # peft's lora_bias option puts a bias on B; set one by hand on every layer (the same module, so
    # peft's path uses it too) to check the lean forward passes it.
    for layer in _lora_layers(model):
        b = layer.lora_B["default"]
        b.bias = nn.Parameter(torch.randn(b.out_features) * 0.05)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    expected = _logits(model, ids)
    with lean_adapters(model) as switched:
        assert switched == len(_lora_layers(model))
        assert torch.equal(_logits(model, ids), expected)
    assert all(type(m) is Linear for m in _lora_layers(model))


def test_layers_the_lean_forward_cannot_stand_for_keep_pefts():
    """Dropout that acts (train mode, p > 0), a DoRA variant, a disabled adapter, a hook on the
    base layer: peft's own forward runs there."""
    model, _ = _policy("fp32", dropout=0.1)
    model.train()
    with lean_adapters(model) as switched:
        assert switched == 0
    model.eval()
    layer = _lora_layers(model)[0]
    handle = layer.base_layer.register_forward_hook(lambda *a: None)
    with lean_adapters(model) as switched:
        assert switched == len(_lora_layers(model)) - 1 and "forward" not in layer.__dict__
    handle.remove()
    with model.disable_adapter(), lean_adapters(model) as switched:
        assert switched == 0

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(model.config)
    dora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True))
    with lean_adapters(dora) as switched:
        assert switched == 0


def test_peft_forward_is_back_after_an_error():
    model, _ = _policy("fp32")
    with pytest.raises(RuntimeError, match="inside"):
        with lean_adapters(model):
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in _lora_layers(model))


@pytest.mark.parametrize("greedy", [True, False])
def test_the_samplers_tokens_and_logprobs_are_unchanged(greedy, bm25, protocol_examples, monkeypatch):
    """The engine under bf16-mixed (the adapter path): the same token ids and sampled log-probs
    with the lean forward as with peft's (lean_forward patched to refuse every layer)."""
    import lldslight.policy.lora_forward as lora_forward
    from lldslight.rewards import ExactMatchReward
    from lldslight.rollout import RolloutConfig, RolloutEngine

    model, tok = _policy("bf16-mixed")
    cfg = RolloutConfig(group_size=2, max_turns=2, max_new_tokens=16, max_obs_tokens=40, max_response_tokens=120,
                        topk=2, greedy=greedy)

    def rollouts():
        torch.manual_seed(5)  # every row's random stream (engine.py)
        traj = RolloutEngine(tok, bm25, ExactMatchReward(), cfg).generate(model, protocol_examples)
        return traj.input_ids, traj.sample_logp

    calls = []
    real = lora_forward.lean_forward
    monkeypatch.setattr(lora_forward, "lean_forward", lambda layer: calls.append(layer) or real(layer))
    lean_ids, lean_logp = rollouts()
    assert any(real(layer) is not None for layer in calls)  # the lean forward did run
    monkeypatch.setattr(lora_forward, "lean_forward", lambda layer: None)
    peft_ids, peft_logp = rollouts()
    assert torch.equal(lean_ids, peft_ids)
    assert (lean_logp is None) == (peft_logp is None)
    if lean_logp is not None:
        assert torch.equal(lean_logp, peft_logp)
