"""Token log-probs (and entropy) of a causal LM, computed in chunks from hidden states.

The decoder runs once over the batch; the vocabulary projection runs only on the positions that
carry loss, a chunk of c positions at a time. At V = 49k (SmolLM2) or 152k (Qwen2.5) the logits
are the largest tensors of the step, so no tensor of size [positions, V] is kept for the backward.
One custom autograd Function (``ChunkedLogprob``), per chunk:

    z = h W^T / T                            [c, V], freed before the next chunk
    log p(t) = z[t] - logsumexp(z)           kept: [c]
    H = -sum_j p_j log p_j                   [c], in the same pass (no graph when only logged)
    d log p(t) / d h = (W[t] - softmax(z) W) / T     [c, H]: with LoRA the head is frozen, so this
                                                     is all the backward needs (one multiply)

so the backward computes no logits again and runs no log_softmax backward. A trainable head
(full fine-tuning) needs d/dW too: then the forward keeps the log-sum-exp [c] and the backward
recomputes each chunk's z and forms g (onehot(t) - softmax(z)) in place. The chunk size comes
from a byte budget per [c, V] fp32 buffer (``chunk_bytes``): a chunk holds at most two.

Precision (docs/precision.md): the projection h W^T (and the Jacobian's softmax(z) W) runs in the
compute dtype, bf16 under policy.precision bf16-mixed / bf16-true, with fp32 accumulation; its bf16
logits are upcast before anything else, so the max, the log-sum-exp, log p, the entropy and every
gradient into the loss are fp32. :func:`token_logprobs` runs the whole forward under the model's
precision (``precision_autocast``), exactly as the sampler does; inside ``ChunkedLogprob``
autocast is off and the dtypes are explicit (autocast would run the entropy's bmm in bf16).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.autograd.profiler import record_function
from torch.utils.checkpoint import checkpoint

from lldslight.update import frozen_prefix, shared_prefix
from lldslight.policy.load import causal_lm, decoder_and_head
from lldslight.policy.precision import precision_autocast

CHUNK_BYTES = 32 * 2**20  # one [chunk, V] fp32 buffer: 170 positions at V = 49k, 55 at 152k


def chunk_positions(vocab: int, chunk_size: Optional[int] = None, chunk_bytes: int = CHUNK_BYTES, n: Optional[int] = None) -> int:
    """Positions per vocabulary chunk: at most ``chunk_size`` if given, else as many as fit one fp32
    [chunk, vocab] buffer in ``chunk_bytes`` (at least 1); with ``n`` positions, chunks of equal
    size (256 positions in chunks of at most 170 are 2 x 128, not 170 + 86: a small last chunk
    runs its matmul at a poorer rate)."""
    most = int(chunk_size) if chunk_size else max(1, chunk_bytes // (4 * vocab))
    if not n:
        return most
    return -(-n // -(-n // most))


def _logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float) -> Tensor:
    """z = (h W^T + b) / T for one chunk, [c, V], at least fp32 (bf16/fp16 logits are upcast)."""
    z = F.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if temperature != 1.0:
        z.div_(temperature)
    return z


class ChunkedLogprob(torch.autograd.Function):
    """(log p(targets), entropy) [n] from hidden states [n, H] and the output projection.

    ``entropy``: "none" (returns zeros), "logged" (computed in the forward, no gradient) or
    "loss" (with gradient). ``backward``:

    - "input": only the hidden states need a gradient (a frozen head: LoRA). d log p / d h =
      (W[target] - softmax(z) W) / T does not depend on the loss, so the forward computes it
      with the softmax at hand (one [c, V] x [V, H] matmul, as the backward would) and keeps it,
      [n, H]; the backward is one multiply, and no logits are ever computed again;
    - "recompute": the weight (or bias) needs a gradient too (full fine-tuning): the forward keeps
      the log-sum-exp [n], the backward computes each chunk's logits again;
    - "none": no backward (no-grad passes).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, temperature: float,
                chunk: int, entropy: str, backward: str, compute_dtype: Optional[torch.dtype] = None):
        ctx.compute_dtype = compute_dtype
        with torch.autocast(hidden.device.type, enabled=False):
            return ChunkedLogprob._forward(ctx, hidden, weight, bias, targets, temperature, chunk, entropy, backward)

    @staticmethod
    def _forward(ctx, hidden_in: Tensor, weight_in: Tensor, bias_in: Optional[Tensor], targets: Tensor, temperature: float,
                 chunk: int, entropy: str, backward: str):
        # The projection's operands in the compute dtype: one cast of the head per call (a no-op
        # when it is stored in it), as autocast would do for the sampler's head(hidden).
        hidden, weight, bias = _in_compute_dtype(ctx.compute_dtype, hidden_in, weight_in, bias_in)
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        jac = torch.empty(n, hidden.shape[1], dtype=dtype, device=hidden.device) if backward == "input" else None
        jac_ent = torch.empty_like(jac) if backward == "input" and entropy == "loss" else None
        for s in range(0, n, chunk):
            sl = slice(s, s + chunk)
            z = _logits(hidden[sl], weight, bias, temperature)  # [c, V]
            m = z.amax(-1, keepdim=True)  # [c, 1]
            z.sub_(m)
            target_z = z.gather(-1, targets[sl, None])[:, 0]  # [c]
            keep_z = entropy != "none"
            p = torch.exp(z) if keep_z else z.exp_()  # [c, V], unnormalised; in place when z is done with
            sum_exp = p.sum(-1)  # [c]
            log_sum = sum_exp.log()
            logp[sl] = target_z - log_sum
            lse[sl] = m[:, 0] + log_sum
            if keep_z:
                # H = log S - sum_j p_j z_j / S (z shifted by the max); bmm: no [c, V] product
                ent[sl] = log_sum - torch.bmm(p[:, None], z[:, :, None])[:, 0, 0] / sum_exp
            if jac is not None:
                p.div_(sum_exp[:, None])  # softmax
                jac[sl] = (weight[targets[sl]] - p.to(weight.dtype) @ weight).to(dtype) / temperature
                if jac_ent is not None:
                    # dH/dz_k = -p_k (log p_k + H)
                    z.sub_(log_sum[:, None]).add_(ent[sl, None]).mul_(p)
                    jac_ent[sl] = -(z.to(weight.dtype) @ weight).to(dtype) / temperature
            del z, p
        if backward == "input":
            ctx.save_for_backward(jac, jac_ent)
        elif backward == "recompute":
            # The stored tensors, not their casts: the backward casts again (no second head copy kept).
            ctx.save_for_backward(hidden_in, weight_in, bias_in, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.entropy, ctx.mode, ctx.hidden_dtype = temperature, chunk, entropy, backward, hidden_in.dtype
        ctx.set_materialize_grads(False)  # an unused entropy's gradient stays None, not [n] zeros
        if entropy != "loss":
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor]):
        device = (g_logp if g_logp is not None else g_ent).device
        with torch.autocast(device.type, enabled=False):
            return ChunkedLogprob._backward(ctx, g_logp, g_ent) + (None,)

    @staticmethod
    def _backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor]):
        if ctx.mode == "none":
            raise RuntimeError("ChunkedLogprob was run with backward='none': it keeps nothing to differentiate")
        entropy_grad = ctx.entropy == "loss" and g_ent is not None
        if ctx.mode == "input":
            jac, jac_ent = ctx.saved_tensors
            grad_h = jac * g_logp[:, None] if g_logp is not None else torch.zeros_like(jac)
            if entropy_grad:
                grad_h += jac_ent * g_ent[:, None]
            return grad_h.to(ctx.hidden_dtype), None, None, None, None, None, None, None
        hidden_in, weight_in, bias_in, targets, lse, ent = ctx.saved_tensors
        hidden, weight, bias = _in_compute_dtype(ctx.compute_dtype, hidden_in, weight_in, bias_in)
        if g_logp is None:  # only the entropy is used
            g_logp = torch.zeros_like(lse)
        T, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_in) if need_h else None
        grad_w = torch.zeros_like(weight_in, dtype=lse.dtype) if need_w else None  # fp32 accumulation
        grad_b = torch.zeros_like(bias_in, dtype=lse.dtype) if need_b and bias_in is not None else None
        for s in range(0, hidden.shape[0], chunk):
            sl = slice(s, s + chunk)
            h, g = hidden[sl], g_logp[sl, None]  # [c, H], [c, 1]
            logp_all = _logits(h, weight, bias, T).sub_(lse[sl, None])  # [c, V]
            if entropy_grad:
                # dH/dz_k = -p_k (log p_k + H): scale = g_logp + g_ent (log p + H)
                scale = logp_all.add(ent[sl, None]).mul_(g_ent[sl, None]).add_(g)
                grad_z = logp_all.exp_().mul_(scale).neg_()
                del scale
            else:
                grad_z = logp_all.exp_().mul_(-g)  # -g p, in place
            grad_z.scatter_add_(-1, targets[sl, None], g)  # + g at the target
            if T != 1.0:
                grad_z.div_(T)
            if need_h:
                grad_h[sl] = grad_z.to(weight.dtype) @ weight
            if need_w:
                grad_w.addmm_(grad_z.t(), h.to(grad_w.dtype))
            if grad_b is not None:
                grad_b += grad_z.sum(0)
            del grad_z, logp_all
        if grad_w is not None:
            grad_w = grad_w.to(weight_in.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias_in.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _in_compute_dtype(dtype: Optional[torch.dtype], *tensors: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    if dtype is None:
        return tensors
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _logits_stats(head: nn.Module, h: Tensor, targets: Tensor, temperature: float, entropy: str) -> tuple[Tensor, Tensor]:
    """Any other output layer (e.g. one with its own LoRA adapter): plain autograd on one chunk,
    checkpointed by the caller so that its [c, V] tensors are not kept for the backward."""
    logits = head(h)
    logp_all = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)  # [c, V]
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    if entropy == "none":
        return logp, torch.zeros_like(logp)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy == "loss"):
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    mask: Tensor,
    chunk_size: Optional[int] = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    groups: Optional[Tensor] = None,
    boundary: Optional["frozen_prefix.Boundary"] = None,
) -> tuple[Tensor, Tensor]:
    """log pi(input_ids[b, t] | input_ids[b, :t]) and the entropy at t, where ``mask[b, t]``.

    ``chunk_size``: positions per vocabulary chunk (default: from ``chunk_bytes``, see
    :func:`chunk_positions`). ``entropy_grad=False``: the entropy is a detached diagnostic (no
    entropy bonus in the loss), computed in the forward only. ``groups`` [B]: rows with the same
    value may share their common prefix of token ids, encoded once (lldslight/update/shared_prefix.py;
    the same values and gradients); None runs every row in full. ``boundary``: the hidden state
    entering the first trained layer, stored once per rollout batch (lldslight/update/frozen_prefix.py):
    only the layers from there up run.

    Returns two [B, T] tensors in float32 (float64 for a float64 model), zero where ``mask`` is off
    (including t = 0).
    """
    with precision_autocast(model):  # the sampler's arithmetic (policy.precision), for every forward
        return _token_logprobs(model, input_ids, attention_mask, mask, chunk_size, temperature, with_entropy, entropy_grad, chunk_bytes,
                               groups, boundary)


