"""LoRA layers' forward while sampling: peft's arithmetic without peft's per-call bookkeeping.

Where the sampler runs the adapter path (a bf16 base, where W + delta cannot be held; FSDP2, where
sharded weights cannot be rewritten: policy/sampling.py ``sampling_weights``), every decode step calls each
adapted Linear's peft forward: argument checks, the adapter-name and variant lookups, the merged /
disabled branches, the input-cast check, then three module calls (base, A, B) and the dropout
module. At decode sizes (8-32 rows) that bookkeeping costs as much as the adapter's own matmuls:
with LoRA on every Linear of SmolLM2-135M (210 layers) it is ~8% of a bf16 decode step
(benchmarks/decode_ops.py, docs/lab/speed.md).

``lean_adapters`` gives each plain LoRA Linear, for the duration of a ``with`` block, a forward that
issues the very operations peft's does for one vanilla adapter, in the same order and with the same
operands:

    result = linear(x, W, b) + linear(linear(x, A), B, b_B) * scaling          # x: [..., in]

so the outputs are the same bits (tested against peft's own forward, with autocast on and off).
Any layer this cannot be said of keeps peft's forward: another layer class (bitsandbytes, DoRA's
variant, a subclass), several or no active adapters, a merged or disabled adapter, dropout that
would act (p > 0 in train mode), a base that is not a plain ``nn.Linear``, or a hook on the base or
the adapter's modules (their forward would be skipped here; FSDP2's hooks sit on the decoder
layers, not on these).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from peft.tuners.lora.layer import Linear as LoraLinear
from torch import Tensor, nn
from torch.nn import functional as F


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def lean_forward(layer: nn.Module) -> Optional[Callable[..., Tensor]]:
    """The lean forward of ``layer`` (a peft LoRA ``Linear``), or None where peft's must run."""
    if type(layer) is not LoraLinear or layer.merged or layer.disable_adapters:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    base, lora_a, lora_b, dropout = layer.base_layer, layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    if type(base) is not nn.Linear or type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
        return None
    if not isinstance(dropout, nn.Identity) and dropout.training:
        return None
    if any(_hooked(m) for m in (base, lora_a, lora_b, dropout)):
        return None
    scaling = layer.scaling[name]
    # peft casts the input to the adapter's dtype when its switch is on (policy/load.py turns it off
    # under bf16-mixed, where autocast casts at the matmul); its own check, so either is followed.
    cast = layer._cast_input_dtype

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        if args or kwargs:  # peft's extra arguments (adapter_names, variant keys): its own path
            return type(layer).forward(layer, x, *args, **kwargs)
        result = F.linear(x, base.weight, base.bias)  # the base layer, as nn.Linear computes it
        torch_result_dtype = result.dtype
        x = cast(x, lora_a.weight.dtype)
        result = result + F.linear(F.linear(x, lora_a.weight, lora_a.bias), lora_b.weight, lora_b.bias) * scaling
        return result.to(torch_result_dtype)

    return forward


@contextlib.contextmanager
def lean_adapters(model: nn.Module) -> Iterator[int]:
    """Within the block every eligible LoRA Linear of ``model`` runs :func:`lean_forward`; each
    gets peft's forward back afterwards, also on an error. Yields how many layers were switched."""
    switched = []
    try:
        for layer in model.modules():
            forward = lean_forward(layer)
            if forward is not None and "forward" not in layer.__dict__:
                layer.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
                switched.append(layer)
        yield len(switched)
    finally:
        for layer in switched:
            del layer.forward
