"""Encode a group's shared prompt once in the update's forwards (Prefix Grouper, arXiv 2506.05433).

A group's G rollouts start with the same prompt. The plain forward runs [B, T] right-padded rows,
so every update pass (pi_old's and the reference's log-probs, the training forward and backward,
LLDMonitor's after-step forward) encodes that prompt G times. Here a micro-batch runs as one
packed sequence [1, N] instead: for each group, its rows' longest common prefix of token ids once,
then each row's own tokens after it (no padding anywhere):

    [ prefix_g | suffix_g,1 | suffix_g,2 | ... | prefix_h | suffix_h,1 | ... ]

Every per-token operation (embeddings, norms, projections, MLPs, the rotary embedding at the
position ids given: a token keeps its column in its row as position) is the same computation on
fewer tokens. Only attention mixes tokens, and it is split in two exact parts: the prefixes'
causal self-attention, and each suffix's attention over its group's prefix keys and its own
earlier keys. A token therefore attends to exactly the keys it attends to in its own row, with
the same values. The keys of each attention are gathered into the plain row's layout (key t at
index t, as wide as the micro-batch), because sdpa's result for a query depends on where its keys
lie and how many there are, not on which other queries run: so each query's sum runs in the plain
forward's order, and the forward's outputs come out equal to the plain forward's (bit for bit on
the machine this was written on; to fp32 rounding wherever a matmul's blocking depends on its
row count), and a row's log-probs do not depend on which rows share its micro-batch, as in the
plain forward (pi_old's no-grad pass and the training pass pack differently). The prefix's keys
and values are gathered once per row, and that gather's backward sums the rows' gradients into
the one prefix computation: the plain gradient, the sum over the G copies of the prefix (summed
in another order: equal to fp32 rounding).

Why an attention function switched by a keyword argument, not a KV cache (run the prefix with a
DynamicCache, then the suffixes over it): transformers drops the cache of a decoder layer under
activation checkpointing (on by default here), and a cache written in the forward would be written
again by the backward's recompute. The keyword argument (the :class:`PackedGroups` layout) travels
with each layer's call, so the checkpoint's recompute replays the same split attention. transformers
looks the attention function up by the config's name ("sdpa") at every call, including that
recompute, so this module registers, through transformers' own AttentionInterface, an "sdpa" that
runs the split attention when the call carries the layout and is transformers' sdpa unchanged
otherwise. Each half of the split is computed by transformers' sdpa function itself (its GQA and
scaling handling), with a boolean mask.

The shared part is found from the token ids (the rows' longest common prefix within a group,
cut so that each row keeps at least one token of its own), never assumed: it is the prompt, or
more when rollouts begin alike, and less if a group's prompts differ. Rows whose real tokens are
not a prefix of the row (left padding), models whose attention is not plain full-attention sdpa
(eager, sliding windows, soft-capping), and micro-batches with neither a repeated prefix nor
padding run the plain forward (a micro-batch with padding but no repeated prefix runs packed:
no padding, so a token budget holds).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

LAYOUT_KWARG = "lldslight_packed_groups"
_PLAIN: dict = {}  # transformers' own "sdpa" function, which the registered one calls without a layout


class CallCount:
    """A counter shared by every copy of a layout: FSDP2's mixed precision re-creates dataclass
    arguments (torch.distributed.utils._apply_to_tensors: dataclasses.replace) on their way into
    each layer, so a plain int field would count on copies and read 0 afterwards; an object that is
    not a tensor, list or dataclass is passed through as the same object."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


