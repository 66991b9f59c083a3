"""Activation checkpointing under a byte budget (``policy.gradient_checkpointing: auto``).

Checkpointing every decoder layer keeps only each layer's input and runs the layer's forward again
in the backward: at LoRA on a frozen base (whose backward computes input gradients only) that is a
third of the update's matmuls. Keeping a layer's activations instead costs memory that grows with
the micro-batch's tokens (about 40 KB per token and layer at SmolLM2-135M, 18 MB per layer for 4
rows of 112 tokens). So with a budget, each forward with gradients runs its decoder layers
un-checkpointed while the activations they saved, counted as they are saved, plus one more layer's
worth still fit, and checkpoints the rest; a micro-batch that fits entirely is not recomputed at all.
The first micro-batch of a process runs its first layer un-checkpointed to learn a layer's size.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers that transformers checkpoints (``gradient_checkpointing`` set on them)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter or a view of one (F.linear saves W^T): not an activation."""
    return isinstance(t._base if t._base is not None else t, nn.Parameter)


@contextlib.contextmanager
def activation_budget(model: nn.Module, budget_bytes: Optional[float]) -> Iterator[dict]:
    """Inside, forwards with gradients checkpoint only the decoder layers whose activations would
    not fit in ``budget_bytes`` (None: every layer stays checkpointed). Yields the count: ``saved``
    (activation bytes saved for the backward so far) and ``plain`` (layers run un-checkpointed)."""
    layers = checkpointed_layers(model) if budget_bytes is not None else []
    stats = {"saved": 0, "plain": 0}
    if not layers or not torch.is_grad_enabled():
        yield stats
        return
    seen: set[int] = set()
    # bytes one un-checkpointed layer saved, per token (the largest seen), kept on the model
    per_token = getattr(model, "_lldslight_layer_bytes_per_token", 0.0)
    state = {"before": 0, "tokens": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not _is_weight(t) and storage.data_ptr() not in seen:  # alive until the backward: addresses are unique
            seen.add(storage.data_ptr())
            stats["saved"] += storage.nbytes()
        return t

    def before(layer, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        state["tokens"] = hidden.shape[:-1].numel() if torch.is_tensor(hidden) else 0
        layer.gradient_checkpointing = stats["saved"] + per_token * state["tokens"] > budget_bytes
        state["before"] = stats["saved"]

    def after(layer, args, kwargs, output):
        nonlocal per_token
        if not layer.gradient_checkpointing:
            stats["plain"] += 1
            if state["tokens"]:
                per_token = max(per_token, (stats["saved"] - state["before"]) / state["tokens"])

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(before, with_kwargs=True),
                                             layer.register_forward_hook(after, with_kwargs=True))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield stats
    finally:
        for h in hooks:
            h.remove()
        for layer in layers:
            layer.gradient_checkpointing = True
        model._lldslight_layer_bytes_per_token = per_token
