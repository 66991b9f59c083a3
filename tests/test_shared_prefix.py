"""Shared-prefix updates (lldslight/update/shared_prefix.py): a group's common prompt encoded once gives the
log-probs and EVERY trainable gradient of the plain forward, on multi-turn rows whose observations
differ after the prompt, with LoRA and full fine-tuning, with and without activation checkpointing;
and the packed forward really encodes each shared prefix once (its tokens are counted).

Two references: lldslight's own plain path (``groups=None``: right-padded rows, each in full;
the same vocabulary projection, so the comparison isolates the attention split), and transformers'
plain forward (full logits, log_softmax, gather: no lldslight code at all).

The bound: fp32, relative 1e-5. The two forwards compute the same sums in different orders (other
matmul shapes, the attention's keys split over two kernels), so each value differs by a few fp32
roundings (2^-24 ~ 6e-8 relative) per accumulation; 1e-5 leaves two orders of magnitude.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_policy_config
from lldslight.update import shared_prefix
from lldslight.update.logprobs import token_logprobs
from lldslight.policy import load_policy

REL = 1e-5

# Three groups of multi-turn rows, right-padded: prompt, first action, an observation (not model
# tokens), a second action. Group 0: three rows, two of which also begin their first action alike
# (their common prefix runs past the prompt: longest common prefix found from the ids, not assumed),
# observations of different lengths. Group 1: two rows. Group 2: one row (nothing to share).
PROMPTS = {0: 11, 1: 8, 2: 7}
ROWS = [  # (group, first action, observation, second action), in tokens
    (0, 5, 4, 3),
    (0, 5, 6, 2),
    (0, 4, 0, 0),  # answers at once
    (1, 6, 3, 4),
    (1, 3, 5, 5),
    (2, 4, 2, 2),
]
SAME_START = (0, 1, 2)  # rows 0 and 1 share their first 2 action tokens


def hand_built(vocab: int = 1000, seed: int = 0):
    """input_ids, attention_mask, loss_mask [B, T] and group ids [B] of ROWS; also the expected
    shared prefix length of each group (worked out by hand from the construction)."""
    g = torch.Generator().manual_seed(seed)
    prompts = {k: torch.randint(10, vocab, (n,), generator=g) for k, n in PROMPTS.items()}
    common_start = torch.randint(10, vocab, (2,), generator=g)
    rows, model_tokens = [], []
    for i, (group, act1, obs, act2) in enumerate(ROWS):
        a1 = torch.randint(10, vocab, (act1,), generator=g)
        if i in SAME_START[:2]:
            a1[:2] = common_start
        elif i == SAME_START[2]:
            a1[0] = (common_start[0] + 1) % vocab  # differs at the first action token
        parts = [prompts[group], a1, torch.randint(10, vocab, (obs,), generator=g), torch.randint(10, vocab, (act2,), generator=g)]
        kinds = [False, True, False, True]
        rows.append(torch.cat(parts))
        model_tokens.append(torch.cat([torch.full((len(p),), k) for p, k in zip(parts, kinds)]))
    B, T = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (r, m) in enumerate(zip(rows, model_tokens)):
        ids[b, : len(r)], attn[b, : len(r)], loss_mask[b, : len(r)] = r, 1, m
    groups = torch.tensor([r[0] for r in ROWS])
    # group 0: its prompt (row 2's first action token differs from rows 0 and 1's); group 1: its
    # prompt (random first action tokens: checked below); group 2: alone
    expected = {0: PROMPTS[0], 1: PROMPTS[1], 2: 0}
    assert ids[3, PROMPTS[1]] != ids[4, PROMPTS[1]], "the seed gave group 1 a common first action token"
    return ids, attn, loss_mask, groups, expected


def policy(lora: bool, checkpointing=False, **overrides):
    cfg = dataclasses.replace(tiny_policy_config(lora=lora), gradient_checkpointing=checkpointing, **overrides)
    model, _ = load_policy(cfg)
    model.train()
    with torch.no_grad():  # a LoRA adapter that is not zero: every adapter weight gets a gradient
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def weights(shape, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def lldslight_path(model, ids, attn, mask, groups, temperature=1.0):
    """Log-probs, entropies and the gradient of sum(w * logp) + sum(v * entropy) for every trainable
    parameter, through token_logprobs (``groups``: shared prefix; None: the plain path)."""
    params = [p for p in model.parameters() if p.requires_grad]
    logp, ent = token_logprobs(model, ids, attn, mask, with_entropy=True, temperature=temperature, groups=groups)
    w, v = weights(ids.shape)
    grads = torch.autograd.grad((w * logp).sum() + (v * ent).sum(), params)
    return logp.detach(), ent.detach(), grads


def transformers_path(model, ids, attn, mask, temperature=1.0):
    """The same through transformers' plain forward: full logits, log_softmax, gather."""
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    m = mask.bool().clone()
    m[:, 0] = False
    pad = torch.zeros(ids.shape[0], 1)
    logp = torch.cat([pad, logp_all.gather(-1, ids[:, 1:, None])[..., 0]], 1) * m
    ent = torch.cat([pad, -(logp_all.exp() * logp_all).sum(-1)], 1) * m
    w, v = weights(ids.shape)
    grads = torch.autograd.grad((w * logp).sum() + (v * ent).sum(), params)
    return logp.detach(), ent.detach(), grads


