"""The speed-ups (docs/speed.md) change no number: chunked log-probs, the rollout's KV cache (growing
buffer, rows leaving mid-turn), on-policy old log-probs, micro-batches packed by tokens."""
import copy

import lightning.pytorch as pl
import pytest
import torch

from conftest import tiny_policy_config
from lldslight.update.logprobs import token_logprobs
from lldslight.rewards import ExactMatchReward
from lldslight.rollout import RolloutConfig, RolloutEngine
from lldslight.update.optim import OptimConfig
from lldslight.update import UpdateConfig


def _full_logits_logprobs(model, ids, attn, mask, temperature=1.0):
    """The plain computation: full [B, T, V] logits, log_softmax, gather."""
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.bool().clone()
    m[:, 0] = False
    pad = torch.zeros(ids.shape[0], 1)
    return torch.cat([pad, logp], 1) * m, torch.cat([pad, entropy], 1) * m


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_logits(tiny_policy, temperature):
    model, tok = tiny_policy
    model.eval()
    torch.manual_seed(0)
    ids = torch.randint(0, len(tok), (3, 17))
    attn = torch.ones_like(ids)
    attn[1, 12:] = 0  # right padding
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5:] = True
    mask &= attn.bool()
    with torch.no_grad():
        want_lp, want_ent = _full_logits_logprobs(model, ids, attn, mask, temperature)
        # chunk_size 7: several chunks, the last one partial
        got_lp, got_ent = token_logprobs(model, ids, attn, mask, chunk_size=7, temperature=temperature, with_entropy=True)
    assert (got_lp - want_lp).abs().max().item() < 1e-5
    # entropy sums 49k terms of size ~10: 1e-5 relative is the float32 rounding of that sum
    assert (got_ent - want_ent).abs().max().item() < 1e-5 * max(1.0, want_ent.abs().max().item())
    assert (got_lp[~mask] == 0).all()
    # With gradients, the values and the gradient (of log-probs and of an entropy bonus) match
    # the plain computation.
    model.train()
    got, got_ent = token_logprobs(model, ids, attn, mask, chunk_size=7, temperature=temperature, with_entropy=True)
    want, want_ent = _full_logits_logprobs(model, ids, attn, mask, temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad(got.sum() + 0.3 * got_ent.sum(), params)
    g_want = torch.autograd.grad(want.sum() + 0.3 * want_ent.sum(), params)
    assert (got - want).abs().max().item() < 1e-5
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    model.eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", ["none", "logged", "loss"])
@pytest.mark.parametrize("backward", ["input", "recompute"])
def test_fused_logprob_values_and_gradients_equal_float64_log_softmax(temperature, entropy, backward):
    """ChunkedLogprob (fp32, 37 positions in chunks of 8, the last one partial) against full
    float64 logits -> log_softmax -> gather, and -sum p log p: values and the gradient of a loss
    weighting each position's log-prob (and entropy, when it has a gradient) differently.
    "recompute" (a trainable head) also gives the weight's and the bias's gradients."""
    from lldslight.update.logprobs import ChunkedLogprob

    g = torch.Generator().manual_seed(0)
    n, H, V = 37, 16, 301
    h = torch.randn(n, H, generator=g).requires_grad_()
    W = torch.randn(V, H, generator=g).requires_grad_(backward == "recompute")
    b = torch.randn(V, generator=g).requires_grad_(backward == "recompute")
    y = torch.randint(0, V, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    logp, ent = ChunkedLogprob.apply(h, W, b, y, temperature, 8, entropy, backward)
    inputs = [h, W, b] if backward == "recompute" else [h]
    loss = (logp * w_lp.float()).sum() + ((ent * w_ent.float()).sum() if entropy == "loss" else 0.0)
    grads = torch.autograd.grad(loss, inputs)

    ref_in = [x.detach().double().requires_grad_() for x in (h, W, b)]
    logp_all = torch.log_softmax((ref_in[0] @ ref_in[1].T + ref_in[2]) / temperature, -1)
    ref_logp = logp_all.gather(-1, y[:, None])[:, 0]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ref_loss = (ref_logp * w_lp).sum() + ((ref_ent * w_ent).sum() if entropy == "loss" else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, ref_in[: len(inputs)])

    assert (logp.double() - ref_logp).abs().max() < 2e-5
    if entropy == "none":
        assert (ent == 0).all()
    else:
        assert (ent.double() - ref_ent).abs().max() < 2e-5
        assert ent.requires_grad == (entropy == "loss")
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()


def test_update_backward_computes_no_logits_and_the_forward_each_chunk_once(tiny_policy):
    """LoRA leaves the output projection frozen: d log p / d h is formed in the forward, so the
    backward runs no [chunk, V] matmul at all (neither a recomputed forward nor anything else),
    and the forward projects each chunk once, entropy included. Counted as matmuls whose output
    has V columns."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, tok = tiny_policy
    V = model.get_output_embeddings().weight.shape[0]

    class CountLogits(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == V:
                CountLogits.calls += 1
            return out

    model.train()
    ids = torch.randint(0, len(tok), (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with CountLogits():
        logp, entropy = token_logprobs(model, ids, torch.ones_like(ids), mask, chunk_size=7, with_entropy=True, entropy_grad=False)
        forward = CountLogits.calls
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    chunks = -(-int(mask[:, 1:].sum()) // 7)
    assert forward == chunks and entropy[:, 1:].gt(0).all()  # once per chunk, entropy on every token
    assert CountLogits.calls == forward, f"the backward computed logits ({CountLogits.calls - forward} matmuls)"


def test_update_memory_is_bounded_by_a_chunk_not_by_the_batch(tiny_policy):
    """600 loss positions at SmolLM2's 49k vocabulary: [600, V] fp32 logits are 118 MB. With the
    library's default chunking (32 MiB of fp32 logits per chunk), the live tensors of the forward
    (entropy logged) and backward stay within three such chunk buffers. Measured independently of the code: every tensor storage
    created during the step, counted until it is freed."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    chunk_bytes = 32 * 2**20  # logprobs.CHUNK_BYTES

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()

        def _free(self, key, n):
            self.live -= n
            self.seen.discard(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key in self.seen or key in params or storage.nbytes() == 0:
                        continue  # a view of something counted, or a weight (F.linear's W^T)
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
            return out

    model, tok = tiny_policy
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    V = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, len(tok), (3, 201), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    full = 600 * V * 4
    model.train()
    with LiveBytes() as tracker:
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), mask, with_entropy=True, entropy_grad=False)
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    assert full > 3 * chunk_bytes  # the bound below separates chunked from whole-batch logits
    assert tracker.peak <= 3 * chunk_bytes, f"peak {tracker.peak / 2**20:.0f} MiB of live tensors; [n, V] is {full / 2**20:.0f} MiB"


def _rollouts(model, tok, retriever, examples, many_stops: bool, **kw):
    cfg = dict(group_size=4, max_turns=2, max_new_tokens=16, max_obs_tokens=40, max_response_tokens=160, topk=2)
    cfg.update(kw)
    engine = RolloutEngine(tok, retriever, ExactMatchReward(), RolloutConfig(**cfg))
    if many_stops:
        # One token id in five ends a turn: rows stop at scattered steps, so rows that are done
        # leave the decode batch mid-turn (the cache is compacted) while others keep decoding.
        engine.eos_ids = list(range(0, len(tok), 5))
    return engine, engine.generate(model, examples)


@pytest.mark.parametrize("many_stops", [False, True])
def test_sampled_logprobs_equal_recomputed_on_real_rollouts(tiny_policy, bm25, protocol_examples, many_stops):
    model, tok = tiny_policy
    torch.manual_seed(3)
    engine, traj = _rollouts(model, tok, bm25, protocol_examples, many_stops, max_turns=0 if many_stops else 2)
    traj.check()
    if many_stops:
        assert engine.stats["compactions"] > 0, "the test must exercise rows leaving the batch mid-turn"
    else:
        assert traj.num_actions.max() > 1, "the test must exercise observations fed into the cache"
    model.eval()
    with torch.no_grad():
        logp, _ = token_logprobs(model, traj.input_ids, traj.attention_mask, traj.loss_mask)
    diff = (logp - traj.sample_logp).abs()[traj.loss_mask]
    assert diff.numel() > 0
    assert diff.max().item() < 1e-4


def test_greedy_tokens_are_argmax_of_full_recompute(tiny_policy, bm25, protocol_examples):
    """Greedy decoding through the ragged cache, continuous batching and compaction picks, at every
    model token, the argmax of a from-scratch forward over the same context."""
    model, tok = tiny_policy
    engine, traj = _rollouts(model, tok, bm25, protocol_examples, True, greedy=True, group_size=2, max_turns=1)
    with torch.no_grad():
        logits = model(input_ids=traj.input_ids, attention_mask=traj.attention_mask).logits
    mask = traj.loss_mask[:, 1:]
    assert torch.equal(logits[:, :-1].argmax(-1)[mask], traj.input_ids[:, 1:][mask])


# -- the update: on-policy old log-probs and token-packed micro-batches change no gradient ----------


class _Inject(pl.Callback):
    def __init__(self, traj):
        self.traj = traj

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.rollout_batch = copy.deepcopy(self.traj)


def _first_update_grads(traj, **module_kw) -> dict[str, torch.Tensor]:
    from lldslight.module import GRPOModule

    module = GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(kl_coef=0.05, shuffle_minibatches=False, **module_kw), optim=OptimConfig(lr=1e-3))
    grads: dict[str, torch.Tensor] = {}

    def grab(ctx):  # a step gate sees the accumulated gradient; vetoing keeps the weights as they are
        if ctx.update_index == 0:
            grads.update({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        return False

    module.add_step_gate("grab", grab)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_Inject(traj)],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([0]))
    assert grads, "no gradient was captured"
    return grads


