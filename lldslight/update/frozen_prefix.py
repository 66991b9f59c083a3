"""Compute the frozen bottom of the decoder once per rollout batch (``model.update.frozen_prefix``).

When training changes only the decoder layers from L up (LoRA's ``layers_to_transform``, e.g. the
demo's top 8 of 30 layers, or a full fine-tune with ``policy.freeze_bottom_layers: L``), the
embeddings and layers 0..L-1 are the same function in every pass of an update: pi_old's
log-probs, the reference's (when the adapter-off reference shares them), each of the k training
forwards and backwards, and LLDMonitor's after-step forward. They see the same tokens each time, so
their output, the hidden state entering layer L, is the same tensor each time. This module
computes it once per rollout batch, stores it on the trajectory (``Trajectory.frozen_hidden``,
[B, T, H], right-padded like ``input_ids``), and runs every later pass from layer L:

    plain pass:   embed -> layers 0..L-1 -> layers L..N-1 -> norm -> log-probs       (every pass)
    here, once:   embed -> layers 0..L-1 -> h_L                                       [B, T, H]
    each pass:                         h_L -> layers L..N-1 -> norm -> log-probs

The passes still run the model's own forward (its masks, rotary embedding, attention function and
checkpointing): only its layer list is cut to layers L..N-1 while they run and the stored hidden
state goes in as ``inputs_embeds``. The shared-prefix packing (shared_prefix.py) composes: the
boundary is computed packed, scattered back to rows, and gathered into whatever packing a later
pass uses. Values equal the plain path's to fp32 rounding (tests/test_frozen_prefix.py: log-probs
and every trainable gradient within 1e-5 relative at k = 1; at k = 8, 1e-4, as fp32 rounding
compounds over 8 Adam steps; multi-turn rows).

Falls back to the plain path (said once) where it cannot be exact or cannot run: a sharded
(FSDP2) model, a decoder without a ``layers`` list and a final ``norm``, an embedding or a lower
layer that trains, or a boundary larger than ``frozen_prefix_max_mb``.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)
_SAID: set[str] = set()


def say_once(key: str, message: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.warning(message)
        print(f"[lldslight] {message}", flush=True)


@dataclass(frozen=True)
class Boundary:
    """The hidden state entering decoder layer ``start``, per row and position: [B, T, H]."""

    hidden: Tensor
    start: int


def _parts(model: nn.Module) -> Optional[tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]]:
    """(decoder, its layer list, its input embedding, its final norm), or None for an architecture
    whose decoder does not have them under the usual names (Llama, Qwen2, Mistral, Gemma...)."""
    from lldslight.policy.load import decoder_and_head

    try:
        decoder, _ = decoder_and_head(model)
    except (AttributeError, NotImplementedError):
        return None
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    embed = getattr(decoder, "embed_tokens", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(norm, nn.Module) or not isinstance(embed, nn.Module):
        return None
    return decoder, layers, embed, norm


def start_layer(model: nn.Module) -> tuple[Optional[int], str]:
    """(L, "") with L the lowest decoder layer with a trainable parameter, when L > 0 and nothing
    below it (the embeddings included) trains; else (None, why), ``why`` empty where reuse simply
    does not apply (every layer trains, or none does) and a reason to say where it cannot run."""
    from lldslight.policy.distributed import is_sharded

    parts = _parts(model)
    if parts is None:
        return None, "the decoder has no 'layers' list, 'embed_tokens' and final 'norm' under those names"
    if is_sharded(model):
        return None, "not under FSDP2: a sharded layer list cannot be cut"
    _, layers, embed, _ = parts
    if any(p.requires_grad for p in embed.parameters()):
        return None, ""
    for i, layer in enumerate(layers):
        if any(p.requires_grad for p in layer.parameters()):
            return (i or None), ""
    return None, ""  # nothing in the decoder trains (a no-grad evaluation): nothing to split


def reference_shares(policy: nn.Module, reference: Optional[nn.Module], start: int) -> bool:
    """Whether the reference's layers below ``start`` compute what the policy's do. The adapter-off
    reference (``reference`` None) does when no adapter sits below ``start`` (disabling one that
    does would change them); a separate copy when its embeddings and lower layers hold the same
    values (checked once per call site: the caller caches the answer)."""
    mine = _parts(policy)
    if mine is None:
        return False
    _, layers, embed, _ = mine
    lower = [embed, *layers[:start]]
    if reference is None:
        return not any(hasattr(m, "lora_A") for part in lower for m in part.modules())
    theirs = _parts(reference)
    if theirs is None or len(theirs[1]) != len(layers):
        return False
    _, ref_layers, ref_embed, _ = theirs
    for a, b in zip(lower, [ref_embed, *ref_layers[:start]]):
        pa, pb = list(a.parameters()), list(b.parameters())
        if len(pa) != len(pb) or not all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(pa, pb)):
            return False
    return True


@contextlib.contextmanager
def layers_between(model: nn.Module, start: int, stop: Optional[int] = None) -> Iterator[nn.Module]:
    """Inside, the decoder runs only layers ``start..stop-1``; when ``stop`` cuts the stack short,
    its final norm is skipped too (the output is the hidden state entering layer ``stop``). Yields
    the decoder. The modules themselves are untouched: the backward and a checkpoint's recompute
    call the layers directly, so they need nothing of this after it exits."""
    parts = _parts(model)
    if parts is None:
        raise RuntimeError("frozen_prefix.layers_between: the decoder has no layers list and final norm")
    decoder, layers, _, norm = parts
    stop = len(layers) if stop is None else stop
    decoder.layers = nn.ModuleList(list(layers)[start:stop])  # [: num_hidden_layers] slices a shorter list harmlessly
    if stop < len(layers):
        decoder.norm = nn.Identity()
    try:
        yield decoder
    finally:
        decoder.layers = layers
        decoder.norm = norm


def boundary_bytes(model: nn.Module, shape: torch.Size) -> int:
    """An upper bound of the stored boundary's size for rows x tokens ``shape``: hidden size x the
    residual stream's dtype (the embedding's, at least fp32: autocast keeps the residual in fp32)."""
    embed = _parts(model)[2]  # type: ignore[index]
    dtype = torch.promote_types(embed.weight.dtype, torch.float32)
    return shape.numel() * int(embed.weight.shape[-1]) * torch.empty((), dtype=dtype).element_size()


@torch.no_grad()
def compute(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, groups: Optional[Tensor], start: int,
            micro: list[Tensor]) -> Tensor:
    """The hidden state entering layer ``start`` [B, T, H] of every row, computed in the
    micro-batches ``micro`` (row indices), each packed by its shared prefixes when ``groups`` is
    given and the model supports it. Zero at padding (no real token attends to a padding key)."""
    from lldslight.update import shared_prefix
    from lldslight.policy.distributed import through_root
    from lldslight.policy.precision import precision_autocast

    B, T = input_ids.shape
    out: Optional[Tensor] = None
    with precision_autocast(model):
        for idx in micro:
            idx = idx.to(input_ids.device)
            ids = input_ids[idx]
            width = int(attention_mask[idx].sum(-1).max())
            ids, attn = ids[:, :width], attention_mask[idx, :width]
            layout = None
            if groups is not None and shared_prefix.supported(model):
                layout = shared_prefix.pack_groups(ids, attn, groups[idx.to(groups.device)])
            with layers_between(model, 0, start) as decoder:
                if layout is not None:
                    h = through_root(model, lambda: shared_prefix.packed_hidden(decoder, layout, start))  # [N, H]
                    rows_h = h[layout.row_index] * attn[..., None].to(h.dtype)  # [b, width, H]
                else:
                    h = through_root(model, lambda: decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state)
                    rows_h = h * attn[..., None].to(h.dtype)
            if out is None:
                out = rows_h.new_zeros(B, T, rows_h.shape[-1])
            out[idx, :width] = rows_h
    assert out is not None
    return out


def top_hidden(model: nn.Module, boundary: Tensor, start: int, input_ids: Tensor, attention_mask: Tensor,
               layout=None) -> Tensor:
    """The decoder's last hidden state from the stored ``boundary`` [b, T, H] (rows aligned with
    ``input_ids``), running layers ``start..N-1`` and the final norm: [N, H] over the packed
    sequence when ``layout`` is given, else [b, T, H]."""
    from lldslight.update import shared_prefix

    num_layers = len(_parts(model)[1])  # type: ignore[index]
    with layers_between(model, start) as decoder:
        if layout is not None:
            inputs = boundary[layout.source_rows, layout.source_cols][None]  # [1, N, H]
            return shared_prefix.packed_hidden(decoder, layout, num_layers - start, inputs_embeds=inputs)
        return decoder(inputs_embeds=boundary, attention_mask=attention_mask, use_cache=False).last_hidden_state
