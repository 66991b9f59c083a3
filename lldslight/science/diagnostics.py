"""Lazy-likelihood-displacement diagnostics as pure functions, and the death-spiral phase detector
(docs/algorithm.md §3; docs/diagnostics.md).

Everything here works on plain tensors and floats (torch only, no Lightning), so each number can be
checked on hand-built trajectories. Shapes as in objectives.py: per-token tensors are [B, T] and
aligned with ``input_ids``; ``mask`` is the loss mask (model-generated tokens only).

Means are *true per-token means over a set*: the sum over every token of every response in the set,
divided by the number of those tokens (a long response weighs more than a short one). They are kept
as (sum, count) pairs until the end so that ranks can add them up before dividing.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional, Sequence

import torch
from torch import Tensor

from lldslight.errors import require, require_choice
from lldslight.update.objectives import action_sums

SumCount = tuple[float, float]
CorrectSet = Literal["positive_advantage", "reward"]


# ------------------------------------------------------------------------------ per-token means


def token_sum_count(values: Tensor, mask: Tensor) -> SumCount:
    """(sum, count) of ``values`` over the positions of ``mask``; non-finite values are left out."""
    keep = mask.bool() & torch.isfinite(values)
    return float(values.masked_fill(~keep, 0.0).sum()), float(keep.sum())


def finish(stat: SumCount) -> float:
    """The mean of a (sum, count) pair; NaN for an empty set (0 would look like a real log-prob)."""
    total, count = stat
    return total / count if count > 0 else float("nan")


def token_mean(values: Tensor, mask: Tensor) -> float:
    """True per-token mean of ``values`` over ``mask``; NaN when the mask is empty."""
    return finish(token_sum_count(values, mask))


def advantage_masks(advantage: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Token masks of the responses with A > 0 ("pos"), A < 0 ("neg") and A == 0 ("zero")."""
    a = advantage.unsqueeze(-1)
    m = mask.bool()
    return {"pos": m & (a > 0), "neg": m & (a < 0), "zero": m & (a == 0)}


def action_masks(mask: Tensor, action_id: Tensor) -> dict[str, Tensor]:
    """Token masks of the first action (action_id 0) and of every later action (action_id >= 1)."""
    m = mask.bool()
    return {"first_action": m & (action_id == 0), "later_actions": m & (action_id >= 1)}


def likelihood_stats(
    logp: Tensor,
    mask: Tensor,
    advantage: Tensor,
    action_id: Tensor,
    ref_logp: Optional[Tensor] = None,
) -> dict[str, SumCount]:
    """(sum, count) per diagnostic of a rollout batch's log-probs (``logp`` = log pi_old).

    Keys (``lld/`` names as logged): logp_pos / logp_neg / logp_zero (responses by advantage sign),
    logp_first_action / logp_later_actions (all responses), logp_pos_first_action /
    logp_pos_later_actions (A > 0 responses only: where the paper locates LLD), and the ref_logp_*
    set-means under the reference when ``ref_logp`` is given.
    """
    sets = advantage_masks(advantage, mask)
    acts = action_masks(mask, action_id)
    out: dict[str, SumCount] = {}
    for name, m in sets.items():
        out[f"lld/logp_{name}"] = token_sum_count(logp, m)
    for name, m in acts.items():
        out[f"lld/logp_{name}"] = token_sum_count(logp, m)
        out[f"lld/logp_pos_{name}"] = token_sum_count(logp, m & sets["pos"])
    if ref_logp is not None:
        for name, m in sets.items():
            out[f"lld/ref_logp_{name}"] = token_sum_count(ref_logp, m)
    return out


