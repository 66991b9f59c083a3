"""Answer extraction, SQuAD normalisation, EM/F1 and the pluggable reward (docs/algorithm.md §1).

A reward function is any callable ``(response: str, golden_answers: list[str]) -> float``; a
config names it by ``class_path`` so users plug their own without touching the library (type hints
are optional). A reward that also wants the rollout's context declares it by name, as keyword
parameters after those two (any of ``question``, ``data_source``, ``turns``, or ``**kwargs`` for
all; :class:`RewardCaller` reads the signature once): ``turns`` is a tuple of trajectory.Turn, each
action's text and the query it searched for. Rewards with the two-argument signature are called as
before. A reward must return a finite number (float32's range: trajectories store rewards as
float32); one that returns anything else, or raises, stops the run with a :class:`RewardError`
naming the reward and the question: a NaN reward would make its whole group's advantages NaN and
every update would be vetoed, a run that learns nothing and says nothing.

``response`` is what the model wrote and nothing else: a :class:`ModelText`, the text of its
actions (each turn's sampled tokens, decoded without special tokens) concatenated in order, which
also carries each action's text (``response.actions``). The prompt, the retrieved observations and
the environment's invalid-action message are never part of it (that message itself contains
``<answer> and </answer>``, and a passage may contain any tag).

The rollout's answer is its last action's ``<answer>...</answer>`` and nothing else
(:func:`final_answer`): the built-in rewards and the EM/F1 of training and evaluation
(``Trajectory.answers``) all read it through that one function. Parsing the concatenation instead
would join an answer opened in one turn and closed in the next (across an invalid-action message,
or a turn cut by ``max_new_tokens``), and a stray ``<answer>`` in an earlier turn would swallow
the final answer. The full text with observations stays in ``Trajectory.responses`` for logging.
"""
from __future__ import annotations

import inspect
import math
import re
import string
from collections import Counter
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from lldslight.errors import ConfigError, UserError

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


class ModelText(str):
    """The model's words as a reward sees them: its actions' texts concatenated (a plain ``str`` for
    any reward that reads the whole text), with ``actions``, the text of each action in order."""

    actions: tuple[str, ...]

    def __new__(cls, actions: Sequence[str]) -> "ModelText":
        obj = super().__new__(cls, "".join(actions))
        obj.actions = tuple(actions)
        return obj

    def __getnewargs__(self) -> tuple:  # pickling: __new__ takes the actions, not the joined text
        return (self.actions,)


def final_answer(response: str) -> str | None:
    """The rollout's answer: the <answer>...</answer> of the model's LAST action (stripped), None
    when that action holds no complete one. The reward and EM/F1 both score this answer.

    ``response`` is a :class:`ModelText` (what the rollout engine hands a reward); a plain string is
    read as one action.
    """
    actions = getattr(response, "actions", None)
    if actions is None:
        return extract_answer(response)
    return extract_answer(actions[-1]) if actions else None


def extract_answer(response: str) -> str | None:
    """The last <answer>...</answer> of one text, stripped; None when absent.

    Only the model's own words are parsed: the prompt's "<answer> Beijing </answer>" example, the
    invalid-action message and retrieved passages never count (Search-R1 searched prompt+response,
    observations included, and needed two matches to step over the prompt's example).
    """
    found = _ANSWER.findall(response)
    return found[-1].strip() if found else None


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def gold_list(golden_answers: str | list[str]) -> list[str]:
    """The gold answers as a list: a plain string is one answer, as Search-R1's ``em_check`` takes it
    (iterating it would compare the prediction with each character)."""
    return [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)


def exact_match(prediction: str | None, golden_answers: str | list[str]) -> float:
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in gold_list(golden_answers)))


def f1_score(prediction: str | None, golden_answers: str | list[str]) -> float:
    """Token-level F1 against the best-matching gold answer (SQuAD)."""
    if prediction is None:
        return 0.0
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in gold_list(golden_answers):
        gold_tokens = normalize_answer(gold).split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


class RewardFn(Protocol):
    """``response``: the model's own text, a :class:`ModelText` (its actions only, see the module
    docstring); read its answer with :func:`final_answer`. A reward may also declare keyword
    parameters named in :data:`REWARD_CONTEXT` (see :class:`RewardCaller`)."""

    def __call__(self, response: str, golden_answers: list[str]) -> float: ...