@pytest.fixture(scope="module")
def fixed_rollout(tiny_policy, bm25, protocol_examples):
    model, tok = tiny_policy
    torch.manual_seed(4)
    _, traj = _rollouts(model, tok, bm25, protocol_examples, True, group_size=3, max_turns=1)
    traj.reward = torch.linspace(0.0, 1.0, len(traj))  # non-zero advantages in every group
    assert len(set(traj.attention_mask.sum(-1).tolist())) > 2, "rows of different lengths: packing has work to do"
    return traj


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_packed_micro_batches_give_the_whole_batch_gradient(fixed_rollout, aggregation):
    n = len(fixed_rollout)
    whole = _first_update_grads(fixed_rollout, aggregation=aggregation, micro_batch_size=n, reuse_onpolicy_logp=False)
    longest = int(fixed_rollout.attention_mask.sum(-1).max())
    variants = {
        "rows": dict(micro_batch_size=2),
        "tokens": dict(micro_batch_tokens=2 * longest),
        "on-policy reuse": dict(micro_batch_size=2, reuse_onpolicy_logp=True),
    }
    for name, kw in variants.items():
        kw.setdefault("reuse_onpolicy_logp", False)
        got = _first_update_grads(fixed_rollout, aggregation=aggregation, **kw)
        assert got.keys() == whole.keys()
        for key in whole:
            assert torch.allclose(got[key], whole[key], atol=1e-6, rtol=1e-4), f"{name}: gradient of {key} differs"


def test_token_packing_groups_rows_by_length(fixed_rollout):
    from lldslight.module import GRPOModule
    from lldslight.update import UpdateConfig
    from lldslight.update.train import micro_batches

    module = GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(micro_batch_tokens=100, shared_prefix=False))  # shared: test_shared_prefix.py
    rows = torch.arange(len(fixed_rollout))
    batches = micro_batches(module, fixed_rollout, rows)
    lengths = fixed_rollout.attention_mask.sum(-1)
    assert sorted(torch.cat(batches).tolist()) == rows.tolist()  # every row exactly once
    for b in batches:
        assert len(b) == 1 or len(b) * int(lengths[b].max()) <= 100
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(micro_batch_tokens=0))
