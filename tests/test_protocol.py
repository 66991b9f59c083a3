"""The Search-R1 protocol text, byte for byte (docs/algorithm.md §1)."""
from lldslight.data.example import make_prompt
from lldslight.retrieval.base import Passage
from lldslight.rollout import INVALID_ACTION, format_observation, parse_action

EXPECTED_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n"
)


def test_prompt_exact_text():
    assert make_prompt("  who wrote hamlet ") == EXPECTED_PROMPT
    assert make_prompt("who wrote hamlet?") == EXPECTED_PROMPT


def test_observation_format_matches_search_r1():
    passages = [Passage("1", '"Paris"\nParis is the capital.', 1.0), Passage("2", '"Lyon"\nLyon is a city.\nSecond line.', 0.5)]
    assert format_observation(passages) == (
        '\n\n<information>Doc 1(Title: "Paris") Paris is the capital.\n'
        'Doc 2(Title: "Lyon") Lyon is a city.\nSecond line.</information>\n\n'
    )


def test_invalid_action_text():
    assert INVALID_ACTION == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
        "Let me try again.\n"
    )


def test_parse_action():
    assert parse_action("<think>hm</think><search> capital of France </search>") == ("search", "capital of France")
    assert parse_action("<answer> Paris </answer> trailing") == ("answer", "Paris")
    # cut at the first stop tag: a later answer in the same text is not the action
    assert parse_action("<search>a</search><answer>b</answer>") == ("search", "a")
    assert parse_action("<search>unclosed") == (None, "")
    assert parse_action("<answer>x</search>") == (None, "")
    assert parse_action("plain text") == (None, "")