def _token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, mask: Tensor, chunk_size: Optional[int],
                    temperature: float, with_entropy: bool, entropy_grad: bool, chunk_bytes: int,
                    groups: Optional[Tensor] = None, boundary: Optional["frozen_prefix.Boundary"] = None) -> tuple[Tensor, Tensor]:
    decoder, head = decoder_and_head(model)
    mask = mask.bool().clone()
    mask[:, 0] = False  # the first token has no context to be predicted from
    rows, cols = mask.nonzero(as_tuple=True)
    layout = shared_prefix.pack_groups(input_ids, attention_mask, groups) if groups is not None and shared_prefix.supported(model) else None
    if layout is not None:
        # one packed sequence, each group's shared prefix once: row b's position t is row_index[b, t]
        if boundary is not None:
            hidden = frozen_prefix.top_hidden(model, boundary.hidden, boundary.start, input_ids, attention_mask, layout)  # [N, H]
        else:
            hidden = shared_prefix.packed_hidden(decoder, layout, getattr(causal_lm(model).config, "num_hidden_layers", None))  # [N, H]
        selected = hidden[layout.row_index[rows, cols - 1]]  # [n, H]
    else:
        if boundary is not None:
            hidden = frozen_prefix.top_hidden(model, boundary.hidden, boundary.start, input_ids, attention_mask)  # [B, T, H]
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # [B, T, H]
        selected = hidden[rows, cols - 1]  # [n, H]
    targets = input_ids[rows, cols]  # [n]
    entropy = ("loss" if entropy_grad else "logged") if with_entropy else "none"
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    if selected.shape[0] == 0:
        logp = torch.zeros(input_ids.shape, dtype=out_dtype, device=input_ids.device)
        return logp, torch.zeros_like(logp)
    with record_function("vocab projection"):  # a profiler label (benchmarks/profiling.py); free otherwise
        values, ent = _project(model, head, selected, targets, temperature, entropy, chunk_size, chunk_bytes)
    logp = values.new_zeros(input_ids.shape).index_put((rows, cols), values)
    return logp, values.new_zeros(input_ids.shape).index_put((rows, cols), ent)