def correct_rows(advantage: Tensor, reward: Tensor, rule: CorrectSet = "positive_advantage") -> Tensor:
    """Row indices of the responses whose likelihood change Delta is measured.

    "positive_advantage" (default): A > 0, the responses GRPO explicitly pushes up, so a negative
    Delta there is LLD by definition. "reward": reward > 0 (every correct response, including those
    of all-correct groups, which get A = 0 and only see other responses' gradients).
    """
    require_choice(rule, "correct-set rule (LLDMonitor.correct_set)", CorrectSet)
    keep = advantage > 0 if rule == "positive_advantage" else reward > 0
    return keep.nonzero(as_tuple=True)[0]


def incorrect_rows(advantage: Tensor, reward: Tensor, rule: CorrectSet = "positive_advantage") -> Tensor:
    """Row indices of the responses ``lld/delta_incorrect`` is measured on: the mirror of
    :func:`correct_rows`. "positive_advantage": A < 0, the responses GRPO pushes down; "reward":
    reward <= 0. Their Delta says how hard the negative gradient pushed; the paper's displacement is
    that push spilling onto the correct rows (``lld/delta_correct`` < 0)."""
    require_choice(rule, "correct-set rule (LLDMonitor.correct_set)", CorrectSet)
    keep = advantage < 0 if rule == "positive_advantage" else reward <= 0
    return keep.nonzero(as_tuple=True)[0]


def likelihood_delta(before: Tensor, after: Tensor, mask: Tensor) -> SumCount:
    """(sum, count) of after - before over ``mask``: the per-token change of log-likelihood that a
    training step caused on the same tokens (negative = the likelihood fell)."""
    return token_sum_count(after - before, mask)


def gate_open_stats(before: Tensor, after: Tensor, mask: Tensor, action_id: Tensor) -> dict[str, SumCount]:
    """How often the LLDS gate would open: the share of actions, and of responses, whose summed
    log-likelihood fell between ``before`` (pi_old) and ``after`` (the weights after the step), i.e.
    sum of d = before - after over the action's (response's) tokens > 0. ``mask`` selects the
    tokens measured (the preserving set: model tokens of responses with A >= 0); an action or a
    response counts when it has at least one such token. Non-finite d are left out.

    Keys: lld/gate_open_actions, lld/gate_open_responses as (opened, counted).
    """
    d = before - after
    keep = mask.bool() & torch.isfinite(d)
    d = d.masked_fill(~keep, 0.0)
    has_token = action_sums(keep.to(d.dtype), action_id) > 0  # [B, T]: slot a = action a exists
    opened = has_token & (action_sums(d, action_id) > 0)
    rows = keep.any(-1)
    return {
        "lld/gate_open_actions": (float(opened.sum()), float(has_token.sum())),
        "lld/gate_open_responses": (float((rows & (d.sum(-1) > 0)).sum()), float(rows.sum())),
    }


# ------------------------------------------------------------------------------ control tokens and tools

CONTROL_TAGS = {"search_open": "<search>", "search_close": "</search>", "answer_open": "<answer>", "answer_close": "</answer>"}


def tag_spans(pieces: Sequence[str], tags: dict[str, str] = CONTROL_TAGS) -> dict[str, list[tuple[int, int]]]:
    """For each tag, its occurrences in the text ``"".join(pieces)`` (``pieces[i]`` = the text of token
    i) as (first, last) token indices: the tokens that spell it, from the one holding its first
    character to the one that completes it (the same token when the tokenizer has the tag as one
    token). Occurrences never overlap (a tag has no repeated prefix)."""
    ends, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)  # ends[i]: characters of text up to and including token i
    text = "".join(pieces)

    def token_at(char: int) -> int:
        return next(i for i, e in enumerate(ends) if e > char)

    out: dict[str, list[tuple[int, int]]] = {}
    for name, tag in tags.items():
        found, start = [], text.find(tag)
        while start != -1:
            found.append((token_at(start), token_at(start + len(tag) - 1)))
            start = text.find(tag, start + len(tag))
        out[name] = found
    return out


