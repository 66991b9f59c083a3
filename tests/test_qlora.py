"""QLoRA (4-bit nf4 base + LoRA, bitsandbytes) and 8-bit AdamW: config validation and clear errors
on any machine; the real thing only where CUDA and bitsandbytes are present."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from lldslight.policy import LoRAConfig, PolicyConfig, PolicyLoadError, load_policy

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
GPU_QLORA = HAS_BNB and torch.cuda.is_available()


def test_quantization_needs_lora_and_pretrained_weights():
    with pytest.raises(ValueError, match="needs policy.lora"):
        PolicyConfig(quantization="nf4", lora=None)
    with pytest.raises(ValueError, match="random_init"):
        PolicyConfig(quantization="nf4", random_init={"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="'nf4', 'int8'"):
        PolicyConfig(quantization="fp4")
    assert PolicyConfig(quantization="nf4", lora=LoRAConfig(r=8)).quantization == "nf4"


def test_qlora_without_lora_is_rejected_when_the_cli_builds_the_module(tmp_path, capsys):
    from lldslight.cli import main

    assert main(["fit", "--config", "configs/tiny.yaml", "--model.policy.random_init", "null",
                 "--model.policy.quantization", "nf4", "--model.policy.lora", "null",
                 "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 2
    assert "lldslight fit: error: policy.quantization='nf4' needs policy.lora" in capsys.readouterr().err


@pytest.mark.skipif(GPU_QLORA, reason="this machine can run QLoRA; the error path does not apply")
def test_missing_bitsandbytes_or_cuda_gives_a_clear_error():
    with pytest.raises(PolicyLoadError) as err:
        load_policy(PolicyConfig(dtype="float32", quantization="nf4", lora=LoRAConfig(r=4)))
    message = str(err.value)
    if not HAS_BNB:
        assert "needs bitsandbytes" in message and "pip install" in message
    else:
        assert "needs a CUDA GPU" in message


@pytest.mark.skipif(HAS_BNB, reason="bitsandbytes is installed")
def test_adamw8bit_without_bitsandbytes_says_how_to_install():
    from lldslight.module import GRPOModule

    module = GRPOModule(optimizer="adamw8bit")
    with pytest.raises(ImportError, match="pip install 'lldslight\\[gpu\\]'"):
        module.configure_optimizers()


@pytest.mark.skipif(not GPU_QLORA, reason="QLoRA needs a CUDA GPU and bitsandbytes")
def test_qlora_policy_trains_only_the_adapter_on_a_4bit_base():
    import bitsandbytes as bnb

    from lldslight.logprobs import token_logprobs

    model, tok = load_policy(PolicyConfig(dtype="bfloat16", quantization="nf4", lora=LoRAConfig(r=8)))
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit, "no 4-bit linear layers: the base was not quantized"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.tensor([tok("Answer the question. <search> Paris </search>")["input_ids"]], device="cuda")
    mask = torch.ones_like(ids, dtype=torch.bool)
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids), mask)
    logp.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n]  # B starts at 0: A gets no gradient yet
    assert all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
    with model.disable_adapter():  # the reference policy: the same 4-bit weights, adapter off
        ref, _ = token_logprobs(model, ids, torch.ones_like(ids), mask)
    assert torch.isfinite(ref).all()


@pytest.mark.skipif(not GPU_QLORA, reason="8-bit AdamW needs a CUDA GPU and bitsandbytes")
def test_adamw8bit_optimizer_is_bitsandbytes():
    import bitsandbytes as bnb

    from lldslight.module import GRPOModule
    from tests.conftest import tiny_policy_config

    module = GRPOModule(policy=tiny_policy_config(), optimizer="adamw8bit", warmup_steps=0)
    module.configure_model()
    module.cuda()
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, bnb.optim.AdamW8bit)