def assert_close(got, want, what: str, rel: float = REL) -> None:
    """Values within ``rel`` of the reference's scale: per tensor, max |got - want| <= rel * max |want|."""
    logp, ent, grads = got
    logp_w, ent_w, grads_w = want
    assert (logp - logp_w).abs().max() <= rel * logp_w.abs().max(), (what, "log-probs", float((logp - logp_w).abs().max()))
    assert (ent - ent_w).abs().max() <= rel * ent_w.abs().max(), (what, "entropies", float((ent - ent_w).abs().max()))
    assert len(grads) == len(grads_w) and grads
    for i, (a, b) in enumerate(zip(grads, grads_w)):
        scale = b.abs().max()
        assert scale > 0, (what, f"parameter {i} has no gradient: the comparison would be vacuous")
        assert (a - b).abs().max() <= rel * scale, (what, f"gradient of parameter {i}", float((a - b).abs().max() / scale))


@pytest.mark.parametrize("lora, checkpointing", [(True, False), (False, False), (True, True), (False, "auto")])
def test_shared_prefix_gives_the_plain_logprobs_and_every_gradient(lora, checkpointing):
    model = policy(lora, checkpointing)
    ids, attn, mask, groups, _ = hand_built()
    shared = lldslight_path(model, ids, attn, mask, groups, temperature=0.7)
    assert_close(shared, lldslight_path(model, ids, attn, mask, None, temperature=0.7), "vs the plain path")
    assert_close(shared, transformers_path(model, ids, attn, mask, temperature=0.7), "vs transformers' forward")
    trainable = [p for p in model.parameters() if p.requires_grad]
    # every trainable tensor compared: the adapter's (2 per adapted linear), or every weight
    assert len(shared[2]) == len(trainable) == (2 * 7 * 2 if lora else len(list(model.parameters())))


def test_shared_prefix_on_real_multi_turn_rollouts(tiny_policy, bm25, protocol_examples):
    """Rollouts from the engine (G = 4, observations after invalid actions, rows of different
    lengths): the shared path equals the plain one."""
    from test_logprobs import _rollouts

    model, tok = tiny_policy
    torch.manual_seed(3)
    _, traj = _rollouts(model, tok, bm25, protocol_examples, False, max_turns=2)
    assert traj.num_actions.max() > 1, "the test must exercise observations after the prompt"
    layout = shared_prefix.pack_groups(traj.input_ids, traj.attention_mask, traj.group_id)
    assert layout is not None and layout.tokens < int(traj.attention_mask.sum())
    model.train()
    shared = lldslight_path(model, traj.input_ids, traj.attention_mask, traj.loss_mask, traj.group_id)
    plain = lldslight_path(model, traj.input_ids, traj.attention_mask, traj.loss_mask, None)
    grads = [g for g in plain[2] if g.abs().max() > 0]  # a zero-initialised LoRA B leaves A without gradient
    assert grads, "no gradient: the comparison would be vacuous"
    keep = [i for i, g in enumerate(plain[2]) if g.abs().max() > 0]
    assert all(shared[2][i].abs().max() == 0 for i in range(len(plain[2])) if i not in keep)
    assert_close((shared[0], shared[1], [shared[2][i] for i in keep]), (plain[0], plain[1], grads), "real rollouts")
    model.eval()


