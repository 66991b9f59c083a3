"""The math of GRPO and LLDS as pure functions over tensors (docs/algorithm.md §2 and §4).

Shapes: B rows (one rollout each), T token positions. Per-token tensors are [B, T] and aligned
with ``input_ids``: ``logp[b, t]`` is log pi(input_ids[b, t] | input_ids[b, :t]). ``mask`` is the
loss mask (1 on model-generated tokens only). Nothing here knows about Lightning or models.

Every loss is a sum over the given rows' tokens (or rows) divided by a normaliser the caller
passes in: the total of the whole mini-batch (lldslight/update/train.py), so that a mini-batch cut into
micro-batches, packed by tokens or spread over ranks sums to the same loss and gradient.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lldslight.errors import require_choice

Aggregation = Literal["token-mean", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k3"]
LLDSGate = Literal["action", "response", "token"]
LLDSNormaliser = Literal["preserving", "all"]
BetaRule = Literal["paper", "official"]
NegativeAdvantages = Literal["keep", "drop", "unshared"]
# Each choice set is defined once, here: the signatures of GRPOModule and the LLDS callback use
# these types, and the functions below check their argument against them (errors.require_choice).


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 (not NaN) for an empty mask."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def group_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """A_i = (r_i - mean_G r) / (std_G r + eps), std unbiased (N-1) as in the official code.

    A group whose rewards are all equal, or that has a single member, gets A = 0.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.to(torch.float64)
    n = counts.to(r.dtype)
    mean = torch.zeros_like(n).index_add_(0, inverse, r) / n
    centred = r - mean[inverse]
    if not normalize_std:
        return centred.to(rewards.dtype)
    sq = torch.zeros_like(n).index_add_(0, inverse, centred**2)
    std = torch.sqrt(sq / (n - 1).clamp(min=1.0))
    return (centred / (std[inverse] + eps)).to(rewards.dtype)


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantage: Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    ratio_clamp: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip per token: -min(gamma A, clip(gamma, 1-eps_low, 1+eps_high) A), gamma = exp(logp - old).

    ``advantage`` is per row [B] (broadcast over tokens). ``ratio_clamp``: gamma is first capped
    at this value (the official LLDS code caps it at 100; the paper and Search-R1 do not), which
    bounds the loss and zeroes the gradient of a token whose ratio exploded with A < 0.
    Returns (loss [B,T], ratio [B,T] before the cap, clipped [B,T] bool: the clipped branch was
    the active one).
    """
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    gamma = ratio if ratio_clamp is None else ratio.clamp(max=ratio_clamp)
    adv = advantage.unsqueeze(-1)
    unclipped = gamma * adv
    clipped = gamma.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, ratio, clipped < unclipped


def truncated_importance_weight(old_logp: Tensor, sample_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS) for a sampler that is not the trainer: per token
    min(pi_old / q, cap) = min(exp(old_logp - sample_logp), cap), with q the sampler's probability
    (a vLLM server's kernels, bf16) and pi_old the trainer's. Multiplying the policy-gradient loss by
    it (detached) makes the gradient an estimate under pi_old rather than q, its variance bounded
    by the cap (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"; TRL's ``vllm_importance_sampling_cap``, veRL's ``tis_imp_ratio_cap``). [B, T]; 1
    where both are 0 (padding, observations)."""
    return torch.exp(old_logp - sample_logp).clamp(max=cap).detach()


def shared_prefix_negatives(input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor, group_id: Tensor, advantage: Tensor) -> Tensor:
    """Model tokens [B, T] of A < 0 rows that lie inside the longest common prefix they share with
    some A > 0 row of their group (the same tokens at the same positions from the start: a group's
    rows share their prompt, so positions align). These are the tokens through which an incorrect
    response pushes its negative gradient onto a correct one's identical first actions (the
    paper's LLD route, Theorem 4.2; NTHR, arXiv 2505.18830, masks such tokens too)."""
    B, T = input_ids.shape
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    real = attention_mask.bool()
    for g in torch.unique(group_id).tolist():
        rows = (group_id == g).nonzero()[:, 0]
        neg = rows[advantage[rows] < 0]
        pos = rows[advantage[rows] > 0]
        if len(neg) == 0 or len(pos) == 0:
            continue
        # same[i, j, t]: row neg[i] and row pos[j] hold the same real token at t; the prefix runs
        # while every position so far matched (cumulative product along T).
        same = (input_ids[neg][:, None] == input_ids[pos][None]) & real[neg][:, None] & real[pos][None]  # [n, p, T]
        prefix = same.to(torch.int32).cumprod(-1).bool().any(1)  # [n, T]
        out[neg] = prefix & loss_mask[neg].bool()
    return out


def policy_gradient_weight(advantage: Tensor, mask: Tensor, mode: NegativeAdvantages, shared_prefix: Tensor | None = None) -> Tensor | None:
    """Per-token weight [B, T] of the policy-gradient term under a negative-gradient control, or
    None for plain GRPO ("keep"). "drop": rows with A < 0 get weight 0 (positive-only GRPO: are
    negative gradients necessary for the collapse?); "unshared": A < 0 tokens inside a shared
    prefix (``shared_prefix_negatives``) get weight 0. The normalisers are unchanged: a zeroed
    token still counts in its row's and the mini-batch's totals, so only the gradient changes."""
    require_choice(mode, "model.update.negative_advantages", NegativeAdvantages)
    if mode == "keep":
        return None
    if mode == "drop":
        return (advantage >= 0).to(torch.float32).unsqueeze(-1).expand(mask.shape)
    if shared_prefix is None:  # the caller's contract (train.py passes it), not a setting: a bug
        raise ValueError("policy_gradient_weight('unshared') needs the shared-prefix mask")
    return (~shared_prefix).to(torch.float32)


