"""The speed-ups of issue 6 change no number: chunked log-probs, the rollout's KV cache (growing
buffer, rows leaving mid-turn), on-policy old log-probs, micro-batches packed by tokens."""
import copy

import lightning.pytorch as pl
import pytest
import torch

from conftest import tiny_policy_config
from lldslight.logprobs import token_logprobs
from lldslight.rewards import ExactMatchReward
from lldslight.rollout import RolloutConfig, RolloutEngine


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
    # With gradients (checkpointed chunks), the values and the gradient match the plain computation.
    model.train()
    got, _ = token_logprobs(model, ids, attn, mask, chunk_size=7, temperature=temperature)
    want, _ = _full_logits_logprobs(model, ids, attn, mask, temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad(got.sum(), params)
    g_want = torch.autograd.grad(want.sum(), params)
    assert (got - want).abs().max().item() < 1e-5
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    model.eval()


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

    module = GRPOModule(policy=tiny_policy_config(), lr=1e-3, kl_coef=0.05, shuffle_minibatches=False, **module_kw)
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
    from lldslight.update import micro_batches

    module = GRPOModule(policy=tiny_policy_config(), micro_batch_tokens=100)
    rows = torch.arange(len(fixed_rollout))
    batches = micro_batches(module, fixed_rollout, rows)
    lengths = fixed_rollout.attention_mask.sum(-1)
    assert sorted(torch.cat(batches).tolist()) == rows.tolist()  # every row exactly once
    for b in batches:
        assert len(b) == 1 or len(b) * int(lengths[b].max()) <= 100
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        GRPOModule(policy=tiny_policy_config(), micro_batch_tokens=0)


def test_logged_entropy_is_computed_once_not_again_in_the_checkpointed_backward(tiny_policy):
    """The entropy is logged on every training forward; with no entropy bonus it has no graph,
    and the backward, which recomputes each checkpointed chunk of the vocabulary projection, must
    not compute it again (nor rely on checkpointing's early stop to skip it). Counted as the
    softmax exponentials the entropy needs (log_softmax's own backward uses none)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import set_checkpoint_early_stop

    class CountExp(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.exp.default:
                CountExp.calls += 1
            return func(*args, **(kwargs or {}))

    model, tok = tiny_policy
    model.train()
    ids = torch.randint(0, len(tok), (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with set_checkpoint_early_stop(False), CountExp():
        logp, entropy = token_logprobs(model, ids, torch.ones_like(ids), mask, chunk_size=7, with_entropy=True, entropy_grad=False)
        forward = CountExp.calls
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    chunks = -(-int(mask[:, 1:].sum()) // 7)
    assert forward == chunks and entropy[:, 1:].gt(0).all()  # once per chunk, on every token
    assert CountExp.calls == forward, f"the backward computed the entropy again ({CountExp.calls - forward} more exp calls)"