def control_token_stats(
    input_ids: Tensor, loss_mask: Tensor, action_id: Tensor, sample_logp: Tensor, decode_tokens, eos_ids: Sequence[int]
) -> dict[str, SumCount]:
    """(sum, count) of the sampling probability of the control tokens the model wrote, per kind.

    A tag (<search>, </search>, <answer>, </answer>) in a model action counts with the joint
    probability of the tokens that spell it (``tag_spans``), exp of the sum of their sampled
    log-probs: BPE tokenizers often split "<search>" into "<", "search", ">", where the last token
    is near-certain and the decision sits in the first ones. A one-token tag counts with that
    token's probability; so does every sampled EOS token (``eos_ids``). Actions are decoded token
    by token with ``decode_tokens`` (list of ids -> list of strings, special tokens kept); text in
    observations is never counted.

    Keys: diag/p_search_open, diag/p_search_close, diag/p_answer_open, diag/p_answer_close, diag/p_eos.
    """
    sums = {name: [0.0, 0.0] for name in (*CONTROL_TAGS, "eos")}
    eos = set(int(i) for i in eos_ids)
    mask = loss_mask.bool()
    for b in range(input_ids.shape[0]):
        cols = mask[b].nonzero()[:, 0]
        if not len(cols):
            continue
        ids, acts, logp = input_ids[b, cols].tolist(), action_id[b, cols].tolist(), sample_logp[b, cols].double().tolist()
        start = 0
        for end in range(1, len(ids) + 1):
            if end < len(ids) and acts[end] == acts[start]:
                continue
            action = ids[start:end]  # one action: a maximal run of model tokens
            for name, spans in tag_spans(decode_tokens(action)).items():
                for first, last in spans:
                    sums[name][0] += math.exp(sum(logp[start + first : start + last + 1]))
                    sums[name][1] += 1
            for i, tok in enumerate(action):
                if tok in eos:
                    sums["eos"][0] += math.exp(logp[start + i])
                    sums["eos"][1] += 1
            start = end
    return {f"diag/p_{name}": (total, count) for name, (total, count) in sums.items()}


def tool_call_stats(num_searches: Tensor, num_actions: Tensor) -> dict[str, SumCount]:
    """diag/tool_call_rate: share of responses with at least one valid search; diag/searches_per_action:
    valid searches / actions, all responses together (k searches then an answer: k / (k + 1)). Both
    fall towards 0 when the agent stops calling the tool ("interaction collapse")."""
    return {
        "diag/tool_call_rate": (float((num_searches > 0).sum()), float(num_searches.numel())),
        "diag/searches_per_action": (float(num_searches.sum()), float(num_actions.sum())),
    }


# ------------------------------------------------------------------------------ phases

PHASE_NAMES = {0: "warm-up", 1: "stagnation", 2: "steady decay", 3: "acceleration"}


