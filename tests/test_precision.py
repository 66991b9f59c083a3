"""policy.precision (docs/precision.md): bf16 log-probs and gradients against float64 within bounds
derived from bf16's 8-bit significand; the on-policy ratio is exactly 1 and LLDS exactly 0 in bf16;
the sampler/trainer mismatch metrics against an independent computation; what "auto" picks (the
detector monkeypatched for a CPU without bf16); the config's combinations, each refused in one line.

Rounding constants. bf16 keeps 8 significant bits, so rounding to nearest changes a value by at
most U16 = 2^-8 of itself; fp32 keeps 24, U32 = 2^-24. A product of two bf16 numbers is exact in
fp32 (8 + 8 <= 24 bits); a sum of n terms accumulated in fp32 is off by at most
gamma(n) = n U32 / (1 - n U32) times the sum of their magnitudes (Higham, Accuracy and Stability
of Numerical Algorithms, 2nd ed., §3.1). The bounds below are worst cases built from these.
"""
from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from conftest import TINY_DIMS
from lldslight.update import frozen_prefix, train as update
from lldslight.errors import ConfigError
from lldslight.update.logprobs import ChunkedLogprob, token_logprobs
from lldslight.policy import Bf16Support, LoRAConfig, PolicyConfig, load_policy, resolve_precision, sampling_weights
from lldslight.update.optim import OptimConfig
from lldslight.update import UpdateConfig

U16 = 2.0**-8
U32 = 2.0**-24


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _config(precision: str, lora: bool = True, **kw) -> PolicyConfig:
    return PolicyConfig(model="smollm2-135m-instruct", precision=precision, random_init=dict(TINY_DIMS),
                        lora=LoRAConfig(r=4, alpha=8) if lora else None, gradient_checkpointing=False, **kw)


