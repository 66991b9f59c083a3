"""QLoRA on this CPU: a bitsandbytes 4-bit (nf4) or 8-bit (int8) base with fp32 compute + LoRA, and
8-bit AdamW, end to end: load, sample, update, checkpoint, resume, export.

Each result is checked against a second computation: the sampler's log-probs (incremental decoding)
against the trainer's full forward; gradients through the quantized layers against the same adapter
on the float layers transformers dequantizes them into; 8-bit AdamW against torch's AdamW; the
exported directory, loaded by plain transformers, against the trained quantized policy.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lldslight.policy import LoRAConfig, PolicyConfig, PolicyLoadError, load_policy, quantized_linears
from run_helpers import KILL, TINY_RUN_HEAD
from tests.conftest import ROOT, TINY_DIMS
from lldslight.update.optim import OptimConfig

bnb = pytest.importorskip("bitsandbytes", minversion="0.50")
KINDS = ["nf4", "int8"]
BNB_LINEAR = {"nf4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}


def qlora_config(kind: str) -> PolicyConfig:
    return PolicyConfig(precision="fp32", random_init=dict(TINY_DIMS), lora=LoRAConfig(r=4, alpha=8), quantization=kind,
                        gradient_checkpointing=False)


def qlora_policy(kind: str, adapter_std: float = 0.0):
    """The tiny random-init model, quantized, with LoRA; lora_B drawn non-zero when adapter_std > 0
    (peft starts it at zero, where the adapter changes nothing and no test could see it)."""
    model, tok = load_policy(qlora_config(kind))
    if adapter_std:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * adapter_std)
    return model, tok


def adapter_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def frozen_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def test_quantization_needs_lora_and_accepts_random_init():
    with pytest.raises(ValueError, match=r"policy.lora must be a LoRA config with policy.quantization='nf4', got None"):
        PolicyConfig(quantization="nf4", lora=None)
    with pytest.raises(ValueError, match="'nf4', 'int8'"):
        PolicyConfig(quantization="fp4")
    assert PolicyConfig(quantization="nf4", random_init={"num_hidden_layers": 2}).quantization == "nf4"


def test_qlora_without_lora_is_rejected_when_the_cli_builds_the_module(tmp_path, capsys):
    from lldslight.cli import main

    assert main(["fit", "--config", "configs/tiny.yaml", "--model.policy.quantization", "nf4", "--model.policy.lora", "null",
                 "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 2
    assert "lldslight fit: error: policy.lora must be a LoRA config with policy.quantization='nf4', got None" in capsys.readouterr().err


def test_missing_bitsandbytes_names_the_extra(monkeypatch):
    from lldslight.module import GRPOModule

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    with pytest.raises(PolicyLoadError, match=r"policy.quantization='nf4' needs bitsandbytes: pip install -e '\.\[gpu\]' in your lldslight clone"):
        load_policy(qlora_config("nf4"))
    with pytest.raises(ImportError, match=r"adamw8bit needs bitsandbytes: pip install -e '\.\[gpu\]' in your lldslight clone"):
        GRPOModule(optim=OptimConfig(optimizer="adamw8bit", warmup_steps=0)).configure_optimizers()


@pytest.mark.parametrize("kind", KINDS)
def test_random_init_base_is_quantized_and_only_the_adapter_trains(kind):
    model, _ = qlora_policy(kind)
    layers = quantized_linears(model)
    assert len(layers) == 7 * TINY_DIMS["num_hidden_layers"] and all(isinstance(m, BNB_LINEAR[kind]) for m in layers)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # The quantized weights are the seeded random weights (export rebuilds them from the seed).
    full, _ = load_policy(dataclasses.replace(qlora_config(kind), quantization=None))
    for name, ref in full.named_parameters():
        if name.endswith("q_proj.base_layer.weight"):
            layer = model.get_submodule(name.rsplit(".", 1)[0])
            from transformers.integrations.bitsandbytes import dequantize_bnb_weight

            deq = dequantize_bnb_weight(layer.weight, getattr(layer, "state", None)).float()
            err = ((deq - ref).norm() / ref.norm()).item()
            assert 0 < err < (0.15 if kind == "nf4" else 0.02), (name, err)


@pytest.mark.parametrize("kind", KINDS)
def test_sampler_follows_the_adapter_on_a_quantized_base(kind, bm25, protocol_examples):
    """The sampled tokens' log-probs must be the trainer's (adapter on), not the base policy's.
    Folding the delta into bitsandbytes weights failed here: nf4 raised (packed shape), int8 rounded
    the delta away and sampled the base policy (log-probs 0.76 off the trainer's)."""
    from lldslight.update.logprobs import token_logprobs
    from lldslight.rollout import RolloutConfig, RolloutEngine

    model, tok = qlora_policy(kind, adapter_std=0.3)
    model.train()
    before = frozen_state(model)
    engine = RolloutEngine(tok, bm25, lambda response, gold: 0.0, RolloutConfig(
        group_size=2, max_turns=1, max_new_tokens=10, max_obs_tokens=30, max_response_tokens=60, topk=1))
    torch.manual_seed(0)
    traj = engine.generate(model, protocol_examples[:2])
    mask = traj.loss_mask.bool()
    assert int(mask.sum()) >= 20
    with torch.no_grad():
        trained, _ = token_logprobs(model, traj.input_ids, traj.attention_mask, mask)
        with model.disable_adapter():
            base, _ = token_logprobs(model, traj.input_ids, traj.attention_mask, mask)
    assert (trained[mask] - base[mask]).abs().max() > 0.1, "the adapter should matter for this test to mean anything"
    torch.testing.assert_close(traj.sample_logp[mask], trained[mask], rtol=0, atol=1e-4)
    after = frozen_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "sampling changed the frozen base"
    assert all(m.training for m in model.modules()), "sampling did not restore train mode"


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_quantized_layers_match_the_dequantized_base(kind):
    """Backward through bitsandbytes' layers on CPU equals backward through float layers holding the
    dequantized weights (transformers' dequantize) with the same adapter, also after an eval-mode
    forward (evaluation, monitoring): on an AVX512-BF16 CPU bitsandbytes would then switch a 4-bit
    layer for good to a bf16 kernel without autograd, and the adapters' gradients were 98% off."""
    from lldslight.update.logprobs import token_logprobs

    model, _ = qlora_policy(kind, adapter_std=0.3)
    ref, _ = load_policy(qlora_config(kind), dequantize=True)
    assert not quantized_linears(ref)
    ref.load_state_dict(adapter_state(model), strict=False)
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    grads = []
    for m in (model, ref):
        m.train()
        logp, _ = token_logprobs(m, ids, torch.ones_like(ids), mask)
        logp.sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-3, atol=1e-5, msg=name)
    assert all(float(g.abs().sum()) > 0 for n, g in grads[0].items() if "lora_A" in n)


