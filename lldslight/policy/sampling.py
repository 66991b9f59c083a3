"""The weights a rollout samples with: the policy being trained, computed as the training forward
computes it (LoRA folded in where that is exact, the adapter path otherwise).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from lldslight.policy.load import quantized_linears
from lldslight.policy.precision import model_arithmetic, precision_autocast


@contextlib.contextmanager
def sampling_weights(model: nn.Module) -> Iterator[None]:
    """Sample with the policy being trained, computed as the training forward computes it.

    Full-precision base: LoRA is folded into the base weights, one matmul per layer instead of
    three (the adapter's two small matmuls cost as much as the base one at decode batch sizes).
    peft's merge_adapter/unmerge_adapter adds then subtracts the update, which leaves rounding
    drift in the frozen base (and so in the reference policy) after every rollout. Instead each
    adapted layer gets a new weight tensor W + delta while the adapter path is disabled, and the
    original tensor object is put back afterwards: exact, at the cost of one extra copy of the
    adapted weights during sampling. Skipped under FSDP2 (sharded weights; see distributed.py).

    bf16 base (precision bf16-mixed or bf16-true): never folded either, for the same reason as
    an 8-bit one below; the adapter path runs, as in training, each adapted Linear through
    ``lora_forward.lean_adapters``: peft's operations without its per-call bookkeeping, the same
    bits. Every forward here runs under :func:`precision_autocast`, as the trainer's do.

    Quantized base (QLoRA): never folded. A 4-bit weight is packed (W + delta means nothing for
    it) and an 8-bit one would round the small delta away, so sampling would follow the base
    policy while the ratios read 1. Sampling runs the adapter path, as training does, and the
    quantized layers stay in train mode (they have no dropout; the flag only picks bitsandbytes'
    kernel: on CPU, eval mode would quantize an 8-bit layer's inputs to int8 while training
    dequantizes its weight), so the sampler's log-probs are the trainer's.
    """
    with precision_autocast(model):
        yield from _sampling_weights(model)


def _sampling_weights(model: nn.Module) -> Iterator[None]:
    from lldslight.policy.lora_forward import lean_adapters

    quantized = quantized_linears(model)
    if quantized:
        modes = [layer.training for layer in quantized]
        for layer in quantized:
            layer.train()
        try:
            with lean_adapters(model):  # only adapters on plain Linears: bitsandbytes' keep peft's forward
                yield
        finally:
            for layer, mode in zip(quantized, modes):
                layer.train(mode)
        return
    layers = [m for m in model.modules() if callable(getattr(m, "get_delta_weight", None)) and hasattr(m, "base_layer")]
    arith = model_arithmetic(model)
    # A bf16 base cannot hold W + delta: rounding to bf16 (2^-8 of |W|) would swallow a small
    # delta, and the sampler would follow the base policy while the trainer's ratios read 1.
    low_precision = arith is not None and (arith.frozen != torch.float32 or arith.autocast is not None)
    if not layers or low_precision or getattr(model, "_lldslight_no_merge", False) or not callable(getattr(model, "disable_adapter", None)):
        # The adapter path runs: peft's arithmetic, without its per-call bookkeeping (lora_forward.py).
        with lean_adapters(model):
            yield
        return
    originals = []
    with model.disable_adapter():
        try:
            for layer in layers:
                weight = layer.base_layer.weight
                delta = sum(layer.get_delta_weight(name) for name in layer.active_adapters if name in layer.lora_A)
                originals.append((weight, weight.data))
                weight.data = weight.data + delta.to(weight.dtype)
            yield
        finally:
            for weight, data in originals:
                weight.data = data