def aggregate(loss: Tensor, mask: Tensor, mode: Aggregation, normaliser: float | Tensor) -> Tensor:
    """Reduce a per-token loss to this batch's part of a mini-batch scalar.

    seq-mean-token-mean (paper): each response's token mean, summed over responses, divided by
    ``normaliser`` = the mini-batch's responses that have model tokens. token-mean (official
    code): the token sum divided by ``normaliser`` = the mini-batch's model tokens.
    """
    require_choice(mode, "model.update.aggregation", Aggregation)
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        total = (loss * mask).sum()
    else:  # seq-mean-token-mean
        total = ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()  # a row without tokens adds 0
    return total / max(float(normaliser), 1.0)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate.

    k1: logp - ref. k3 ("low_var_kl"): exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    require_choice(estimator, "model.update.kl_estimator", KLEstimator)
    if estimator == "k1":
        return logp - ref_logp
    log_ratio = ref_logp - logp  # k3
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def answer_weight_beta(
    mean_valid_searches: float, rule: BetaRule = "paper", coef: float = 1.0, answer_coef: float | None = None
) -> float:
    """LLDS-MA's weight beta on the final-answer tokens from V, the mean valid searches per trajectory.

    paper: min(V/2, 1). official code: answer tokens get the coefficient
    min(answer_coef * max(V-1, 0), coef) instead of lambda = ``coef``, i.e.
    beta = min(answer_coef * max(V-1, 0), coef) / coef; ``answer_coef`` defaults to ``coef``,
    which gives clip(V-1, 0, 1).
    """
    require_choice(rule, "answer_weight_beta rule (LLDS.answer_masking)", BetaRule)
    if rule == "paper":
        return min(mean_valid_searches / 2.0, 1.0)
    lam_answer = coef if answer_coef is None else answer_coef  # official
    if coef <= 0:
        return 1.0  # lambda = 0: the term is off and its answer weight moot
    return min(lam_answer * max(mean_valid_searches - 1.0, 0.0), coef) / coef


def action_sums(values: Tensor, action_id: Tensor) -> Tensor:
    """Per-action sums: out[b, a] = sum of ``values[b, t]`` over the tokens t of action a of row b
    ([B, T] -> [B, T]; slots past a row's last action are 0). ``values`` must be 0 off the model
    tokens (action_id -1 maps to slot 0). One scatter: an action has at least one token, so T
    slots always suffice and sizing them needs no host sync."""
    return torch.zeros_like(values).scatter_add_(1, action_id.clamp(min=0), values)


def llds_penalty(
    logp: Tensor,
    old_logp: Tensor,
    advantage: Tensor,
    mask: Tensor,
    action_id: Tensor,
    normaliser: float | Tensor,
    gate: LLDSGate = "action",
    token_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L_LLDS: a one-sided pull of preserved responses' likelihood back up to pi_old (docs/algorithm.md §4, docs/llds.md).

    d = old_logp - logp per token (> 0: its likelihood fell). Preserving set P = rows with A >= 0;
    only model tokens (``mask``) count. A token of P is *gated in* when the sum of d over its
    action (gate="action": a maximal run of model tokens, ``action_id``), over its whole response
    ("response"), or the token alone ("token") is positive; it then contributes max(0, d) times
    its ``token_weight`` (LLDS-MA: beta on answer tokens, 1 elsewhere; the gate sums use the
    unweighted d). The sum is divided by ``normaliser``: the mini-batch's model tokens of P
    (paper) or all its model tokens (official code).

    The gradient w.r.t. ``logp`` is -weight/N on every contributing token and 0 elsewhere.

    Returns (loss, diagnostics as detached float tensors, counts over these rows):
        active_actions: (row, action) pairs with at least one contributing token;
        active_tokens: contributing tokens (gated in, d > 0, weight > 0);
        preserving_tokens: model tokens of P.
    """
    require_choice(gate, "LLDS.gate", LLDSGate)
    model_tok = mask.bool()
    preserving = model_tok & (advantage >= 0).unsqueeze(-1)
    d = (old_logp - logp).masked_fill(~preserving, 0.0)
    d_sum_source = d.detach()

    if gate == "token":
        open_gate = preserving
    elif gate == "response":
        open_gate = preserving & (d_sum_source.sum(-1, keepdim=True) > 0)
    else:  # action
        open_gate = preserving & (action_sums(d_sum_source, action_id).gather(1, action_id.clamp(min=0)) > 0)

    contribution = torch.relu(d) * open_gate
    active = open_gate & (d_sum_source > 0)
    if token_weight is not None:
        contribution = contribution * token_weight
        active = active & (token_weight > 0)
    loss = contribution.sum() / max(float(normaliser), 1.0)

    has_active = action_sums(active.to(d_sum_source.dtype), action_id) > 0
    diagnostics = {
        "active_actions": has_active.sum().to(logp.dtype),
        "active_tokens": active.sum().to(logp.dtype),
        "preserving_tokens": preserving.sum().to(logp.dtype),
    }
    return loss, diagnostics