@dataclass
class PackedGroups:
    """A micro-batch of B right-padded rows as one packed sequence of N tokens, and its attention
    split. Index tensors point into the packed sequence; "slot" padding (prefixes shorter than the
    longest, suffixes shorter than the longest) points at position 0 and is masked."""

    input_ids: Tensor  # [1, N] the packed tokens
    position_ids: Tensor  # [1, N] each token's column in its own row
    row_index: Tensor  # [B, T] packed position of row b's token t (0 where padding)
    prefix_index: Tensor  # [n_g, P] packed positions of each group's shared prefix (P: the longest)
    prefix_keys: Tensor  # [n_g, T] packed positions of the keys of each group's first row (as row_index)
    prefix_mask: Tensor  # [n_g, 1, P, T] bool: a prefix token sees the keys up to itself
    suffix_index: Tensor  # [B, S] packed positions of each row's own tokens (S: the longest)
    suffix_mask: Tensor  # [B, 1, S, T] bool: row b's own tokens see its keys up to themselves
    output_index: Tensor  # [N] where each packed token's output lies in cat(prefix slots, suffix slots)
    tokens_plain: int  # B x T: what the plain forward encodes
    source_rows: Optional[Tensor] = None  # [N] the row each packed token is taken from
    source_cols: Optional[Tensor] = None  # [N] its column in that row (frozen_prefix gathers stored hidden states by them)
    calls: "CallCount" = field(default_factory=lambda: CallCount())  # attention calls that ran split (checked after the forward)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def common_prefix_lengths(input_ids: Tensor, lengths: Tensor, groups: Tensor) -> Tensor:
    """[B] the length of the prefix row b shares with the other rows of its group: their longest
    common prefix of token ids, at most the group's shortest row minus one (each row keeps one
    token of its own); 0 for a row alone in its group."""
    out = torch.zeros(len(groups), dtype=torch.long)
    lengths = lengths.cpu()
    for g in torch.unique(groups).tolist():
        rows = (groups == g).nonzero()[:, 0].cpu()
        if len(rows) < 2:
            continue
        shortest = int(lengths[rows].min())
        ids = input_ids[rows.to(input_ids.device), :shortest]  # [k, shortest]
        same = (ids == ids[:1]).all(0).cpu()  # [shortest]
        differ = (~same).nonzero()
        lcp = int(differ[0, 0]) if len(differ) else shortest
        out[rows] = min(lcp, shortest - 1)
    return out


def pack_groups(input_ids: Tensor, attention_mask: Tensor, groups: Tensor) -> Optional[PackedGroups]:
    """The packed layout of right-padded rows ``input_ids`` [B, T] whose rows of equal ``groups``
    [B] share their common prefix; None when it would save nothing (no prefix repeats and no row is
    padded) or a row is not right-padded (the plain forward then runs). Without a repeated prefix
    the layout still drops the padding, so that a micro-batch packed by tokens (micro_batches)
    never runs more tokens than its budget."""
    B, T = input_ids.shape
    real = attention_mask.bool()
    lengths = real.sum(-1)  # [B]
    positions = torch.arange(T, device=real.device)
    if not bool((real == (positions[None] < lengths[:, None])).all()) or bool((lengths == 0).any()):
        return None
    groups = groups.to(torch.long).cpu()
    shared = common_prefix_lengths(input_ids, lengths, groups)  # [B]
    if int(shared.sum()) == 0 and int(lengths.sum()) == B * T:
        return None
    lengths_cpu = lengths.cpu()
    order = list(dict.fromkeys(groups.tolist()))  # groups in order of first appearance
    slot_of = {g: i for i, g in enumerate(order)}
    prefix_len = torch.zeros(len(order), dtype=torch.long)
    prefix_start = torch.zeros(len(order), dtype=torch.long)
    suffix_start = torch.zeros(B, dtype=torch.long)
    cursor = 0
    for g in order:
        rows = (groups == g).nonzero()[:, 0]
        p = int(shared[rows[0]])
        prefix_start[slot_of[g]], prefix_len[slot_of[g]] = cursor, p
        cursor += p
        for r in rows.tolist():
            suffix_start[r] = cursor
            cursor += int(lengths_cpu[r]) - p
    N = cursor
    suffix_len = lengths_cpu - shared  # [B], >= 1
    P, S = int(prefix_len.max()), int(suffix_len.max())
    slot = torch.tensor([slot_of[g] for g in groups.tolist()], dtype=torch.long)  # [B]

    # row_index[b, t]: the prefix slot's packed position for t < shared[b], else the suffix's
    cols = torch.arange(T)
    in_prefix = cols[None] < shared[:, None]  # [B, T]
    row_index = torch.where(in_prefix, prefix_start[slot][:, None] + cols[None], suffix_start[:, None] + cols[None] - shared[:, None])
    row_index = torch.where(cols[None] < lengths_cpu[:, None], row_index, 0)

    p_cols, s_cols = torch.arange(P), torch.arange(S)
    prefix_valid = p_cols[None] < prefix_len[:, None]  # [n_g, P]
    suffix_valid = s_cols[None] < suffix_len[:, None]  # [B, S]
    prefix_index = torch.where(prefix_valid, prefix_start[:, None] + p_cols[None], 0)
    suffix_index = torch.where(suffix_valid, suffix_start[:, None] + s_cols[None], 0)
    # Keys are laid out as in the plain row, T wide (key t at index t: row_index), so each query
    # reduces over the same keys at the same indices and the same length as in the plain forward:
    # the same sums in the same order (sdpa's result depends on the key length, not on which
    # queries run with it). A query at column t sees keys 0..t of its row (a padding slot, past its
    # row's end, sees the whole row: never an empty softmax, whose NaN would poison the backward).
    first_row = torch.tensor([int((groups == g).nonzero()[0, 0]) for g in order])  # [n_g]
    prefix_mask = (cols[None, None] <= p_cols[None, :, None]) & (cols[None, None] < lengths_cpu[first_row][:, None, None])  # [n_g, P, T]
    query_col = shared[:, None] + s_cols[None]  # [B, S]
    suffix_mask = (cols[None, None] <= query_col[:, :, None]) & (cols[None, None] < lengths_cpu[:, None, None])  # [B, S, T]

    at_prefix, at_suffix = prefix_index[prefix_valid], suffix_index[suffix_valid]
    output_index = torch.empty(N, dtype=torch.long)
    output_index[at_prefix] = torch.arange(len(order) * P).view(len(order), P)[prefix_valid]
    output_index[at_suffix] = len(order) * P + torch.arange(B * S).view(B, S)[suffix_valid]

    # which row and column each packed token is taken from
    flat_rows = torch.empty(N, dtype=torch.long)
    flat_cols = torch.empty(N, dtype=torch.long)
    flat_rows[at_prefix] = first_row[:, None].expand(len(order), P)[prefix_valid]
    flat_cols[at_prefix] = p_cols[None].expand(len(order), P)[prefix_valid]
    flat_rows[at_suffix] = torch.arange(B)[:, None].expand(B, S)[suffix_valid]
    flat_cols[at_suffix] = (shared[:, None] + s_cols[None])[suffix_valid]
    device = input_ids.device
    return PackedGroups(
        input_ids=input_ids[flat_rows.to(device), flat_cols.to(device)][None],
        position_ids=flat_cols[None].to(device),
        row_index=row_index.to(device),
        prefix_index=prefix_index.to(device),
        prefix_keys=row_index[first_row].to(device),
        prefix_mask=prefix_mask[:, None].to(device),
        suffix_index=suffix_index.to(device),
        suffix_mask=suffix_mask[:, None].to(device),
        output_index=output_index.to(device),
        tokens_plain=B * T,
        source_rows=flat_rows.to(device),
        source_cols=flat_cols.to(device),
    )



