"""Answer extraction, SQuAD normalisation, EM/F1 and the pluggable reward (PAPER.md §1).

A reward function is any callable ``(response: str, golden_answers: list[str]) -> float``; a
config names it by ``class_path`` so users plug their own without touching the library.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Protocol

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def extract_answer(response: str) -> str | None:
    """The last <answer>...</answer> of the model's response, stripped; None when absent.

    Only the response is parsed: the prompt's own "<answer> Beijing </answer>" example never counts
    (Search-R1 searched prompt+response and needed two matches to step over it).
    """
    found = _ANSWER.findall(response)
    return found[-1].strip() if found else None


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str | None, golden_answers: list[str]) -> float:
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def f1_score(prediction: str | None, golden_answers: list[str]) -> float:
    """Token-level F1 against the best-matching gold answer (SQuAD)."""
    if prediction is None:
        return 0.0
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golden_answers:
        gold_tokens = normalize_answer(gold).split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


class RewardFn(Protocol):
    def __call__(self, response: str, golden_answers: list[str]) -> float: ...


class ExactMatchReward:
    """1 when the last answer exact-matches a gold answer after normalisation, else 0.

    Args:
        format_penalty: subtracted when the response has no <answer> at all (0 = Search-R1 default).
    """

    def __init__(self, format_penalty: float = 0.0) -> None:
        self.format_penalty = format_penalty

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        answer = extract_answer(response)
        if answer is None:
            return -self.format_penalty
        return exact_match(answer, golden_answers)


class F1Reward:
    """Token F1 of the last answer: a denser signal than EM for long answers."""

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        return f1_score(extract_answer(response), golden_answers)