def _project(model: nn.Module, head: nn.Module, selected: Tensor, targets: Tensor, temperature: float, entropy: str,
             chunk_size: Optional[int], chunk_bytes: int) -> tuple[Tensor, Tensor]:
    """(log-probs, entropies) [n] of ``targets`` from hidden states ``selected`` [n, H]."""
    weight = getattr(head, "weight", None)
    if isinstance(head, nn.Linear) and weight is not None and weight.is_floating_point():
        chunk = chunk_positions(weight.shape[0], chunk_size, chunk_bytes, selected.shape[0])
        if not torch.is_grad_enabled():
            backward = "none"
        elif weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
            backward = "recompute"
        else:
            backward = "input" if selected.requires_grad else "none"
        device = selected.device.type
        # Under autocast (bf16-mixed) the projection computes in its dtype, as the sampler's head does.
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) and weight.dtype in (torch.float32, torch.float64) else None
        return ChunkedLogprob.apply(selected, weight, head.bias, targets, temperature, chunk, entropy, backward, compute)
    chunk = chunk_positions(causal_lm(model).config.vocab_size, chunk_size, chunk_bytes, selected.shape[0])
    stats = _logits_stats
    if torch.is_grad_enabled() and selected.requires_grad:
        stats = lambda *a: checkpoint(_logits_stats, *a, use_reentrant=False)  # noqa: E731
    parts = [stats(head, selected[s : s + chunk], targets[s : s + chunk], temperature, entropy)
             for s in range(0, selected.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
