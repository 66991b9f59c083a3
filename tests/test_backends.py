"""The generation seam (lldslight/rollout/backend.py) and per-turn data.

- The reference backend (HFGenerate: transformers' ``generate``, one rollout and one turn per call,
  the whole context re-encoded each turn) and the engine (continuous batching over a ragged cache,
  its own sampler) share only the protocol's rules, so equal greedy outputs check each against an
  independent implementation: on the protocol-trained tiny model (searches, observations, answers)
  and on tiny.yaml's random model (invalid actions, budgets).
- SearchRollout takes its backend by class_path; a class that is not a backend is refused.
- Trajectory.turns and the rewards that ask for the question, the data source and the turns,
  checked against the trajectory's own tokens; two-argument rewards are called as before.
"""
from __future__ import annotations

import re

import pytest
import torch

from lldslight.rollout import HFGenerate, RolloutConfig, RolloutEngine
from lldslight.rollout.protocol import format_observation

FIELDS = ("input_ids", "attention_mask", "loss_mask", "action_id", "answer_mask", "prompt_len", "group_id", "reward",
          "num_searches", "num_invalid", "num_actions", "em", "f1")


def _config(**kw) -> RolloutConfig:
    base = dict(group_size=1, greedy=True, topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=400)
    return RolloutConfig(**{**base, **kw})


def _assert_same(a, b) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("finish_reason", "responses", "model_texts", "answers", "turns", "questions", "data_source"):
        assert getattr(a, name) == getattr(b, name), name
    assert torch.allclose(a.sample_logp, b.sample_logp, atol=1e-4), (a.sample_logp - b.sample_logp).abs().max()


def test_the_reference_backend_decodes_the_engines_tokens_greedily(protocol_model, protocol_examples, bm25):
    model, tok = protocol_model
    config = _config()
    engine = RolloutEngine(tok, bm25, lambda text, gold: 0.0, config).generate(model, protocol_examples)
    reference = HFGenerate(tok, bm25, lambda text, gold: 0.0, config).generate(model, protocol_examples)
    assert int(engine.num_searches.sum()) >= 1 and "answer" in engine.finish_reason  # the comparison covers both paths
    _assert_same(engine, reference)


def test_the_reference_backend_matches_on_the_tiny_configs_model(tiny_policy, protocol_examples, bm25):
    """tiny.yaml's random model with its LoRA adapter: rarely a valid action, so invalid-action
    observations and budgets decide the turns."""
    model, tok = tiny_policy
    config = _config(max_new_tokens=12, max_obs_tokens=16, max_response_tokens=120)
    engine = RolloutEngine(tok, bm25, lambda text, gold: 0.0, config).generate(model, protocol_examples)
    reference = HFGenerate(tok, bm25, lambda text, gold: 0.0, config).generate(model, protocol_examples)
    assert int(engine.num_actions.sum()) > len(protocol_examples)  # several turns each
    _assert_same(engine, reference)


def test_the_reference_backend_samples_with_log_probs_of_its_own_tokens(protocol_model, protocol_examples, bm25):
    """Sampling: different random streams, so not the engine's tokens; its log-probs must be the
    model's log-probs of the tokens it drew (checked by a forward pass over the packed rows)."""
    from lldslight.update.logprobs import token_logprobs

    model, tok = protocol_model
    torch.manual_seed(0)
    traj = HFGenerate(tok, bm25, lambda text, gold: 0.0, _config(group_size=2, greedy=False, temperature=0.7)).generate(
        model, protocol_examples[:2])
    assert len(traj) == 4 and traj.group_id.tolist() == [protocol_examples[0].group_id] * 2 + [protocol_examples[1].group_id] * 2
    traj.check()
    with torch.no_grad():
        logp, _ = token_logprobs(model, traj.input_ids, traj.attention_mask, traj.loss_mask, temperature=0.7)
    # fp32; generate's cached attention rounds differently from one forward over the row (~1e-4 at most)
    diff = (traj.sample_logp - logp.float()).abs()[traj.loss_mask]
    assert float(diff.max()) < 1e-3 and float(diff.mean()) < 1e-4, (diff.max(), diff.mean())


def test_search_rollout_takes_its_backend_by_class_path(tiny_policy, bm25):
    from jsonargparse import ArgumentParser

    from lldslight.callbacks import SearchRollout

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(SearchRollout, "rollout", fail_untyped=False)
    retriever = {"class_path": "lldslight.retrieval.BM25Retriever", "init_args": {"corpus": "unused.jsonl"}}

    class Module:  # what _build reads from the module
        tokenizer = tiny_policy[1]

    built = {}
    for given, kind in ((None, RolloutEngine), ("lldslight.rollout.HFGenerate", HFGenerate),
                        ({"class_path": "lldslight.rollout.HFGenerate"}, HFGenerate)):
        value = {"retriever": retriever, **({"backend": given} if given else {})}
        callback = parser.instantiate_classes(parser.parse_object({"rollout": value})).rollout
        train = callback.train_engine(Module())
        assert type(train) is kind and train.config.group_size == callback.config.group_size
        assert type(callback._engines(Module())[1]) is kind and callback._engines(Module())[1].config.greedy  # evaluation
        built[kind] = train
    assert set(built) == {RolloutEngine, HFGenerate}
    with pytest.raises(Exception, match=r"rollout\.backend.*RolloutConfig"):
        parser.parse_object({"rollout": {"retriever": retriever, "backend": "lldslight.rollout.RolloutConfig"}})