# What a reward may ask for beyond (response, golden_answers): the model's words and the example's
# own fields, never an observation's text (a turn's observation is a token span, not text).
REWARD_CONTEXT = ("question", "data_source", "turns")


class RewardError(UserError):
    """A reward raised, or returned something other than a finite number; the message names the
    reward and the question (the reward's own exception is the ``__cause__``: ``--debug`` shows it)."""


# Trajectories hold rewards as float32: a larger magnitude is infinite there (1e308 is a finite float).
FLOAT32_MAX = float(np.finfo(np.float32).max)
QUESTION_SHOWN = 80  # characters of the question a reward error quotes


def reward_name(fn: Callable[..., Any]) -> str:
    """``module.Class`` of a callable object, ``module.function`` of a function: as YAML names it."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(fn).__qualname__)}"


class RewardCaller:
    """Calls a reward with ``(response, golden_answers)`` and, by keyword, the parts of
    :data:`REWARD_CONTEXT` its signature names (all of them for ``**kwargs``). The signature is
    read once, here: a parameter the rollout cannot supply is a configuration error now, not a
    TypeError at the first step. Returns the reward as a float; a reward that raises or returns
    anything but a finite number raises :class:`RewardError` (``context`` gives the question)."""

    def __init__(self, fn: Callable[..., float]) -> None:
        self.fn = fn
        self.name = reward_name(fn)
        self.wants = _reward_context(fn, self.name)

    def __call__(self, response: str, golden_answers: list[str], **context: Any) -> float:
        try:
            value = self.fn(response, golden_answers, **{k: context[k] for k in self.wants})
        except Exception as err:
            first = (str(err).strip().splitlines() or [""])[0]
            raise RewardError(f"reward {self.name} raised {type(err).__name__}{': ' + first if first else ''} "
                              f"{self._where(context)} (--debug shows its traceback)") from err
        number = _as_float(value)
        if number is not None and math.isfinite(number) and abs(number) <= FLOAT32_MAX:
            return number
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        if number is None:
            why = f"not a {type(value).__name__}: a reward must return a finite number (a float)"
        elif math.isfinite(number):
            why = (f"a reward must return a finite number within float32's range (|r| <= {FLOAT32_MAX:.4g}; "
                   "trajectories store rewards as float32, where it is infinite)")
        else:
            why = ("a reward must return a finite number (with a NaN or infinite reward its group's advantages are NaN "
                   "and every update is vetoed)")
        raise RewardError(f"reward {self.name} returned {shown} {self._where(context)}: {why}")

    @staticmethod
    def _where(context: dict[str, Any]) -> str:
        question = str(context.get("question", "?"))
        if len(question) > QUESTION_SHOWN:
            question = question[: QUESTION_SHOWN - 3] + "..."
        source = context.get("data_source")
        return f"for question {question!r}" + (f" (data_source {source})" if source else "")


def _as_float(value: Any) -> Optional[float]:
    """``value`` as a float when it is one number (a Python or numpy number, a bool, a one-element
    tensor or array); None for anything else (None, a string, several numbers)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _reward_context(fn: Callable[..., float], name: str) -> tuple[str, ...]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return REWARD_CONTEXT
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY]
    unknown = [p.name for p in rest if p.name not in REWARD_CONTEXT and p.default is p.empty]
    if unknown or (len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params)):
        raise ConfigError(f"reward {name}: its parameters must be (response, golden_answers) and, by keyword, any of "
                          f"{', '.join(REWARD_CONTEXT)}; got {[p.name for p in params]}")
    return tuple(p.name for p in rest if p.name in REWARD_CONTEXT)


class ExactMatchReward:
    """1 when the rollout's answer (:func:`final_answer`) exact-matches a gold answer after
    normalisation, else 0.

    Args:
        format_penalty: subtracted when the model never wrote a complete <answer>...</answer>
            (0 = Search-R1 default).
    """

    def __init__(self, format_penalty: float = 0.0) -> None:
        self.format_penalty = format_penalty

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        answer = final_answer(response)
        if answer is None:
            return -self.format_penalty if self.format_penalty else 0.0  # 0.0, never -0.0
        return exact_match(answer, golden_answers)


class F1Reward:
    """Token F1 of the rollout's answer (:func:`final_answer`): a denser signal than EM for long answers."""

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        return f1_score(final_answer(response), golden_answers)