def test_the_packed_forward_encodes_each_shared_prefix_once():
    """Count the tokens the decoder's embedding sees: the rows' real tokens minus, per group of k
    rows with a shared prefix of P tokens, (k - 1) x P, with P worked out by hand."""
    model = policy(lora=True)
    ids, attn, mask, groups, expected = hand_built()
    seen = []
    embed = model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        with torch.no_grad():
            token_logprobs(model, ids, attn, mask, groups=groups)
            token_logprobs(model, ids, attn, mask)
    finally:
        hook.remove()
    lengths = attn.sum(-1)
    rows_per_group = {g: int((groups == g).sum()) for g in expected}
    want = int(lengths.sum()) - sum((rows_per_group[g] - 1) * p for g, p in expected.items())
    assert seen == [want, ids.numel()], (seen, want)
    shared = shared_prefix.common_prefix_lengths(ids, lengths, groups)
    assert shared.tolist() == [expected[int(g)] for g in groups]


def test_common_prefix_is_found_from_the_ids_and_capped():
    """Past the prompt when rows begin alike; never a whole row (each row keeps a token of its own);
    0 for a row alone or rows that differ at once."""
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 7, 9, 1], [5, 6, 7, 0, 0], [3, 4, 0, 0, 0], [4, 4, 0, 0, 0], [9, 9, 9, 0, 0]])
    lengths = torch.tensor([5, 5, 3, 2, 2, 3])
    groups = torch.tensor([0, 0, 1, 2, 2, 3])
    assert shared_prefix.common_prefix_lengths(ids, lengths, groups).tolist() == [3, 3, 0, 0, 0, 0]
    groups = torch.tensor([0, 0, 0, 2, 2, 3])  # row 2 (3 tokens) caps group 0 at 2
    assert shared_prefix.common_prefix_lengths(ids, lengths, groups).tolist() == [2, 2, 2, 0, 0, 0]


def test_rows_that_share_nothing_run_packed_without_padding():
    """Every row its own group: no prefix is shared, but the padding is dropped (a token budget
    counts these tokens); the same log-probs and gradients."""
    model = policy(lora=False)
    ids, attn, mask, _, _ = hand_built()
    alone = torch.arange(len(ids))
    layout = shared_prefix.pack_groups(ids, attn, alone)
    assert layout is not None and layout.tokens == int(attn.sum()) < ids.numel() and layout.prefix_index.shape[1] == 0
    assert_close(lldslight_path(model, ids, attn, mask, alone), lldslight_path(model, ids, attn, mask, None), "no sharing")
    full = attn[:, :1].expand(-1, 5)  # no padding, nothing shared: nothing to save
    assert shared_prefix.pack_groups(ids[:, :5], full, alone) is None


def test_plain_forward_where_sharing_cannot_apply():
    """Eager attention, left-padded rows: the plain forward (B x T tokens); an eager policy's
    micro-batches are cut as without sharing."""
    from lldslight.module import GRPOModule
    from lldslight.update import UpdateConfig
    from lldslight.update.train import micro_batches

    ids, attn, mask, groups, _ = hand_built()
    assert shared_prefix.pack_groups(ids, attn.flip(-1), groups) is None  # not right-padded
    eager = policy(lora=True, attn_implementation="eager")
    assert not shared_prefix.supported(eager) and shared_prefix.supported(policy(lora=True))
    seen = []
    hook = eager.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    with torch.no_grad():
        token_logprobs(eager, ids, attn, mask, groups=groups)
    hook.remove()
    assert seen == [ids.numel()]
    module = GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(micro_batch_size=2, micro_batch_tokens=40))
    traj = type("Rows", (), {"input_ids": ids, "attention_mask": attn, "group_id": groups})()
    module.policy = eager  # the plain packer: sorted by length, rows x longest <= 40
    for b in micro_batches(module, traj, torch.arange(len(ids))):
        assert len(b) == 1 or len(b) * int(attn[b].sum(-1).max()) <= 40


