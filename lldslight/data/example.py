"""The record every data format is read into, and the Search-R1 prompt (docs/algorithm.md §1)."""
from __future__ import annotations

from dataclasses import dataclass, field

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you lack some knowledge, you can call a "
    "search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>. You can search as many times as your want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)


def make_prompt(question: str, template: str = SEARCH_R1_TEMPLATE) -> str:
    """The user message: ``template`` (Search-R1's, typo kept on purpose) around the question,
    stripped, with '?' appended when missing."""
    q = question.strip()
    if not q.endswith("?"):
        q += "?"
    return template.format(question=q)


def check_template(template: str, key: str) -> None:
    """A prompt template must hold exactly one ``{question}`` and nothing else to fill."""
    from lldslight.errors import ConfigError

    try:
        rendered = template.format(question="\0")
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(f"{key} must be a text with one {{question}} placeholder, got {template!r} ({err!r})") from None
    if rendered.count("\0") != 1:
        raise ConfigError(f"{key} must hold {{question}} exactly once, got {template!r}")


@dataclass
class QAExample:
    """One question. ``messages`` is the chat the policy sees (one user turn by default).

    ``group_id`` is unique across every file loaded together, so GRPO groups never merge two
    different questions (Search-R1 keyed groups by a per-dataset index).
    """

    id: str
    question: str
    golden_answers: list[str]
    data_source: str
    messages: list[dict]
    group_id: int = -1
    split: str = ""
    meta: dict = field(default_factory=dict)