# -- the split attention ------------------------------------------------------------------------------


def split_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, layout: PackedGroups,
                    dropout: float = 0.0, scaling: Optional[float] = None, **kwargs) -> tuple[Tensor, None]:
    """Attention over the packed sequence: query [1, h, N, d], key and value [1, h_kv, N, d] ->
    [1, N, h, d] (transformers' attention-function contract). The prefixes' causal self-attention
    and the suffixes' attention over prefix + own keys, each one call of transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise RuntimeError("shared-prefix attention got a sliding window or soft-capping; the model should have run the plain "
                           "forward (shared_prefix.supported)")
    q, k, v = query[0], key[0], value[0]  # [h, N, d]

    def slots(x: Tensor, index: Tensor) -> Tensor:  # [h, N, d], [m, s] -> [m, h, s, d]
        return x[:, index].transpose(0, 1)

    # each group's prefix queries over its first row's keys; each row's own queries over its keys:
    # its group's prefix (indexed once per row: the backward sums the rows' gradients into the one
    # prefix computation), then its own
    h, d = q.shape[0], v.shape[-1]
    out_prefix = q.new_empty(0, h, d)  # no group shares a prefix: the layout only drops the padding
    if layout.prefix_index.shape[1]:
        out_prefix, _ = sdpa_attention_forward(module, slots(q, layout.prefix_index), slots(k, layout.prefix_keys),
                                               slots(v, layout.prefix_keys), layout.prefix_mask,
                                               dropout=dropout, scaling=scaling, **kwargs)  # [n_g, P, h, d]
    k_rows, v_rows = slots(k, layout.row_index), slots(v, layout.row_index)  # [B, h_kv, T, d]
    out_suffix, _ = sdpa_attention_forward(module, slots(q, layout.suffix_index), k_rows, v_rows, layout.suffix_mask,
                                           dropout=dropout, scaling=scaling, **kwargs)  # [B, S, h, d]
    out = torch.cat([out_prefix.reshape(-1, h, d), out_suffix.reshape(-1, h, d)])[layout.output_index]  # [N, h, d]
    layout.calls.n += 1
    return out[None], None


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], **kwargs):
    """transformers' "sdpa" attention function, or the split one when the call carries a layout."""
    layout = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return _PLAIN["sdpa"](module, query, key, value, attention_mask, **kwargs)
    return split_attention(module, query, key, value, layout, **kwargs)


