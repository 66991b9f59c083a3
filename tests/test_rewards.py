"""Answer extraction, SQuAD normalisation, EM and F1."""
import pytest

from lldslight.rewards import ExactMatchReward, F1Reward, exact_match, extract_answer, f1_score, normalize_answer


@pytest.mark.parametrize(
    "text,expected",
    [
        ("The  Beatles!", "beatles"),
        ("An apple, a day", "apple day"),
        ("  Paris. ", "paris"),
        ("U.S.A.", "usa"),
        ("the", ""),
    ],
)
def test_normalize(text, expected):
    assert normalize_answer(text) == expected


def test_extract_last_answer_only_from_response():
    resp = "<think>x</think><answer> Rome </answer> hmm <answer>  Paris </answer>"
    assert extract_answer(resp) == "Paris"
    assert extract_answer("no tags here") is None
    assert extract_answer("<answer>unclosed") is None


def test_exact_match_and_f1():
    assert exact_match("the Eiffel Tower", ["Eiffel tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel tower"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0
    assert f1_score("Eiffel", ["Eiffel tower"]) == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert f1_score("Louvre", ["Eiffel tower", "Louvre museum"]) == pytest.approx(2 / 3)


def test_reward_callables():
    assert ExactMatchReward()("<answer>Beijing</answer>", ["beijing"]) == 1.0
    # The prompt's own example answer is never in the response, so it cannot count.
    assert ExactMatchReward()("I think so.", ["Beijing"]) == 0.0
    assert ExactMatchReward(format_penalty=0.1)("no answer", ["x"]) == pytest.approx(-0.1)
    assert F1Reward()("<answer>new york city</answer>", ["New York"]) == pytest.approx(0.8)


def test_a_plain_string_gold_is_one_answer():
    """As Search-R1's em_check: a string is one gold answer, not a list of characters."""
    assert exact_match("Paris", "Paris") == 1.0
    assert exact_match("P", "Paris") == 0.0
    assert f1_score("New York", "new york city") == pytest.approx(0.8)
    assert f1_score("a", "abc") == 0.0
    assert ExactMatchReward()("<answer> the Paris </answer>", "Paris") == 1.0
    assert F1Reward()("<answer>New York</answer>", "New York City") == pytest.approx(0.8)
