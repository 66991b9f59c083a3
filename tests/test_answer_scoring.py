"""The reward and EM score one answer: the model's last action's (issue 23, item 7).

A scripted policy drives the real RolloutEngine: the tiny real model runs every forward pass, and a
hook on its LM head forces the next token of a script, so each turn's text is exactly the one
written below. Every case's answer, reward and EM are worked out by hand.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pickle

import pytest
import torch

from lldslight.policy import decoder_and_head
from lldslight.rewards import ExactMatchReward, F1Reward, ModelText, final_answer
from lldslight.rollout import STOP_TAGS, RolloutConfig, RolloutEngine

GOLD = ["Curie"]

# (turns the model writes, the answer of its last action, EM = reward). A turn that ends without a
# stop tag ends with EOS, except where "|cut" marks a turn that max_new_tokens cuts.
CASES = [
    (["<answer> Curie </answer>"], "Curie", 1.0),
    # an answer opened in one turn and closed in the next, across the invalid-action message
    (["<answer> Curie", "</answer>", "done"], None, 0.0),
    (["<answer> Curie", "</answer>"], None, 0.0),
    # a stray <answer> in an earlier turn, then the right final answer
    (["<answer> I think", "<answer> Curie </answer>"], "Curie", 1.0),
    (["<answer> Einstein", "<answer> Curie </answer>"], "Curie", 1.0),
    # a turn cut by max_new_tokens, closed in the next turn
    (["<answer> Curie|cut", "</answer>"], None, 0.0),
    (["<search> Curie </search>", "<answer> Curie </answer>"], "Curie", 1.0),
    (["<search> Curie", "<answer> the Curie. </answer>"], "the Curie.", 1.0),
    (["<answer> Einstein </answer>"], "Einstein", 0.0),
    (["<answer></answer>"], "", 0.0),
    (["no tags at all", "still none", "nothing"], None, 0.0),
    (["<answer> Curie </answer> extra"], "Curie", 1.0),  # the stop tag ends the turn before " extra"
]


@contextlib.contextmanager
def scripted(model, script: list[int]):
    """Every LM-head call (one per sampled token of a single row) returns logits that put the next
    token of ``script`` far ahead of every other token."""
    _, head = decoder_and_head(model)
    it = iter(script)

    def force(module, inputs, out):
        forced = torch.full_like(out, -1e4)
        forced[..., next(it)] = 0.0
        return forced

    handle = head.register_forward_hook(force)
    try:
        yield
    finally:
        handle.remove()


def run_script(tok, turns: list[str]) -> tuple[RolloutConfig, list[int]]:
    """The rollout settings (the last scripted turn is the final one) and the script's token ids."""
    ids, cut = [], None
    for text in turns:
        text, _, flag = text.partition("|")
        t = tok(text, add_special_tokens=False)["input_ids"]
        if flag == "cut":
            cut = len(t)  # max_new_tokens: the turn ends on its last token, no EOS
        elif not any(text.rstrip().endswith(tag) for tag in STOP_TAGS) and "</answer>" not in text:
            t = t + [tok.eos_token_id]
        ids += t
    longest = max(len(tok(t.partition("|")[0], add_special_tokens=False)["input_ids"]) for t in turns) + 1
    cfg = RolloutConfig(group_size=1, greedy=True, max_turns=len(turns) - 1, max_new_tokens=cut or longest,
                        max_obs_tokens=200, max_response_tokens=1000, topk=1)
    return cfg, ids


@pytest.mark.parametrize("turns, answer, em", CASES, ids=[" + ".join(c[0]) for c in CASES])
def test_reward_and_em_score_the_last_actions_answer(tiny_policy, bm25, protocol_examples, turns, answer, em):
    model, tok = tiny_policy
    example = dataclasses.replace(protocol_examples[0], golden_answers=list(GOLD))
    seen = []

    def reward(response, golden):
        seen.append(response)
        return ExactMatchReward()(response, golden)

    cfg, script = run_script(tok, turns)
    with scripted(model, script):
        traj = RolloutEngine(tok, bm25, reward, cfg).generate(model, [example])
    written = [t.partition("|")[0] for t in turns]
    if written[-1].endswith(" extra"):
        written[-1] = written[-1][: -len(" extra")]  # never sampled: the turn stopped at </answer>
    assert traj.model_texts[0] == "".join(written), "the script did not drive the engine"
    assert list(seen[0].actions) == written
    assert traj.answers[0] == answer
    assert float(traj.em[0]) == em
    assert float(traj.reward[0]) == em, "the reward scored another answer than EM"
    assert str(float(traj.reward[0])) != "-0.0"


def test_final_answer_reads_the_last_action_only():
    assert final_answer(ModelText(["<answer> Curie", "</answer>"])) is None
    assert final_answer(ModelText(["<answer> x", "<answer> Curie </answer>"])) == "Curie"
    assert final_answer(ModelText([])) is None
    assert final_answer("<answer> a </answer> <answer> b </answer>") == "b"  # a plain string: one action
    text = ModelText(["<search> q </search>", "<answer> Curie </answer>"])
    assert text == "<search> q </search><answer> Curie </answer>" and isinstance(text, str)
    again = pickle.loads(pickle.dumps(text))
    assert again == text and again.actions == text.actions
    assert F1Reward()(ModelText(["<answer> Marie", "Curie </answer>"]), ["Marie Curie"]) == 0.0


def test_no_answer_is_a_reward_of_zero_not_minus_zero():
    r = ExactMatchReward()(ModelText(["no answer"]), GOLD)
    assert r == 0.0 and str(r) == "0.0"
    assert ExactMatchReward(format_penalty=0.1)(ModelText(["no answer"]), GOLD) == pytest.approx(-0.1)


def test_numeric_golds_are_normalised(tmp_path):
    """A year stored as a float (one float in a column makes them all floats) is the year the model
    writes: 1961.0 -> "1961"; a real fraction stays as written."""
    import json

    import numpy as np

    from lldslight.data.formats import load_examples
    from lldslight.data.formats.common import read_answers

    assert read_answers(1961.0, "f", 0, "answer") == ["1961"]
    assert read_answers([1961.0, 2.5, 7], "f", 0, "answer") == ["1961", "2.5", "7"]
    assert read_answers(np.array([1961.0]), "f", 0, "answer") == ["1961"]
    assert read_answers(np.float32(1961.0), "f", 0, "answer") == ["1961"]
    path = tmp_path / "years.jsonl"
    path.write_text(json.dumps({"question": "When?", "golden_answers": [1961.0]}) + "\n")
    (ex,) = load_examples(path)
    assert ex.golden_answers == ["1961"]
    assert ExactMatchReward()(ModelText(["<answer> 1961 </answer>"]), ex.golden_answers) == 1.0