# -- per-turn data and rewards that see the question ------------------------------------------------------------


class ContextReward:
    """A reward with the new signature: records what it was given; scores 1 when a turn searched."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, response, golden_answers, *, question, data_source, turns) -> float:
        self.calls.append({"response": response, "gold": golden_answers, "question": question, "source": data_source, "turns": turns})
        return float(any(t.query is not None for t in turns))


class OldReward:
    def __init__(self) -> None:
        self.calls = []

    def __call__(self, response, golden_answers) -> float:
        self.calls.append(response)
        return float("<search>" in response)


@pytest.mark.parametrize("backend", [RolloutEngine, HFGenerate])
def test_turns_and_a_reward_that_asks_for_the_question_data_source_and_turns(backend, protocol_model, protocol_examples, bm25):
    model, tok = protocol_model
    new, old = ContextReward(), OldReward()
    traj = backend(tok, bm25, new, _config()).generate(model, protocol_examples)
    old_traj = backend(tok, bm25, old, _config()).generate(model, protocol_examples)  # greedy: the same rollouts
    assert old_traj.reward.tolist() == [float("<search>" in text) for text in old_traj.model_texts]
    assert traj.reward.tolist() == [float(n > 0) for n in traj.num_searches.tolist()]
    assert [str(r) for r in old.calls] == [c["response"] for c in new.calls]  # both got the model's text
    assert len(new.calls) == len(traj) and int(traj.num_searches.sum()) >= 1
    for b, call in enumerate(new.calls):
        example = protocol_examples[b]
        assert (call["question"], call["source"], call["gold"]) == (example.question, example.data_source, example.golden_answers)
        turns = traj.turns[b]
        assert call["turns"] == tuple(turns) and len(turns) == int(traj.num_actions[b])
        # each action is the text of its own sampled tokens, and together they are the model's text
        for a, turn in enumerate(turns):
            ids = traj.input_ids[b][traj.action_id[b] == a].tolist()
            assert turn.action == tok.decode(ids, skip_special_tokens=True)
        assert "".join(t.action for t in turns) == call["response"] == traj.model_texts[b]
        # a query is the text between the action's search tags; its observation span holds the passages
        searched = [t for t in turns if t.query is not None]
        assert len(searched) == int(traj.num_searches[b])
        for turn in searched:
            assert re.search(r"<search>\s*(.*?)\s*</search>", turn.action, re.DOTALL).group(1) == turn.query
            start, end = turn.observation_span
            assert not traj.loss_mask[b, start:end].any() and bool(traj.attention_mask[b, start:end].all())
            expected = format_observation(bm25.search([turn.query], 1)[0])
            observed = tok.decode(traj.input_ids[b, start:end].tolist(), skip_special_tokens=True)
            assert expected.startswith(observed) and "<information>" in observed
        # the reward never saw an observation's text as the model's
        assert "<information>" not in call["response"] and all("<information>" not in t.action for t in turns)
        assert "<information>" in traj.responses[b] or not searched


def test_a_reward_signature_lldslight_cannot_fill_is_refused_before_any_rollout():
    from lldslight.errors import ConfigError
    from lldslight.rewards import RewardCaller

    def wants_context(response, golden_answers, context):
        return 0.0

    with pytest.raises(ConfigError, match=r"reward .*wants_context: its parameters must be \(response, golden_answers\).*"
                                          r"question, data_source, turns; got \['response', 'golden_answers', 'context'\]"):
        RewardCaller(wants_context)
    seen = {}
    RewardCaller(lambda response, gold, **kw: seen.update(kw) or 0.0)("text", ["g"], question="q", data_source="s", turns=())
    assert seen == {"question": "q", "data_source": "s", "turns": ()}
    assert RewardCaller(lambda r, g, question=None: float(question == "q"))("t", [], question="q", data_source="s", turns=()) == 1.0


@pytest.mark.slow
def test_a_fit_runs_with_the_reference_backend_chosen_in_yaml(tmp_path, monkeypatch):
    """configs/tiny.yaml with ``backend: lldslight.rollout.HFGenerate``: a training step and the
    evaluation after it, through the real CLI."""
    import csv

    import yaml

    from lldslight.cli import main
    from tests.conftest import ROOT

    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    rollout = config["trainer"]["callbacks"][0]
    assert rollout["class_path"] == "lldslight.callbacks.SearchRollout"
    rollout["init_args"].update(backend="lldslight.rollout.HFGenerate", eval_after_fit=True)
    config["trainer"]["callbacks"] = [rollout]
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(tmp_path / "hf.yaml"), "--trainer.max_steps", "1"]) == 0  # data: relative, under tmp_path
    with open(tmp_path / "runs" / "tiny" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["train/reward"] for r in rows if r.get("train/reward")] and any(r.get("val_after/em") for r in rows)
