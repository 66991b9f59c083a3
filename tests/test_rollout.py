"""Rollouts of real (tiny) models: mask invariants, token-in/token-out, the ragged KV cache,
continuous batching, rewards from the model's own words."""
import time

import pytest
import torch

from lldslight.update.logprobs import token_logprobs
from lldslight.rewards import ExactMatchReward
from lldslight.rollout import INVALID_ACTION, RolloutConfig, RolloutEngine


def _engine(tok, retriever, **kw):
    cfg = dict(group_size=3, max_turns=2, max_new_tokens=20, max_obs_tokens=80, max_response_tokens=200, topk=2)
    cfg.update(kw)
    return RolloutEngine(tok, retriever, ExactMatchReward(), RolloutConfig(**cfg))


def _check_masks(traj, tok):
    traj.check()
    positions = torch.arange(traj.input_ids.shape[1])
    for b in range(len(traj)):
        p = int(traj.prompt_len[b])
        assert not traj.loss_mask[b, :p].any(), "a prompt token has loss_mask 1"
        # the model tokens, in order, are exactly the ids that were sampled
        model_ids = traj.input_ids[b][traj.loss_mask[b]].tolist()
        assert model_ids == traj.extras["sampled_ids"][b]
        # every run of non-model response tokens is an observation (possibly cut by a budget)
        real = traj.attention_mask[b].bool() & (positions >= p)
        obs_positions = (real & ~traj.loss_mask[b]).nonzero()[:, 0].tolist()
        runs, current = [], []
        for pos in obs_positions:
            if current and pos != current[-1] + 1:
                runs.append(current)
                current = []
            current.append(pos)
        if current:
            runs.append(current)
        for run in runs:
            text = tok.decode(traj.input_ids[b, run].tolist())
            assert text.startswith("\n\n<information>") or INVALID_ACTION.startswith(text) or text.startswith(INVALID_ACTION), text


def test_sampled_rollouts_keep_masks_and_ids(tiny_policy, bm25, protocol_examples):
    model, tok = tiny_policy
    torch.manual_seed(0)
    traj = _engine(tok, bm25).generate(model, protocol_examples)
    assert len(traj) == 3 * len(protocol_examples)
    _check_masks(traj, tok)
    assert (traj.num_invalid > 0).any(), "a random model should produce invalid actions"
    # observation tokens sit between model tokens and are masked out
    assert (traj.action_id.max(dim=1).values >= 1).any()


def test_sampled_logprobs_equal_recomputed(tiny_policy, bm25, protocol_examples):
    model, tok = tiny_policy
    torch.manual_seed(1)
    traj = _engine(tok, bm25).generate(model, protocol_examples)
    model.eval()
    with torch.no_grad():
        logp, _ = token_logprobs(model, traj.input_ids, traj.attention_mask, traj.loss_mask)
    diff = (logp - traj.sample_logp).abs()[traj.loss_mask]
    assert diff.max().item() < 1e-4


def test_protocol_model_searches_and_answers(protocol_model, bm25, protocol_examples):
    model, tok = protocol_model
    traj = _engine(tok, bm25, group_size=1, greedy=True, topk=1, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=400).generate(model, protocol_examples)
    _check_masks(traj, tok)
    assert traj.num_searches.tolist() == [1] * len(protocol_examples)
    assert traj.finish_reason == ["answer"] * len(protocol_examples)
    assert traj.reward.tolist() == [1.0] * len(protocol_examples)
    for b in range(len(traj)):
        # two actions (search, answer) separated by an <information> block
        assert int(traj.num_actions[b]) == 2
        answer_text = tok.decode(traj.input_ids[b][traj.answer_mask[b]].tolist())
        assert answer_text.strip().startswith("<answer>") and "</answer>" in answer_text
        assert protocol_examples[b].golden_answers[0] in answer_text
        assert "<information>" in traj.responses[b]


