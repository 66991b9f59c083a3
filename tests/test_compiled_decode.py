"""The compiled decode step (rollout.compile_decode, lldslight/rollout/compiled.py) against the
eager engine on the same multi-turn rollouts of a real tiny model (fp32): the same greedy tokens,
the same sampled tokens under one seed, weight updates followed without recompiling; and the
fallback to eager when torch.compile fails, said once.

The compiled step is compiled once per process (the first test that runs it pays ~1 min on a
2-core CPU; the others reuse it), so the module is marked slow."""
from __future__ import annotations

import pytest
import torch

from lldslight.update import frozen_prefix
from lldslight.errors import ConfigError
from lldslight.rewards import ExactMatchReward
from lldslight.rollout import RolloutConfig, RolloutEngine
from lldslight.rollout import compiled as compiled_module

pytestmark = pytest.mark.slow

MULTI_TURN = dict(topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=120, max_response_tokens=400)


def _generate(model, tok, retriever, examples, mode: str, seed: int = 0, **kw):
    engine = RolloutEngine(tok, retriever, ExactMatchReward(), RolloutConfig(compile_decode=mode, **(MULTI_TURN | kw)))
    torch.manual_seed(seed)
    return engine, engine.generate(model, examples)


def _assert_same_rollouts(a, b, atol: float = 1e-5) -> None:
    assert a.extras["sampled_ids"] == b.extras["sampled_ids"]
    assert a.finish_reason == b.finish_reason
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    diff = (a.sample_logp - b.sample_logp).abs().max().item()
    assert diff <= atol, diff


@pytest.fixture(scope="module")
def mixed_examples(protocol_examples, synth_kb):
    """The questions the protocol model was trained on and three it was not: rows that search,
    answer or run out of budget at different steps (so finished rows leave the cache mid-run)."""
    from lldslight.data.formats import load_examples

    seen = {e.question for e in protocol_examples}
    return list(protocol_examples) + [e for e in load_examples(synth_kb["train_jsonl"]) if e.question not in seen][:3]


def test_greedy_compiled_equals_eager(protocol_model, bm25, mixed_examples):
    model, tok = protocol_model
    _, eager = _generate(model, tok, bm25, mixed_examples, "off", group_size=2, greedy=True)
    engine, compiled = _generate(model, tok, bm25, mixed_examples, "on", group_size=2, greedy=True)
    assert engine.compiled.failure is None
    assert engine.compiled.compiled_steps == engine.stats["decode_steps"] > 0, "every decode step should run compiled"
    assert engine.stats["compactions"] >= 1, "finished rows should have left the cache (the slot count changes)"
    assert len({len(ids) for ids in eager.extras["sampled_ids"]}) > 2, "rows should finish at different lengths"
    assert int(eager.num_searches.sum()) >= 3 and "answer" in eager.finish_reason
    _assert_same_rollouts(compiled, eager)


def test_sampled_compiled_equals_eager_under_one_seed(protocol_model, bm25, mixed_examples):
    """Sampled rows draw the same tokens under one seed, except where a row's uniform falls within
    float rounding of a boundary of the inverse CDF: the logits differ by rounding (inductor fuses
    and orders reductions differently), and a near-uniform distribution over 49k tokens has
    boundaries ~2e-5 apart. So: most rows equal throughout, and every row that differs first
    differs by one step along the CDF (the neighbouring token id), after an identical prefix."""
    model, tok = protocol_model
    _, eager = _generate(model, tok, bm25, mixed_examples, "off", seed=7, group_size=2)
    engine, compiled = _generate(model, tok, bm25, mixed_examples, "on", seed=7, group_size=2)
    assert engine.compiled.compiled_steps == engine.stats["decode_steps"] > 0
    assert len(set(map(tuple, eager.extras["sampled_ids"]))) > 1, "sampled rows should differ"
    same = 0
    for b, (mine, theirs) in enumerate(zip(compiled.extras["sampled_ids"], eager.extras["sampled_ids"])):
        first = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), None)
        if first is None:
            assert mine == theirs, b
            same += 1
        else:
            assert abs(mine[first] - theirs[first]) == 1, (b, first, mine[first], theirs[first])
        n = len(mine) if first is None else first
        a, e = compiled.sample_logp[b][compiled.loss_mask[b]][:n], eager.sample_logp[b][eager.loss_mask[b]][:n]
        assert (a - e).abs().max().item() < 1e-5, b
    assert same >= len(eager) // 2, f"{same} of {len(eager)} rows equal"