def test_a_call_without_the_layout_is_transformers_sdpa():
    """The registered "sdpa" passes a plain call through to transformers' own function, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = policy(lora=True)
    ids, attn, mask, groups, _ = hand_built()
    with torch.no_grad():
        token_logprobs(model, ids, attn, mask, groups=groups)  # installs it
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is shared_prefix._attention
        via = model(input_ids=ids, attention_mask=attn).logits
        from transformers import AttentionInterface

        AttentionInterface.register("sdpa", sdpa_attention_forward)
        try:
            direct = model(input_ids=ids, attention_mask=attn).logits
        finally:
            AttentionInterface.register("sdpa", shared_prefix._attention)
    assert torch.equal(via, direct)


@pytest.mark.parametrize("budget", [None, 40, 25])
def test_micro_batches_keep_groups_together_within_the_budget(budget):
    ids, attn, mask, groups, _ = hand_built()
    rows = torch.tensor([4, 0, 5, 2, 3, 1])  # a shuffled mini-batch
    batches = shared_prefix.micro_batches(ids, attn, groups, rows, size=4, budget=budget)
    order = torch.cat(batches)
    assert sorted(order.tolist()) == sorted(rows.tolist())  # every row exactly once
    # groups adjacent, in order of first appearance: 1 1 0 0 0 2
    assert groups[order].tolist() == [1, 1, 0, 0, 0, 2]
    lengths = attn.sum(-1)
    for b in batches:
        if budget is None:
            assert len(b) <= 4
            continue
        layout = shared_prefix.pack_groups(ids[b], attn[b], groups[b])
        tokens = layout.tokens if layout is not None else int(lengths[b].sum())
        assert len(b) == 1 or tokens <= budget, (b, tokens)
    if budget == 40:  # fills up: group 1's 2 rows share 8 prompt tokens (18 + 21 - 8 = 31 <= 40)
        assert [len(b) for b in batches][0] == 2


def test_bf16_shared_prefix_is_close_to_the_plain_path():
    """bf16-mixed: both paths round to bf16 in different orders; they agree to bf16's precision
    (2^-8 relative per rounding), here within 5e-2 nats per token and 5e-2 of each gradient's scale."""
    model = policy(lora=True, precision="bf16-mixed", dtype=None)
    ids, attn, mask, groups, _ = hand_built()
    assert_close(lldslight_path(model, ids, attn, mask, groups), lldslight_path(model, ids, attn, mask, None), "bf16", rel=5e-2)


def test_every_no_grad_pass_of_the_module_shares_and_agrees():
    """GRPOModule.batch_logprobs, what pi_old's and the reference's passes and LLDMonitor's
    after-step forward call: micro-batches of 4 rows from a shuffled order, each group's rows kept
    together; policy and reference (the adapter off) log-probs equal with shared_prefix on and off,
    and the shared run's forwards see fewer tokens."""
    from lldslight.module import GRPOModule
    from lldslight.update import UpdateConfig
    from lldslight.trajectory import Trajectory

    ids, attn, mask, groups, _ = hand_built()
    B = len(ids)
    traj = Trajectory(
        input_ids=ids, attention_mask=attn, prompt_len=torch.tensor([PROMPTS[g] for g in groups.tolist()]), loss_mask=mask,
        action_id=torch.where(mask, 0, -1), answer_mask=torch.zeros_like(mask), group_id=groups, reward=torch.zeros(B),
        num_searches=torch.zeros(B, dtype=torch.long), num_invalid=torch.zeros(B, dtype=torch.long),
        num_actions=torch.ones(B, dtype=torch.long), finish_reason=["answer"] * B, data_source=["t"] * B, responses=[""] * B,
    )
    traj.check()
    model = policy(lora=True)
    rows = torch.tensor([5, 3, 0, 4, 1, 2])
    out, seen = {}, {}
    for on in (True, False):
        module = GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(micro_batch_size=4, shared_prefix=on))
        module.policy = model
        counts = []
        hook = model.get_input_embeddings().register_forward_hook(lambda m, args, o: counts.append(args[0].numel()))
        try:
            out[on] = [module.batch_logprobs(traj, reference=ref, rows=rows) for ref in (False, True)]
        finally:
            hook.remove()
        seen[on] = sum(counts)
    for got, want in zip(out[True], out[False]):
        assert (got - want).abs().max() <= REL * want.abs().max()
    assert not torch.equal(out[True][0], out[True][1])  # the adapter is not zero: the reference differs
    assert seen[True] < seen[False]


def test_the_split_attention_count_survives_fsdp2s_copies_of_its_arguments():
    """FSDP2's mixed precision passes each layer's keyword arguments through
    torch.distributed.utils._apply_to_tensors, which re-creates dataclasses (dataclasses.replace):
    a count kept in a plain field would be counted on the copies and read 0 on the original."""
    from torch.distributed.utils import _apply_to_tensors

    ids, attn, _, groups, _ = hand_built()
    layout = shared_prefix.pack_groups(ids, attn, groups)
    copy = _apply_to_tensors(lambda t: t.clone(), layout)
    assert copy is not layout and copy.row_index is not layout.row_index  # a real copy, as FSDP2 makes
    copy.calls.n += 1
    assert layout.calls.n == 1