def test_greedy_cache_matches_full_recompute(protocol_model, bm25, protocol_examples):
    """Each greedy token must be the argmax of a from-scratch forward pass over its context: the
    carried KV cache (prefix sharing, ragged rows, dropped rows) changes nothing the model sees."""
    model, tok = protocol_model
    traj = _engine(tok, bm25, group_size=2, greedy=True, topk=1, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=400).generate(model, protocol_examples)
    with torch.no_grad():
        logits = model(input_ids=traj.input_ids, attention_mask=traj.attention_mask).logits
    pred = logits[:, :-1].argmax(-1)
    target = traj.input_ids[:, 1:]
    mask = traj.loss_mask[:, 1:]
    assert torch.equal(pred[mask], target[mask])


def test_budget_and_turn_limits(tiny_policy, bm25, protocol_examples):
    model, tok = tiny_policy
    torch.manual_seed(2)
    traj = _engine(tok, bm25, max_turns=1, max_new_tokens=5, max_response_tokens=30).generate(model, protocol_examples)
    _check_masks(traj, tok)
    resp_tokens = traj.attention_mask.sum(-1) - traj.prompt_len
    assert (resp_tokens <= 30).all()
    assert (traj.num_actions <= 2).all()
    assert set(traj.finish_reason) <= {"answer", "max_turns", "length"}


def test_retriever_result_count_is_checked(tiny_policy, protocol_examples, protocol_model, bm25):
    model, tok = protocol_model

    class Short:
        def search(self, queries, k):
            return bm25.search(queries, k)[:-1] if len(queries) > 1 else []

    with pytest.raises(RuntimeError, match="result lists"):
        _engine(tok, Short(), group_size=1, greedy=True, max_new_tokens=24).generate(model, protocol_examples)


def test_lora_folding_is_exact_and_restores_weights(tiny_policy):
    """Sampling folds LoRA into the base weights; the outputs must match the adapter path and the
    frozen base (and so the reference policy) must come back bit for bit."""
    from lldslight.policy import sampling_weights

    model, _ = tiny_policy
    model.eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with sampling_weights(model):
            folded = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.allclose(folded, expected, atol=1e-5)
    assert torch.equal(after, expected)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()


# -- the reward sees only the model's own words -----------------------------------------------------


class _Recording:
    """A plug-in reward that keeps what it was given."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, response, golden_answers):
        self.seen.append(response)
        return self.inner(response, golden_answers)


def test_invalid_action_without_answer_scores_nothing(tiny_policy, bm25, protocol_examples):
    """The invalid-action message says "<answer> and </answer>": a rollout that made an invalid
    action and never answered must get EM 0, F1 0 (not 0.5 against "Simon and Garfunkel") and
    the format penalty."""
    import dataclasses

    from lldslight.rewards import F1Reward

    model, tok = tiny_policy
    examples = [dataclasses.replace(e, golden_answers=["Simon and Garfunkel"]) for e in protocol_examples]
    cfg = dict(group_size=3, max_turns=1, max_new_tokens=12, max_response_tokens=120)
    for reward, expected in ((F1Reward(), 0.0), (ExactMatchReward(format_penalty=0.1), -0.1)):
        torch.manual_seed(4)
        recorder = _Recording(reward)
        engine = RolloutEngine(tok, bm25, recorder, RolloutConfig(**dict(cfg, topk=1, max_obs_tokens=80)))
        traj = engine.generate(model, examples)
        assert (traj.num_invalid > 0).sum() >= 3, "the random model should make invalid actions"
        assert any(INVALID_ACTION.strip() in r for r in traj.responses)  # the message is in the context
        assert traj.reward.tolist() == pytest.approx([expected] * len(traj))
        assert traj.em.tolist() == [0.0] * len(traj) and traj.f1.tolist() == [0.0] * len(traj)
        assert not any("<answer>" in t and "</answer>" in t for t in recorder.seen), "the random model never answers"
        for seen, b in zip(recorder.seen, range(len(traj))):
            assert "My previous action is invalid" not in seen and "<information>" not in seen
            assert seen == "".join(tok.decode(ids, skip_special_tokens=True) for ids in _actions(traj, b))


def _actions(traj, b):
    ids, acts = traj.input_ids[b].tolist(), traj.action_id[b].tolist()
    return [[t for t, a in zip(ids, acts) if a == k] for k in range(int(traj.num_actions[b]))]


def test_a_passage_holding_an_answer_tag_never_counts(protocol_model, protocol_examples, synth_kb, tmp_path):
    """A retrieved passage that contains "<answer> GOLD </answer>" is the environment's text, not the
    model's: a rollout that ends right after reading it (response budget) scores 0."""
    import json

    from lldslight.retrieval import BM25Retriever

    model, tok = protocol_model
    golds = {e.golden_answers[0] for e in protocol_examples}
    lines = []
    for line in open(synth_kb["corpus"]):
        doc = json.loads(line)
        hit = [g for g in golds if g in doc["contents"]]
        if hit:  # the tagged gold right after the title, inside the observation's first tokens
            title, _, body = doc["contents"].partition("\n")
            doc["contents"] = f"{title}\n<answer> {hit[0]} </answer> {body}"
        lines.append(json.dumps(doc))
    corpus = tmp_path / "tagged.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    retriever = BM25Retriever(corpus=str(corpus), show_progress=False)
    engine = _engine(tok, retriever, group_size=1, greedy=True, topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=60)
    traj = engine.generate(model, protocol_examples)
    tagged = [b for b in range(len(traj)) if f"<answer> {traj.golden_answers[b][0]} </answer>" in traj.responses[b]]
    assert tagged, "the observation should carry the tagged gold answer"
    for b in tagged:
        assert traj.finish_reason[b] == "length" and int(traj.num_searches[b]) == 1
        assert float(traj.reward[b]) == 0.0 and float(traj.em[b]) == 0.0 and float(traj.f1[b]) == 0.0
        assert not traj.answer_mask[b].any()


