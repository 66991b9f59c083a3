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


def make_prompt(question: str) -> str:
    """Search-R1's user message: question stripped, '?' appended when missing (typo kept on purpose)."""
    q = question.strip()
    if not q.endswith("?"):
        q += "?"
    return SEARCH_R1_TEMPLATE.format(question=q)


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
