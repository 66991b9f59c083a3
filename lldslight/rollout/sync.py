"""After every weight update, a cheap check that the generation backend samples from the updated
weights.

A backend that holds its own copy of the weights (an inference server, a compiled or merged copy)
must take every update; one that silently does not samples every later step from the old policy,
and the run trains on off-policy rollouts while its curves look normal. The check: a fixed short
token sequence (the probe) is scored twice after each training step, by the policy as it trains
(its plain forward) and by the backend's own sampling path (``probe_logprob``, backend.py), and
each is compared with its value at the last check. When the policy's changed by more than
``tolerance`` while the backend's did not change at all (the same bits: the same weights give the
same forward), the backend did not take the update: a RuntimeError says so and the run stops.

A step that changed no weight (every update vetoed, a zero learning rate) changes neither, and is
not judged; small changes add up until they pass the tolerance (the reference point moves only
when the backend's value changes). A backend that does not score the probe is not checked (one
warning).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lldslight.errors import UserError

# Short and fixed: a question and a search, as the protocol's text; its log-prob moves with any
# update of the weights that score it.
PROBE_TEXT = "Question: who wrote the play Hamlet?\n<search> author of Hamlet </search>"


def probe_ids(tokenizer: Any) -> list[int]:
    return tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]


def summed_logprob(logits: Tensor, tokens: Tensor) -> float:
    """The summed log-prob of ``tokens[1:]`` [n-1] from the logits [n-1, V] of the positions before
    them, in float64: one number per forward, for the probe's comparisons."""
    return float(torch.log_softmax(logits.double(), -1).gather(-1, tokens[1:, None]).sum())


class SyncMismatch(UserError, RuntimeError):
    """The backend does not sample from the trainer's weights: one line, naming the step."""


@torch.no_grad()
def policy_logprob(model: nn.Module, ids: list[int]) -> float:
    """The probe's summed log-prob (tokens 2..n) under the policy's plain forward, in eval mode
    (no dropout): the weights as the trainer holds them."""
    return float(token_logprobs(model, ids).sum())


@torch.no_grad()
def token_logprobs(model: nn.Module, ids: list[int]) -> Tensor:
    """The log-prob of each of ``ids[1:]`` [n-1] (float64) under the policy's plain forward, in eval
    mode: what a backend with its own copy of the weights (VLLMGenerate) compares token by token."""
    from lldslight.policy.precision import precision_autocast

    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        tokens = torch.tensor([ids], device=device)
        # the policy's precision, as every trainer and sampler forward (a bf16 base under an fp32 adapter needs it)
        with precision_autocast(model):
            logits = model(input_ids=tokens).logits[0, :-1]  # [n-1, V]
        return torch.log_softmax(logits.double(), -1).gather(-1, tokens[0, 1:, None])[:, 0]
    finally:
        model.train(was_training)


class WeightSync:
    """The check, across a run: :meth:`start` before the first update, :meth:`after_step` after
    each training step.

    Args:
        tolerance: how far (nats, the probe's summed log-prob) the policy must have moved since the
            backend last changed for an unchanged backend to count as stale.
    """

    def __init__(self, tolerance: float = 1e-4) -> None:
        self.tolerance = tolerance
        self.ids: list[int] = []
        self.policy_at: Optional[float] = None  # the policy's probe value when the backend last changed
        self.backend_at: Optional[float] = None  # the backend's value then
        self.last: Optional[tuple[float, float]] = None  # (policy, backend) at the last check

    def start(self, score: Callable[[nn.Module, list[int]], float], model: nn.Module, tokenizer: Any) -> None:
        """The reference values, before any update: ``score`` is the backend's ``probe_logprob``."""
        self.ids = probe_ids(tokenizer)
        try:
            backend = float(score(model, self.ids))
        except SyncMismatch as err:
            raise SyncMismatch(f"weight sync failed before the first step: {err}") from None
        self.policy_at, self.backend_at = policy_logprob(model, self.ids), backend
        self.last = (self.policy_at, self.backend_at)

    def after_step(self, score: Callable[[nn.Module, list[int]], float], model: nn.Module, step: int) -> dict[str, float]:
        """Check after a training step; the step's ``sync/*`` metrics. Raises RuntimeError when the
        backend missed the updates."""
        try:
            backend = float(score(model, self.ids))
        except SyncMismatch as err:  # a backend that compares the probe itself (VLLMGenerate)
            raise SyncMismatch(f"weight sync failed after step {step}: {err}") from None
        policy = policy_logprob(model, self.ids)
        metrics = {"sync/policy_delta": policy - self.last[0], "sync/backend_delta": backend - self.last[1]}
        self.last = (policy, backend)
        if backend != self.backend_at or not math.isfinite(backend):
            self.policy_at, self.backend_at = policy, backend  # the backend took a change: the new reference
        elif abs(policy - self.policy_at) > self.tolerance:
            raise SyncMismatch(
                f"weight sync failed after step {step}: the generation backend samples from old weights. Since it last "
                f"changed, the policy's log-prob of a fixed probe moved {policy - self.policy_at:+.6g} nats, the "
                f"backend's did not move at all ({backend:.6g}): the weight updates did not reach it, and every "
                "later rollout would be sampled from the old policy. A backend with its own copy of the weights "
                "must load them before each generate call (docs/generation_backends.md)")
        return metrics