def test_compiled_step_follows_weight_updates(protocol_model, bm25, mixed_examples):
    """The weights are inputs of the compiled step, not constants baked into it: after an in-place
    update (what the optimizer does) the compiled step decodes with the new weights."""
    model, tok = protocol_model
    _, before = _generate(model, tok, bm25, mixed_examples, "on", group_size=1, greedy=True)
    weight = model.get_output_embeddings().weight  # tied with the input embeddings: every step reads it
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5 * saved.std())
        engine, compiled = _generate(model, tok, bm25, mixed_examples, "on", group_size=1, greedy=True)
        _, eager = _generate(model, tok, bm25, mixed_examples, "off", group_size=1, greedy=True)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert engine.compiled.compiled_steps == engine.stats["decode_steps"] > 0
    assert compiled.extras["sampled_ids"] != before.extras["sampled_ids"], "the update should change the rollouts"
    _assert_same_rollouts(compiled, eager)


def _failing_compile(where: str):
    def compile(fn, *args, **kwargs):
        if where == "compile":
            raise RuntimeError("no C++ compiler found")

        def broken(*a, **k):
            raise RuntimeError("inductor: unsupported operation")
        return broken
    return compile


@pytest.mark.parametrize("where", ["compile", "first call"])
def test_failed_compile_falls_back_to_eager_said_once(protocol_model, bm25, mixed_examples, monkeypatch, capsys, where):
    model, tok = protocol_model
    monkeypatch.setattr(torch, "compile", _failing_compile(where))
    monkeypatch.setattr(compiled_module, "_compiled_step", None)
    monkeypatch.setattr(frozen_prefix, "_SAID", set())
    examples = mixed_examples[2:4]  # one the model knows, one it does not: short and cheap
    # Bit for bit needs the same rows decoding together at every step: by default a search landing a
    # step earlier or later (the clock, a loaded machine) changes the batch's shape and so the last
    # bit of a log-prob. Deterministic mode schedules retrieval by step (test_determinism.py).
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _, eager = _generate(model, tok, bm25, examples, "off", group_size=1, greedy=True)
        capsys.readouterr()
        engine, auto = _generate(model, tok, bm25, examples, "auto", group_size=1, greedy=True)
        torch.manual_seed(0)
        again = engine.generate(model, examples)  # a second call: eager without trying again, nothing said
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    said = [line for line in capsys.readouterr().out.splitlines() if "compile_decode" in line]
    assert len(said) == 1 and "runs eagerly" in said[0], said
    assert ("no C++ compiler" if where == "compile" else "unsupported operation") in said[0]
    assert engine.compiled.compiled_steps == 0 and engine.compiled.failure is not None
    # the failed step ran again eagerly: the rollouts are eager's, bit for bit
    _assert_same_rollouts(auto, eager, atol=0.0)
    _assert_same_rollouts(again, eager, atol=0.0)


def test_compile_on_raises_when_it_cannot_compile(protocol_model, bm25, mixed_examples, monkeypatch):
    model, tok = protocol_model
    monkeypatch.setattr(torch, "compile", _failing_compile("compile"))
    monkeypatch.setattr(compiled_module, "_compiled_step", None)
    with pytest.raises(RuntimeError, match=r"rollout.compile_decode 'on'.*no C\+\+ compiler.*'auto'"):
        _generate(model, tok, bm25, mixed_examples[:1], "on", group_size=1, greedy=True)


def test_compile_decode_must_be_a_known_mode():
    with pytest.raises(ConfigError, match=r"rollout.compile_decode must be 'off', 'on' or 'auto', got 'yes'"):
        RolloutConfig(compile_decode="yes")