# -- the vocabulary projection in bf16 against float64 -------------------------------------------


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, held in float64: the float64 reference computes on the very values the
    bf16 path stores, so the bounds measure the arithmetic, not the rounding of the inputs."""
    return x.bfloat16().double()


@pytest.mark.parametrize("storage", ["bf16", "fp32 weights, bf16 compute"])
@pytest.mark.parametrize("backward", ["input", "recompute"])
@pytest.mark.parametrize("scale,temperature", [(0.15, 1.0), (0.15, 0.7), (1.5, 1.0)])
def test_bf16_logprobs_and_gradients_against_float64(storage, backward, scale, temperature):
    """ChunkedLogprob with bf16 operands (bf16-true / a bf16 base under LoRA) or fp32 weights cast
    to bf16 for the projection (bf16-mixed full fine-tuning) against float64 log_softmax.

    Bounds, with z the exact logits, S_j = sum_i |h_i W_ji|, p the exact softmax:
    - a logit: the bf16 matmul accumulates in fp32 (gamma(H) S_j) and rounds its output to bf16
      (U16 |z_j|): eps_j = U16 |z_j| + gamma(H) S_j, over T;
    - log p_t = z_t - logsumexp(z), and logsumexp moves by at most max_j eps_j, so
      |d log p_t| <= eps_t + max eps + (V + 4 + 2 |log p_t| + 2 |lse|) U32 (the fp32 exp, sum, log);
    - the entropy: dH/dz_j = -p_j (log p_j + H), so |dH| <= max eps sum_j p_j |log p_j + H| plus
      the fp32 sums, (V + 4) U32 (|lse| + sum_j p_j |z_j| + |H|);
    - d log p_t / dh_k = (W_tk - sum_j p_j W_jk) / T: p is off by a factor exp(+-2 max eps)
      (eta = e^(2 max eps) - 1 + (V + 4) U32), cast to bf16 (U16), multiplied with fp32
      accumulation (gamma(V)) and rounded to bf16 (U16): |d g_k| <= (eta + 2 U16 + gamma(V)) A_k / T
      + U32 |g_k|, A_k = sum_j p_j |W_jk| + |W_tk| (the recompute path rounds onehot - p, whose
      magnitudes are bounded by this A_k, to bf16);
    - d/dW_jk (recompute: fp32 accumulation of fp32 factors over the n positions):
      |d G_jk| <= (eta + gamma(n) + U32) sum_pos |onehot - p|_j |h_k| / T.
    The logits' scale (0.15: |z| < 1 with V = 4096, so |log p| ~ 8 dwarfs them; 1.5: peaked)
    makes a bf16 log-softmax fail the bound: it would round log p itself, U16 |log p| ~ 0.03."""
    g = torch.Generator().manual_seed(0)
    n, H, V = 45, 64, 4096
    h64 = _bf16_exact(torch.randn(n, H, generator=g) * scale)
    W64 = _bf16_exact(torch.randn(V, H, generator=g) * (scale / math.sqrt(H)) * 8)
    y = torch.randint(0, V, (n,), generator=g)
    w_lp = torch.randn(n, generator=g, dtype=torch.float64)

    if storage == "bf16":
        h, W, compute = h64.bfloat16(), W64.bfloat16(), None
    else:
        h, W, compute = h64.float(), W64.float(), torch.bfloat16
    h.requires_grad_()
    W.requires_grad_(backward == "recompute")
    logp, ent = ChunkedLogprob.apply(h, W, None, y, temperature, 16, "logged", backward, compute)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    inputs = [h, W] if backward == "recompute" else [h]
    grads = torch.autograd.grad((logp * w_lp.float()).sum(), inputs)

    ref = [h64.clone().requires_grad_(), W64.clone().requires_grad_()]
    z = ref[0] @ ref[1].T / temperature
    logp_all = torch.log_softmax(z, -1)
    ref_logp = logp_all.gather(-1, y[:, None])[:, 0]
    p = logp_all.exp().detach()
    ref_ent = -(p * logp_all.detach()).sum(-1)
    ref_grads = torch.autograd.grad((ref_logp * w_lp).sum(), ref[: len(inputs)])
    z, logp_all, ref_logp = z.detach(), logp_all.detach(), ref_logp.detach()

    S = (h64.abs() @ W64.abs().T) / temperature  # [n, V]
    eps = U16 * z.abs() + gamma(H) * S  # [n, V]
    eps_t, eps_max = eps.gather(-1, y[:, None])[:, 0], eps.amax(-1)
    lse = torch.logsumexp(z, -1)
    bound_lp = eps_t + eps_max + (V + 4 + 2 * ref_logp.abs() + 2 * lse.abs()) * U32
    err_lp = (logp.double() - ref_logp).abs()
    assert (err_lp <= bound_lp).all(), f"log p off by {float((err_lp / bound_lp).max()):.2f} x its bound"
    assert err_lp.max() > 0  # the computation is bf16, not silently float64

    bound_ent = eps_max * (p * (logp_all + ref_ent[:, None]).abs()).sum(-1) + (V + 4) * U32 * (lse.abs() + (p * z.abs()).sum(-1) + ref_ent)
    assert ((ent.double() - ref_ent).abs() <= bound_ent).all()

    eta = torch.expm1(2 * eps_max) + (V + 4) * U32  # [n]
    onehot = torch.zeros(n, V, dtype=torch.float64).scatter_(-1, y[:, None], 1.0)
    A = p @ W64.abs() + W64.abs()[y]  # [n, H]
    bound_h = ((eta + 2 * U16 + gamma(V))[:, None] * A / temperature + U32 * ref_grads[0].abs() / w_lp.abs()[:, None]) * w_lp.abs()[:, None]
    err_h = (grads[0].double() - ref_grads[0]).abs()
    assert (err_h <= bound_h).all(), f"d/dh off by {float((err_h / bound_h).max()):.2f} x its bound"
    if backward == "recompute":
        G = (onehot - p).abs() * (eta[:, None] + gamma(n) + U32) * w_lp.abs()[:, None] / temperature  # [n, V]
        bound_w = G.T @ h64.abs()  # [V, H]
        err_w = (grads[1].double() - ref_grads[1]).abs()
        assert grads[1].dtype == W.dtype
        assert (err_w <= bound_w + 1e-30).all(), f"d/dW off by {float((err_w / bound_w).max()):.2f} x its bound"


def test_bf16_log_softmax_would_fail_the_bound():
    """The bound of the test above is tight enough to catch the mistake it is there for: a bf16
    log-softmax (log p rounded to bf16) at scale 0.15 exceeds it."""
    g = torch.Generator().manual_seed(0)
    n, H, V = 45, 64, 4096
    h64 = _bf16_exact(torch.randn(n, H, generator=g) * 0.15)
    W64 = _bf16_exact(torch.randn(V, H, generator=g) * (0.15 / math.sqrt(H)) * 8)
    y = torch.randint(0, V, (n,), generator=g)
    z = h64 @ W64.T
    ref_logp = torch.log_softmax(z, -1).gather(-1, y[:, None])[:, 0]
    bad = torch.log_softmax((h64.bfloat16() @ W64.bfloat16().T), -1).gather(-1, y[:, None])[:, 0]  # all bf16
    eps = U16 * z.abs() + gamma(H) * (h64.abs() @ W64.abs().T)
    bound = eps.gather(-1, y[:, None])[:, 0] + eps.amax(-1) + (V + 4 + 2 * ref_logp.abs() + 2 * torch.logsumexp(z, -1).abs()) * U32
    assert ((bad.double() - ref_logp).abs() > bound).any()


# -- what is stored in which dtype ------------------------------------------------------------------


@pytest.mark.parametrize("precision,lora,frozen,trainable", [
    ("fp32", True, torch.float32, torch.float32),
    ("bf16-mixed", True, torch.bfloat16, torch.float32),
    ("bf16-mixed", False, None, torch.float32),
    ("bf16-true", True, torch.bfloat16, torch.bfloat16),
    ("bf16-true", False, None, torch.bfloat16),
])
def test_storage_dtypes_and_gradients(precision, lora, frozen, trainable):
    model, _ = load_policy(_config(precision, lora))
    dtypes = {(p.dtype, p.requires_grad) for p in model.parameters()}
    assert {d for d, trains in dtypes if trains} == {trainable}
    assert {d for d, trains in dtypes if not trains} == ({frozen} if frozen else set())
    ids = torch.randint(0, 1000, (2, 9))
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    assert logp.dtype == torch.float32
    logp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(gr is not None and gr.dtype == trainable for gr in grads)
    assert any(bool(gr.abs().sum() > 0) for gr in grads)


def test_full_fine_tuning_reference_is_stored_in_bf16():
    from lldslight.module import GRPOModule

    module = GRPOModule(policy=_config("bf16-mixed", lora=False), update=UpdateConfig(kl_coef=0.01))
    module.configure_model()
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}
    assert {p.dtype for p in module.reference.parameters()} == {torch.bfloat16}
    # Its matmuls see the policy's step-0 weights exactly (autocast casts fp32 to the same bf16).
    ref = dict(module.reference.named_parameters())
    assert all(torch.equal(p.bfloat16(), ref[n]) for n, p in module.policy.named_parameters())


def test_bf16_sampling_does_not_fold_the_adapter():
    """W + delta rounded to bf16 would lose a small delta: under bf16 the sampler runs the adapter
    path, and the base weights stay the very tensors they were."""
    model, _ = load_policy(_config("bf16-mixed"))
    before = {n: (p, p.data.clone()) for n, p in model.named_parameters() if "base_layer" in n}
    with sampling_weights(model):
        for n, (p, data) in before.items():
            assert torch.equal(p.data, data), n
    fp32, _ = load_policy(_config("fp32"))
    with torch.no_grad():
        for n, p in fp32.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    layer = next(m for m in fp32.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A"))
    base = layer.base_layer.weight.data
    with sampling_weights(fp32):
        assert not torch.equal(layer.base_layer.weight.data, base)  # fp32: folded, as before


def test_bf16_mixed_skips_peft_input_casts_without_changing_the_arithmetic():
    """Under bf16-mixed peft's cast of a layer's input to the fp32 adapter is switched off (autocast
    casts it back at the adapter's matmul): the logits and every adapter gradient equal peft's own
    default path (casts on) bit for bit, with a non-zero adapter so the adapter path counts."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from lldslight.policy import precision_autocast

    model, _ = load_policy(_config("bf16-mixed"))
    adapted = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert adapted and not any(m.cast_input_dtype_enabled for m in adapted)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))

    def logits_and_grads(casts: bool):
        for m in adapted:
            m.cast_input_dtype_enabled = casts
        model.zero_grad()
        with precision_autocast(model):
            logits = model(input_ids=ids).logits.float()
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ours, ours_grads = logits_and_grads(False)
    peft_default, peft_grads = logits_and_grads(True)
    assert torch.equal(ours, peft_default)
    assert ours_grads.keys() == peft_grads.keys() and all(torch.equal(ours_grads[n], peft_grads[n]) for n in ours_grads)
    assert any(g.abs().sum() > 0 for g in ours_grads.values())


