"""Token log-probs (and entropy) of a causal LM, computed in chunks from hidden states.

The decoder runs once over the batch; the vocabulary projection runs only on the positions that
carry loss, a chunk at a time, and under activation checkpointing when gradients are needed. So a
full [B, T, V] logits tensor never exists: at V = 49k (SmolLM2) or 152k (Qwen2.5) it would be the
largest tensor of the step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lldslight.policy import decoder_and_head


def _chunk_stats(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, entropy: str, logged: list):
    """log-probs of ``targets`` [n] from ``hidden`` [n, H]; the entropy [n] too when ``entropy`` is
    "loss" (returned, with graph). A "logged" entropy (no graph) goes into ``logged`` on the first
    call only: under activation checkpointing the backward calls this again to rebuild the chunk's
    activations, and a diagnostic needs no rebuilding."""
    logits = head(hidden)  # [n, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 (bf16/fp16 upcast)
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy == "loss":
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    if entropy == "logged" and not logged:
        with torch.no_grad():  # its [n, V] intermediates are freed at once
            logged.append(-(logp_all.exp() * logp_all).sum(-1))
    return logp, None


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    mask: Tensor,
    chunk_size: int = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """log pi(input_ids[b, t] | input_ids[b, :t]) and the entropy at t, where ``mask[b, t]``.

    ``entropy_grad=False``: the entropy is a detached diagnostic (no entropy bonus in the loss).

    Returns two [B, T] tensors in float32 (float64 for a float64 model), zero where ``mask`` is off
    (including t = 0).
    """
    decoder, head = decoder_and_head(model)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    mask = mask.bool().clone()
    mask[:, 0] = False  # the first token has no context to be predicted from
    rows, cols = mask.nonzero(as_tuple=True)
    selected = hidden[rows, cols - 1]
    targets = input_ids[rows, cols]
    mode = ("loss" if entropy_grad else "logged") if with_entropy else "none"
    logp_parts, entropy_parts = [], []
    need_grad = torch.is_grad_enabled() and selected.requires_grad
    for start in range(0, selected.shape[0], chunk_size):
        h, y = selected[start : start + chunk_size], targets[start : start + chunk_size]
        logged: list[Tensor] = []  # a fresh one per chunk: filled by the forward, full when recomputed
        if need_grad:
            lp, ent = checkpoint(_chunk_stats, head, h, y, temperature, mode, logged, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(head, h, y, temperature, mode, logged)
        logp_parts.append(lp)
        entropy_parts.append(ent if ent is not None else logged[0] if logged else torch.zeros_like(lp))
    if not logp_parts:
        logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        return logp, torch.zeros_like(logp)
    values = torch.cat(logp_parts)
    logp = values.new_zeros(input_ids.shape).index_put((rows, cols), values)
    entropy = values.new_zeros(input_ids.shape).index_put((rows, cols), torch.cat(entropy_parts))
    return logp, entropy