# -- continuous batching: no row waits for another, and none is changed by the others -----------------


class _Slow:
    """A real retriever that takes its time: ``delay(queries)`` seconds per call."""

    def __init__(self, inner, delay):
        self.inner, self.delay, self.calls = inner, delay, []

    def search(self, queries, k):
        self.calls.append(list(queries))
        time.sleep(self.delay(queries))
        return self.inner.search(queries, k)


def test_rows_in_different_phases_equal_one_row_at_a_time(protocol_model, bm25, protocol_examples, synth_kb):
    """Greedy rows that decode while others wait on a slow retrieval or prefill their observation
    produce exactly the tokens (and the log-probs, to float precision) each produces alone."""
    from lldslight.data.formats import load_examples

    model, tok = protocol_model
    seen = {e.question for e in protocol_examples}
    extra = [e for e in load_examples(synth_kb["train_jsonl"]) if e.question not in seen][:3]  # unseen: other paths
    examples = list(protocol_examples) + extra
    kw = dict(group_size=1, greedy=True, topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=120, max_response_tokens=400)
    alone = [_engine(tok, bm25, **kw).generate(model, [e]) for e in examples]
    slow_query = alone[0].model_texts[0].split("<search>")[1].split("</search>")[0].strip()
    slow = _Slow(bm25, lambda qs: 1.5 if slow_query in qs else 0.0)
    engine = _engine(tok, slow, **kw)
    traj = engine.generate(model, examples)
    _check_masks(traj, tok)
    assert engine.stats["overlap_steps"] > 0, "rows should have decoded while a retrieval was in flight"
    assert len(slow.calls) >= 2, "rows should have been retrieved for at different times"
    for b, one in enumerate(alone):
        assert traj.extras["sampled_ids"][b] == one.extras["sampled_ids"][0], b
        assert traj.finish_reason[b] == one.finish_reason[0] and int(traj.num_searches[b]) == int(one.num_searches[0])
        mine, theirs = traj.sample_logp[b][traj.loss_mask[b]], one.sample_logp[0][one.loss_mask[0]]
        assert torch.allclose(mine, theirs, atol=1e-4), (mine - theirs).abs().max()
    assert {r for r in traj.finish_reason} >= {"answer"}