# -- "auto" ------------------------------------------------------------------------------------------


def test_auto_without_native_bf16_is_fp32(monkeypatch, capsys):
    import lldslight.policy.precision as precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: Bf16Support(False, "cpu", "/proc/cpuinfo: no avx512_bf16 / amx_bf16"))
    monkeypatch.setattr(precision, "_ANNOUNCED", set())
    model, _ = load_policy(_config("auto"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("lldslight: policy.precision fp32 (auto: no native bf16 on this CPU") and "avx512_bf16" in line

    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: Bf16Support(True, "cpu", "torch.cpu: avx512_bf16"))
    model, _ = load_policy(_config("auto"))
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert "policy.precision bf16-mixed (auto: native bf16 on this CPU" in capsys.readouterr().err


def test_cpu_detection_agrees_with_proc_cpuinfo():
    """torch's CPUID answer and the kernel's flags agree on this machine (either way)."""
    from lldslight.policy.precision import _proc_cpu_flags, cpu_bf16_support

    flags = _proc_cpu_flags()
    if not flags or "avx512f" not in flags and "avx2" not in flags:
        pytest.skip("not an x86 Linux CPU")
    support = cpu_bf16_support()
    assert support.native == (("avx512_bf16" in flags or "amx_bf16" in flags) and torch.backends.mkldnn.is_available())


# -- the config's combinations -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(precision="bf16"), r"^policy.precision must be auto \| fp32 \| bf16-mixed \| bf16-true, got 'bf16'$"),
    (dict(dtype="float16"), r"^policy.dtype must be float32, bfloat16 or auto .*float16 is no longer supported$"),
    (dict(dtype="float32", precision="bf16-mixed"), r"^policy.dtype 'float32' and policy.precision 'bf16-mixed' disagree"),
    (dict(quantization="nf4", precision="bf16-true"), r"^policy.precision must be 'auto', 'fp32' or 'bf16-mixed' with policy.quantization"),
])
def test_bad_combinations_are_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        PolicyConfig(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype,lora,want", [("float32", True, "fp32"), ("bfloat16", True, "bf16-mixed"),
                                             ("bfloat16", False, "bf16-true"), ("auto", True, "fp32")])