def install() -> None:
    """Register the dispatching "sdpa" (once per process; a call without a layout is transformers'
    sdpa, unchanged)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    current = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
    if current is _attention:
        return
    _PLAIN["sdpa"] = current
    AttentionInterface.register("sdpa", _attention)


def supported(model: nn.Module) -> bool:
    """Whether ``model``'s attention can run split: plain causal sdpa over full attention in every
    layer (no sliding window, no soft-capping; eager, flash and flex attention run the plain path)."""
    from lldslight.policy.load import causal_lm

    config = getattr(causal_lm(model), "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return not getattr(config, "attn_logit_softcapping", None)


def packed_hidden(decoder: nn.Module, layout: PackedGroups, num_layers: Optional[int],
                  inputs_embeds: Optional[Tensor] = None) -> Tensor:
    """The decoder's last hidden states [N, H] over the packed sequence; ``inputs_embeds`` [1, N, H]
    replaces the embedding of ``layout.input_ids`` (frozen_prefix.py: a stored hidden state enters
    the upper layers), and ``num_layers`` is how many layers the decoder runs."""
    install()
    layout.calls.n = 0  # a layout may run more than once (frozen_prefix: the boundary, then the top)
    ones = torch.ones_like(layout.input_ids)  # [1, N]: no padding (lets transformers skip building a mask)
    tokens = {"input_ids": layout.input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    out = decoder(**tokens, attention_mask=ones, position_ids=layout.position_ids, use_cache=False, **{LAYOUT_KWARG: layout})
    if layout.calls.n == 0 or (num_layers is not None and layout.calls.n != num_layers):
        raise RuntimeError(f"shared-prefix forward: the split attention ran in {layout.calls.n} of {num_layers} layers (the "
                           "model does not pass attention keyword arguments through); set model.shared_prefix: false")
    return out.last_hidden_state[0]


# -- micro-batches that keep a group's rows together ---------------------------------------------------


def micro_batches(input_ids: Tensor, attention_mask: Tensor, groups: Tensor, rows: Tensor, size: int,
                  budget: Optional[int] = None) -> list[Tensor]:
    """Split ``rows`` (of a mini-batch) into micro-batches with each group's rows adjacent (groups in
    order of first appearance), so that a micro-batch holds whole groups, or the end of one and the
    start of the next: ``size`` rows each, or, with a token ``budget``, as many as fit in the tokens
    the packed sequence holds (a group's shared prefix counted once, no padding); a longer row alone.
    The cut changes no value: every loss term is normalised by mini-batch totals."""
    groups = groups.cpu()
    rows = rows.cpu()
    order = torch.cat([rows[groups[rows] == g] for g in dict.fromkeys(groups[rows].tolist())]) if len(rows) else rows
    if not budget:
        return [order[i : i + size] for i in range(0, len(order), size)]
    lengths = attention_mask.sum(-1).cpu()
    # a group's prefix shared by all its rows in the rollout batch: any micro-batch's subset of the
    # group shares at least that much, so the count below is an upper bound of the packed tokens
    shared = common_prefix_lengths(input_ids, lengths, groups)
    out, start, tokens, seen = [], 0, 0, set()
    for i, r in enumerate(order.tolist()):
        g = int(groups[r])
        cost = int(lengths[r]) - (int(shared[r]) if g in seen else 0)
        if i > start and tokens + cost > budget:
            out.append(order[start:i])
            start, tokens, seen = i, 0, set()
            cost = int(lengths[r])
        tokens += cost
        seen.add(g)
    if start < len(order):
        out.append(order[start:])
    return out