def test_sampling_does_not_depend_on_scheduling(protocol_model, bm25, protocol_examples):
    """Each row draws from its own random stream: a slow retriever with random delays reorders when
    rows decode, prefill and search, and every sampled token stays the same.

    In float64: a row's logits depend on which rows share its batch by float rounding (the matmul's
    blocking follows the batch size), and in float32 that ~1e-7 can move a uniform across an
    inverse-CDF boundary once in a few thousand tokens (seen once: adjacent token ids, 30030 vs
    30031). In float64 the rounding is ~1e-16, so a differing token means a differing stream."""
    import copy
    import random

    model, tok = protocol_model
    model = copy.deepcopy(model).double()
    kw = dict(group_size=3, topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=120, max_response_tokens=400)
    torch.manual_seed(5)
    fast = _engine(tok, bm25, **kw).generate(model, protocol_examples)
    rng = random.Random(0)
    slow = _Slow(bm25, lambda qs: rng.choice([0.0, 0.3, 0.8]))
    torch.manual_seed(5)
    engine = _engine(tok, slow, **kw)
    again = engine.generate(model, protocol_examples)
    assert int(fast.num_searches.sum()) >= 3 and len(slow.calls) >= 2
    assert engine.stats["overlap_steps"] > 0, "the delays should have reordered the rows' work"
    assert again.extras["sampled_ids"] == fast.extras["sampled_ids"]
    assert torch.allclose(again.sample_logp, fast.sample_logp, atol=1e-4)


def test_inverse_cdf_sampling_follows_the_distribution(tiny_policy):
    """Frequencies of the engine's sampler against torch.softmax (independent), with temperature,
    top-k and top-p: filtered tokens are never drawn, the rest in proportion."""
    _, tok = tiny_policy
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(40000, 1)
    for kw in ({}, {"temperature": 0.5}, {"top_k": 3}, {"top_p": 0.8, "temperature": 2.0}):
        engine = RolloutEngine(tok, None, ExactMatchReward(), RolloutConfig(**kw))
        torch.manual_seed(0)
        tokens, logp = engine.sample(logits.clone(), torch.rand(len(logits), dtype=torch.float64))
        scaled = logits[0] / kw.get("temperature", 1.0)
        probs = torch.softmax(scaled, -1)
        assert torch.allclose(logp, probs.log()[tokens], atol=1e-5)  # log-probs of the unfiltered softmax
        allowed = torch.ones(6, dtype=torch.bool)
        if "top_k" in kw:
            allowed[kw["top_k"]:] = False
        if "top_p" in kw:  # the smallest prefix of the sorted probabilities reaching top_p
            allowed = torch.cat([torch.tensor([True]), probs.cumsum(-1)[:-1] < kw["top_p"]])
        target = torch.where(allowed, probs, 0.0)
        target = target / target.sum()
        freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
        assert torch.allclose(freq, target, atol=0.01), (kw, freq, target)
        assert freq[~allowed].sum() == 0


def test_attention_without_custom_masks_is_refused(tiny_policy, bm25, protocol_examples):
    """The ragged cache needs 4-D masks: an attention that cannot take them is named, not misused."""
    model, tok = tiny_policy
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="flash_attention_2"):
            _engine(tok, bm25).generate(model, protocol_examples)
    finally:
        config._attn_implementation = before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [2, 0]])
def test_ragged_cache_writes_each_row_at_its_own_position(dtype, rows):
    """The cache's write (index_put, for every slot or some) against a hand-written loop: token j of
    slot s lands at position at[b, j] of that slot and nowhere else; the returned keys are the
    slots' first kv_len positions."""
    from lldslight.rollout.cache import RaggedCache

    S, H, D = 3, 2, 4
    cache = RaggedCache()
    cache.prepare(torch.tensor([[0, 1], [0, 1], [0, 1]]), None, 2)
    first = torch.randn(S, H, 2, D).to(dtype)
    cache.update(first, -first, 0)
    slots = list(range(S)) if rows is None else rows
    at = torch.tensor([[2 + b] for b in range(len(slots))])  # [B, 1]: each row at its own length
    cache.prepare(at, None if rows is None else torch.tensor(rows), 2 + len(slots))
    new = torch.randn(len(slots), H, 1, D).to(dtype)
    k, v = cache.update(new, -new, 0)
    want = torch.zeros(S, H, cache.capacity, D, dtype=dtype)
    want[:, :, :2] = first
    for b, s in enumerate(slots):
        want[s, :, int(at[b, 0])] = new[b, :, 0]
    assert torch.equal(cache.k[0], want) and torch.equal(cache.v[0], -want)
    assert torch.equal(k, want[slots, :, : 2 + len(slots)]) and torch.equal(v, -want[slots, :, : 2 + len(slots)])