def ols_slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against 0, 1, 2, ... (per step); 0 for fewer than 2."""
    return ols_fit(values)[0]


def ols_fit(values: Sequence[float]) -> tuple[float, float]:
    """(slope, standard error of the slope) of a least-squares line through ``values`` against
    0, 1, 2, ...; the standard error is inf for fewer than 3 points."""
    n = len(values)
    if n < 2:
        return 0.0, math.inf
    x_mean = (n - 1) / 2.0
    y_mean = sum(values) / n
    den = sum((i - x_mean) ** 2 for i in range(n))
    slope = sum((i - x_mean) * (v - y_mean) for i, v in enumerate(values)) / den
    if n < 3:
        return slope, math.inf
    residual = sum((v - y_mean - slope * (i - x_mean)) ** 2 for i, v in enumerate(values))
    return slope, math.sqrt(residual / (n - 2) / den)


@dataclass
class PhaseConfig:
    """Thresholds of the death-spiral phase detector (docs/diagnostics.md, Phases). Units: the signal is a mean
    per-token log-prob (nats), so slopes are nats per token per training step.

    Args:
        ema_alpha: weight of the newest value in the exponential moving average that smooths the
            signal (1 = no smoothing).
        window: steps in the least-squares slope of the smoothed signal; also the warm-up length
            (phase 0 until this many values have been seen) and the baseline length for jumps.
        decay_slope: tau. Steady decay when the slope is below -tau ...
        min_t: ... and, to enter decay, the fall is significant: slope < -min_t x the standard
            error of a line fitted to the raw signal over the window (adapts to the noise level).
            Once decaying, slope < -tau suffices (hysteresis).
        accel_factor: acceleration (after steady decay) when the slope is below -accel_factor x
            max(|median slope of this decay so far|, tau): the fall got that many times steeper ...
        grad_jump: ... or the pre-clip grad norm (mean of the last ``jump_window`` steps) is this
            many times its baseline (median of the ``window`` steps before those). 0 disables.
        entropy_jump: ... or the same test on the policy entropy fires. 0 disables.
        jump_window: steps averaged for the jump tests.
        patience: consecutive steps a condition must hold before the phase changes (debounces noise).
    """

    ema_alpha: float = 0.3
    window: int = 10
    decay_slope: float = 1e-3
    min_t: float = 3.0
    accel_factor: float = 3.0
    grad_jump: float = 3.0
    entropy_jump: float = 1.5
    jump_window: int = 2
    patience: int = 4

    def __post_init__(self) -> None:
        require(0 < self.ema_alpha <= 1, "PhaseConfig.ema_alpha", "in (0, 1]", self.ema_alpha)
        require(self.window >= 3, "PhaseConfig.window", ">= 3", self.window)
        require(self.jump_window >= 1, "PhaseConfig.jump_window", ">= 1", self.jump_window)
        require(self.patience >= 1, "PhaseConfig.patience", ">= 1", self.patience)
        require(self.decay_slope > 0, "PhaseConfig.decay_slope", "> 0", self.decay_slope)
        require(self.accel_factor > 1, "PhaseConfig.accel_factor", "> 1", self.accel_factor)
        require(self.min_t >= 0, "PhaseConfig.min_t", ">= 0", self.min_t)


@dataclass
class PhaseUpdate:
    """What one step of the detector concluded."""

    phase: int
    smoothed: float
    slope: float
    warning: bool  # True on the step the detector entered acceleration
    reason: str = ""  # why acceleration was declared (empty otherwise)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


@dataclass
class PhaseDetector:
    """Tracks a smoothed likelihood signal and labels each step with a phase of the death spiral.

    phase 0 warm-up (fewer than ``window`` values), 1 stagnation (no significant fall: flat or
    rising), 2 steady decay (slope < -tau, significant), 3 acceleration (after steady decay, still
    falling and: the slope is accel_factor x steeper than the decay's median, or a grad-norm jump,
    or an entropy jump; so a warning always means decay turned into acceleration). A
    change of phase needs its condition ``patience`` steps in a row. ``warning`` is True on each
    step the phase becomes 3. A NaN signal (e.g. no A > 0 response this step) leaves the phase
    state unchanged. The state is plain numbers and lists (``state_dict``): a resumed run continues
    exactly.
    """

    config: PhaseConfig = field(default_factory=PhaseConfig)
    phase: int = 0
    smoothed: Optional[float] = None
    raw: list[float] = field(default_factory=list)  # the signal, last ``window`` values
    history: list[float] = field(default_factory=list)  # the smoothed signal, last ``window`` values
    grad_norms: list[float] = field(default_factory=list)  # last window + jump_window values
    entropies: list[float] = field(default_factory=list)
    decay_slopes: list[float] = field(default_factory=list)  # slopes of the current decay (last 4 x window)
    candidate: int = 0  # the phase whose condition is currently holding
    streak: int = 0  # for how many consecutive steps
    seen: int = 0  # finite signal values so far
    warnings: list[int] = field(default_factory=list)  # ``seen`` at each warning

    def _jump(self, series: list[float], factor: float) -> bool:
        cfg = self.config
        if factor <= 0 or len(series) < cfg.window + cfg.jump_window:
            return False
        recent = series[-cfg.jump_window :]
        base = _median(series[-(cfg.window + cfg.jump_window) : -cfg.jump_window])
        return sum(recent) / len(recent) > factor * max(base, 1e-12)

    def _target(self, slope: float) -> tuple[int, str]:
        cfg = self.config
        _, stderr = ols_fit(self.raw)
        # Hysteresis: entering decay needs a significant fall, staying in it only slope < -tau.
        significant = self.phase >= 2 or slope < -cfg.min_t * stderr
        if not (slope < -cfg.decay_slope and significant):
            return 1, ""
        if not self.decay_slopes:
            return 2, ""  # acceleration is a change of an ongoing decay: decay must be seen first
        reference = max(abs(_median(self.decay_slopes)), cfg.decay_slope)
        reasons = []
        if slope < -cfg.accel_factor * reference:
            reasons.append(f"likelihood slope {slope:.2e}/step is {abs(slope) / reference:.1f}x the decay's median slope")
        if self._jump(self.grad_norms, cfg.grad_jump):
            reasons.append(f"grad norm jumped > {cfg.grad_jump:g}x its baseline")
        if self._jump(self.entropies, cfg.entropy_jump):
            reasons.append(f"entropy jumped > {cfg.entropy_jump:g}x its baseline")
        return (3 if reasons else 2), "; ".join(reasons)

    def update(self, signal: float, grad_norm: float = float("nan"), entropy: float = float("nan")) -> PhaseUpdate:
        """Feed one step's signal (the correct responses' mean log-prob) and its companions."""
        cfg = self.config
        keep = cfg.window + cfg.jump_window
        if math.isfinite(grad_norm):
            self.grad_norms = (self.grad_norms + [float(grad_norm)])[-keep:]
        if math.isfinite(entropy):
            self.entropies = (self.entropies + [float(entropy)])[-keep:]
        if not math.isfinite(signal):
            slope = ols_slope(self.history) if len(self.history) >= cfg.window else 0.0
            return PhaseUpdate(self.phase, self.smoothed if self.smoothed is not None else float("nan"), slope, False)

        signal = float(signal)
        self.smoothed = signal if self.smoothed is None else cfg.ema_alpha * signal + (1 - cfg.ema_alpha) * self.smoothed
        self.raw = (self.raw + [signal])[-cfg.window :]
        self.history = (self.history + [self.smoothed])[-cfg.window :]
        self.seen += 1
        if len(self.history) < cfg.window:
            return PhaseUpdate(0, self.smoothed, 0.0, False)

        slope = ols_slope(self.history)
        target, reason = self._target(slope)
        if self.phase == 0:
            # Labelling starts from stagnation; leaving it needs ``patience`` steps like any change.
            self.phase, self.candidate, self.streak = 1, target, 1
        elif target == self.candidate:
            self.streak += 1
        else:
            self.candidate, self.streak = target, 1

        warning = False
        if target != self.phase and self.streak >= cfg.patience:
            if target == 1:
                self.decay_slopes = []
            warning = target == 3
            self.phase = target
            if warning:
                self.warnings.append(self.seen)
        if self.phase == 2:
            # The yardstick for "steeper": the typical (median) slope of this decay, robust to noise.
            self.decay_slopes = (self.decay_slopes + [slope])[-4 * cfg.window :]
        return PhaseUpdate(self.phase, self.smoothed, slope, warning, reason if warning else "")

    def state_dict(self) -> dict:
        state = asdict(self)
        state["config"] = asdict(self.config)
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if key == "config":
                continue  # thresholds come from the (possibly edited) config, not the checkpoint
            setattr(self, key, list(value) if isinstance(value, list) else value)