@pytest.mark.parametrize("kind", KINDS)
def test_update_moves_the_adapter_and_leaves_the_quantized_base(kind):
    from lldslight.update.logprobs import token_logprobs

    model, _ = qlora_policy(kind)
    model.train()
    base = frozen_state(model)
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), mask)
        loss = -logp.sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(float(v.abs().sum()) > 0 for k, v in adapter_state(model).items() if "lora_B" in k)
    after = frozen_state(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the quantized base changed"
    assert all(not m.weight.is_floating_point() for m in quantized_linears(model))


def test_adamw8bit_on_cpu_steps_like_adamw():
    """bitsandbytes' AdamW8bit keeps 8-bit moments for tensors of >= 4096 elements (32-bit below):
    on CPU its updates follow torch's AdamW within the quantisation error, and GRPOModule builds it."""
    from lldslight.module import GRPOModule
    from tests.conftest import tiny_policy_config

    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(128, 64, generator=gen), torch.randn(32, 8, generator=gen)]
    p8, p32 = [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]
    opt8 = bnb.optim.AdamW8bit(p8, lr=1e-2, weight_decay=0.01)
    opt32 = torch.optim.AdamW(p32, lr=1e-2, weight_decay=0.01)
    for _ in range(5):
        grads = [torch.randn(t.shape, generator=gen) for t in init]
        for a, b, g in zip(p8, p32, grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt8.step()
        opt32.step()
    assert opt8.state[p8[0]]["state1"].dtype == torch.uint8 and opt8.state[p8[1]]["state1"].dtype == torch.float32
    for a, b, t in zip(p8, p32, init):
        step8, step32 = a.detach() - t, b.detach() - t
        rel = ((step8 - step32).norm() / step32.norm()).item()
        assert rel < 0.05, rel
    assert ((p8[0] - p32[0]).norm() / (p32[0] - init[0]).norm()).item() > 1e-4, "8-bit moments should not be exact"

    module = GRPOModule(policy=tiny_policy_config(), optim=OptimConfig(optimizer="adamw8bit", warmup_steps=0))
    module.configure_model()
    assert isinstance(module.configure_optimizers()["optimizer"], bnb.optim.AdamW8bit)


# -- the real CLI: configs/tiny.yaml + configs/qlora.yaml -------------------------------------------

RUN = TINY_RUN_HEAD + """        reward: {{class_path: run_helpers.ParityReward}}
        rollout: {{group_size: 2, max_turns: 2, max_new_tokens: 12, max_obs_tokens: 48, max_response_tokens: 120, topk: 2, temperature: 1.0}}
{extra}    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{save_last: true, every_n_train_steps: 1}}
model:
  optim: {{lr: 1.0e-3}}
"""


def fit(tmp: Path, name: str, steps: int, extra: str = "", args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``lldslight fit --config configs/tiny.yaml --config configs/qlora.yaml --config <this run>``
    in a subprocess (qlora.yaml's DDP sets up a process group)."""
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(RUN.format(steps=steps, save_dir=tmp / name, extra=extra))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", "configs/tiny.yaml", "--config", "configs/qlora.yaml",
           "--config", str(cfg), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def trained_policy(ckpt_path: Path, precision: str | None = None):
    """The policy a checkpoint trained: the quantized base rebuilt from the checkpoint's policy
    config, its adapter loaded, bitsandbytes' training kernels (LoRA dropout 0); computing in
    ``precision`` when given, else as training did."""
    from lldslight.policy.export import load_checkpoint, policy_from_hparams

    checkpoint = load_checkpoint(ckpt_path)
    policy = policy_from_hparams(checkpoint["hyper_parameters"]["policy"])
    build = dataclasses.replace(policy, gradient_checkpointing=False, **({"precision": precision} if precision else {}))
    model, _ = load_policy(build)
    result = model.load_state_dict({k[len("policy."):]: v for k, v in checkpoint["state_dict"].items()}, strict=False)
    assert not result.unexpected_keys
    return model.train(), policy


def export_matches_training(ckpt_path: Path, out: Path) -> None:
    """``lldslight export`` (float32) loads in plain transformers, unquantized, and computes the
    trained policy's logits."""
    from transformers import AutoModelForCausalLM

    from lldslight.policy.export import main as export_main

    assert export_main(["--ckpt", str(ckpt_path), "--out", str(out), "--dtype", "float32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert getattr(exported.config, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in exported.parameters())
    assert not any(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in exported.modules())
    # The same quantized weights and adapter computing in fp32, as the export does: under "auto" a CPU
    # with native bf16 trained with bf16 compute, whose rounding (~0.03 in these logits) a float32
    # export neither has nor should have; on an AVX2-only CPU "auto" is fp32 and the two coincide.
    trained, _ = trained_policy(ckpt_path, precision="fp32")
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        with trained.disable_adapter():
            base = trained(input_ids=ids).logits
        got = exported.eval()(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3, "the trained adapter should change the logits"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_qlora_cli_fit_resume_and_export(tmp_path):
    """nf4 + LoRA r=64 + 8-bit AdamW + DDP through the real CLI: the adapter trains, a run killed in
    the middle of step 2 and resumed continues exactly as the uninterrupted one, and the export is
    the trained policy as a float32 Hugging Face directory plain transformers loads."""
    from tests.test_resume import metrics

    steps = 3
    full = fit(tmp_path, "full", steps)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = fit(tmp_path, "run", steps, extra=KILL.format(step=2))
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = fit(tmp_path, "run", steps, args=("--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    want = metrics(tmp_path / "full" / "tiny" / "version_0" / "metrics.csv")
    got = {**metrics(tmp_path / "run" / "tiny" / "version_0" / "metrics.csv"),
           **metrics(tmp_path / "run" / "tiny" / "version_1" / "metrics.csv")}
    assert sorted(want) == sorted(got) == list(range(steps))
    assert any(want[s]["train/grad_norm"] > 0 for s in want), "no gradient reached the adapter"
    for step in range(steps):
        for key in sorted(k for k in want[step] if k.startswith("train/")):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-7, nan_ok=True), (step, key)

    ckpt_path = tmp_path / "full" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    a = torch.load(ckpt_path, weights_only=True)
    b = torch.load(tmp_path / "run" / "tiny" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == steps
    assert a["state_dict"] and all("lora_" in k for k in a["state_dict"]), "a checkpoint holds the adapter only"
    for k in a["state_dict"]:
        torch.testing.assert_close(a["state_dict"][k], b["state_dict"][k], rtol=0, atol=0)
    lora_b = [v for k, v in a["state_dict"].items() if "lora_B" in k]
    assert any(float(v.abs().sum()) > 0 for v in lora_b), "the adapter never moved"
    quant = [s["__bnb_optimizer_quant_state__"] for s in a["optimizer_states"][0]["state"].values()]
    assert quant and all(q["state1"].dtype == torch.uint8 for q in quant), "8-bit AdamW moments expected (r=64 tensors)"

    # Export: the nf4 base is rebuilt from the seed, dequantized to float32, the adapter merged.
    _, policy = trained_policy(ckpt_path)
    assert (policy.quantization, policy.precision, policy.dtype, policy.lora.r) == ("nf4", "auto", None, 64)
    export_matches_training(ckpt_path, tmp_path / "exported")


@pytest.mark.slow
def test_int8_cli_fit_and_export(tmp_path):
    """The same overlay with an 8-bit base: the adapter trains; the export is the trained policy."""
    from tests.test_resume import metrics

    # Four prompts a step for two steps: with two responses a prompt, a step whose every group ties
    # (no advantage, no gradient) happens with probability 1/16 instead of 1/4 at tiny.yaml's two
    # prompts, and which one does depends on the CPU's arithmetic (bf16 or fp32 under "auto").
    done = fit(tmp_path, "int8", 2, args=("--model.policy.quantization", "int8", "--data.batch_size", "4"))
    assert done.returncode == 0, done.stderr[-3000:]
    grad_norms = [m["train/grad_norm"] for m in metrics(tmp_path / "int8" / "tiny" / "version_0" / "metrics.csv").values()]
    assert any(g > 0 for g in grad_norms), f"every group tied in both steps: no gradient to test the export with ({grad_norms})"
    ckpt_path = tmp_path / "int8" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    _, policy = trained_policy(ckpt_path)
    assert policy.quantization == "int8"
    export_matches_training(ckpt_path, tmp_path / "exported")