def test_deprecated_dtype_maps_to_precision(dtype, lora, want, monkeypatch):
    """What each dtype did before: old configs keep their arithmetic ("auto" was fp32 on any CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(FutureWarning, match=f"policy.precision: {want}"):
        cfg = PolicyConfig(dtype=dtype, lora=LoRAConfig() if lora else None)
    assert cfg.precision == want
    import dataclasses

    assert dataclasses.replace(cfg).precision == want  # a round trip (hparams, export) still agrees


def test_rollout_log_probs_are_refused_under_bf16():
    from lldslight.module import GRPOModule

    from lldslight.update import UpdateConfig

    with pytest.raises(ConfigError, match=r"^model.update.old_logp_source must be 'recompute' under policy.precision bf16-mixed, got 'rollout'"):
        GRPOModule(policy=_config("bf16-mixed"), update=UpdateConfig(old_logp_source="rollout"))
    GRPOModule(policy=_config("fp32"), update=UpdateConfig(old_logp_source="rollout"))  # fp32: allowed (tested to ~1e-5 elsewhere)


def test_lightning_precision_plugin_is_refused():
    from lldslight.module import GRPOModule

    trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False, enable_checkpointing=False)
    module = GRPOModule(policy=_config("fp32"))
    module.trainer = trainer
    with pytest.raises(ConfigError, match=r"^trainer.precision must be '32-true' .*got 'bf16-mixed'$"):
        module.setup("fit")


# -- the update: the on-policy ratio, LLDS and the mismatch metrics ----------------------------------


class _Inject(pl.Callback):
    def __init__(self, traj):
        self.traj = traj

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.rollout_batch = copy.deepcopy(self.traj)


def _rollout(model, tok, bm25, examples):
    from lldslight.rewards import ExactMatchReward
    from lldslight.rollout import RolloutConfig, RolloutEngine

    torch.manual_seed(4)
    engine = RolloutEngine(tok, bm25, ExactMatchReward(), RolloutConfig(group_size=4, max_turns=1, max_new_tokens=12,
                                                                       max_obs_tokens=30, max_response_tokens=80, topk=1))
    traj = engine.generate(model, examples)
    traj.reward = torch.linspace(0.0, 1.0, len(traj))  # advantages of both signs: LLDS has preserving rows
    return traj


def _fit_one_step(module, traj):
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[_Inject(traj)])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([0]))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "fp32"])
def test_on_policy_ratio_is_one_and_llds_zero(precision, bm25, protocol_examples):
    """A real step (rollouts from the policy itself, 2 updates, LLDS on every update): on the
    on-policy mini-batch the ratio is exactly 1 and LLDS exactly 0, in bf16 as in fp32; the
    off-policy one moved (the test can tell)."""
    from lldslight.update import objectives as obj
    from lldslight.callbacks import LLDS
    from lldslight.module import GRPOModule

    module = GRPOModule(policy=_config(precision), update=UpdateConfig(kl_coef=0.0, updates_per_rollout=2, micro_batch_size=3, shuffle_minibatches=False), optim=OptimConfig(lr=0.05))
    module.configure_model()
    with torch.no_grad():
        for n, p in module.policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # a non-zero adapter: sampling runs it (bf16) or folds it (fp32)
    traj = _rollout(module.policy, module.tokenizer, bm25, protocol_examples)
    seen = []

    def probe(ctx):
        ratio = torch.exp(ctx.logp.detach() - ctx.old_logp)[ctx.loss_mask]
        penalty, _ = obj.llds_penalty(ctx.logp, ctx.old_logp, ctx.advantage, ctx.loss_mask, ctx.action_id,
                                      ctx.totals.preserving_tokens, "action", None)
        seen.append((ctx.update_index, ratio, float(penalty)))
        return ctx.logp.sum() * 0.0

    module.add_loss_term("probe", probe)
    llds = LLDS(coef=0.5, skip_on_policy=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[_Inject(traj), llds])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([0]))
    first = [s for s in seen if s[0] == 0]
    later = [s for s in seen if s[0] == 1]
    assert first and later
    for _, ratio, penalty in first:
        assert ratio.numel() > 0 and bool((ratio == 1.0).all())
        assert penalty == 0.0
    assert any(bool((ratio != 1.0).any()) for _, ratio, _ in later)


def _independent_mismatch(sampler: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean |log q - log p| and the mean of (p/q - 1) - log(p/q), in numpy float64."""
    q = sampler[mask].double().numpy()
    p = trainer[mask].double().numpy()
    r = np.exp(p - q)
    return float(np.mean(np.abs(q - p))), float(np.mean(r - 1.0 - np.log(r)))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_mismatch_metrics_equal_an_independent_computation(precision, bm25, protocol_examples):
    from lldslight.module import GRPOModule

    module = GRPOModule(policy=_config(precision), update=UpdateConfig(kl_coef=0.0, updates_per_rollout=2, micro_batch_size=6, shuffle_minibatches=False), optim=OptimConfig(lr=1e-3))
    module.configure_model()
    traj = _rollout(module.policy, module.tokenizer, bm25, protocol_examples)
    first = torch.arange(len(traj) // 2)  # the on-policy mini-batch: rows 0..5 (no shuffle), one micro-batch
    sub = traj.select(first)
    module.policy.train()
    with torch.no_grad():  # the weights that sampled, before any update: the trainer's log-probs
        # as the update computes them: a group's shared prompt once (shared_prefix.py), the frozen
        # bottom layers from one pass (frozen_prefix.py); under bf16 the plain path's rounding differs
        # by ~1e-4 relative on a CPU whose matmul blocking depends on the row count (AMX)
        start, _ = frozen_prefix.start_layer(module.policy)
        boundary = None
        if start is not None:
            hidden = frozen_prefix.compute(module.policy, traj.input_ids, traj.attention_mask, traj.group_id, start,
                                           update.micro_batches(module, traj, torch.arange(len(traj))))
            boundary = frozen_prefix.Boundary(hidden[first][:, : sub.input_ids.shape[1]], start)
        trainer_logp, _ = token_logprobs(module.policy, sub.input_ids, sub.attention_mask, sub.loss_mask, groups=sub.group_id,
                                         boundary=boundary)
    want_abs, want_kl = _independent_mismatch(sub.sample_logp, trainer_logp, sub.loss_mask)
    _fit_one_step(module, traj)
    got = module.last_step_metrics
    assert got["rollout/logp_mismatch"] == pytest.approx(want_abs, rel=1e-6, abs=1e-12)
    assert got["rollout/logp_mismatch_kl"] == pytest.approx(want_kl, rel=1e-5, abs=1e-15)
    assert got["rollout/logp_mismatch"] > 0  # a real mismatch, not a vacuous zero
    if precision == "fp32":
        assert got["rollout/logp_mismatch"] < 1e-5  # fp32: rounding only (test_logprobs: max < 1e-4)


@pytest.mark.slow
def test_fsdp2_trains_in_bf16_mixed(tmp_path):
    """Two FSDP2 processes (gloo) through the real CLI with a bf16 base and fp32 adapters in the
    same units: one step runs, the on-policy ratio is 1 and the mismatch is logged."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", "configs/tiny.yaml", "--model.policy.dtype", "null",
           "--model.policy.precision", "bf16-mixed", "--trainer.devices", "2", "--trainer.max_steps", "1",
           "--trainer.strategy", "{class_path: lldslight.policy.distributed.FSDP2Strategy}", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    env = {**__import__("os").environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lldslight: policy.precision bf16-mixed (set in the config)" in proc.stderr
    (row,) = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert float(row["train/ratio_max"]) == 1.0
    assert float(row["rollout/logp_mismatch"]) > 0 and float(row["rollout/logp_mismatch_kl"]) >= 0
