"""The Search-R1 protocol as text (docs/algorithm.md §1): the action tags, how one turn's text is
parsed into an action, the strings the environment answers with, and how prompts and observations
become token ids.

This is its own file because the rollout engine and the warm start (lldslight/sft.py) must speak
the protocol identically, to the character: a change here changes both, and nothing else (no
torch, no model). tests/test_protocol.py pins the strings.
"""
from __future__ import annotations

import re
from typing import Optional

from lldslight.retrieval.base import Passage

STOP_TAGS = ("</search>", "</answer>")
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)


def format_observation(passages: list[Passage]) -> str:
    """Search-R1's ``_passages2string`` wrapped in an information block (title line kept verbatim)."""
    refs = ""
    for i, p in enumerate(passages):
        lines = p.contents.split("\n")
        refs += f"Doc {i + 1}(Title: {lines[0]}) {chr(10).join(lines[1:])}\n"
    return f"\n\n<information>{refs.strip()}</information>\n\n"


def parse_action(text: str) -> tuple[Optional[str], str]:
    """(kind, content) of the action in one turn's text, cut at the first stop tag as Search-R1 does.

    kind is "search", "answer" or None (invalid).
    """
    cut = len(text)
    for tag in STOP_TAGS:
        pos = text.find(tag)
        if pos != -1:
            cut = min(cut, pos + len(tag))
    match = _ACTION.search(text[:cut])
    if match is None:
        return None, ""
    return match.group(1), match.group(2).strip()


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt as the policy sees it: the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_ids(tokenizer, text: str, max_obs_tokens: int) -> list[int]:
    """An observation (retrieved passages or the invalid-action message) tokenised on its own and
    cut to ``max_obs_tokens``: the rollout and the warm start both build observations here."""
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_obs_tokens]


def eos_ids(tokenizer) -> list[int]:
    """The token ids that end a turn as EOS does, sorted: the tokenizer's EOS and the chat
    end-of-turn tokens it knows (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``). The engine stops
    a turn on them; LLDMonitor measures their probabilities."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return sorted(ids)
