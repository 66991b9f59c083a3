"""The policy as trained: the base model loaded, quantized for QLoRA (4/8-bit), its bottom layers
frozen, a LoRA adapter added; and the trained policy saved as a plain HF directory.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Iterator, Union

import torch
from torch import nn

from lldslight.errors import require
from lldslight.policy.config import LoRAConfig, PolicyConfig, PolicyLoadError
from lldslight.policy.files import load_tokenizer, model_config, resolve_model_dir
from lldslight.policy.precision import announce_precision, resolve_precision
from lldslight.run.writes import directory_written_whole


def load_policy(cfg: PolicyConfig, dequantize: bool = False) -> tuple[nn.Module, object]:
    """Build (model, tokenizer) as configured: weights, dtype, quantisation, LoRA, checkpointing.

    ``dequantize``: quantize the base as configured, then turn it back into float layers before the
    adapter goes on (export: the adapter merges into the very weights it was trained against).
    """
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(cfg)
    tokenizer = load_tokenizer(cfg, model_dir)
    arith = resolve_precision(cfg)
    announce_precision(arith)
    # Under LoRA every base weight is frozen; in full fine-tuning every weight trains.
    dtype = arith.frozen if cfg.lora is not None else arith.trainable
    kwargs = {"dtype": dtype}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.random_init is not None:
        config = model_config(cfg, model_dir)
        if cfg.attn_implementation:
            config._attn_implementation = cfg.attn_implementation
        with _seeded(cfg.init_seed):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if cfg.quantization:
            # transformers quantizes while loading: load the random weights back from a temporary copy.
            with tempfile.TemporaryDirectory(prefix="lldslight-random-init-") as tmp:
                model.save_pretrained(tmp, safe_serialization=True)
                kwargs["quantization_config"] = _bnb_config(cfg.quantization, arith.autocast or dtype)
                model = AutoModelForCausalLM.from_pretrained(tmp, **kwargs)
    else:
        if cfg.quantization:
            kwargs["quantization_config"] = _bnb_config(cfg.quantization, arith.autocast or dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except OSError as err:
            raise PolicyLoadError(f"could not load model {cfg.model!r} from {model_dir!r}: {err}") from err
    model.config.use_cache = True
    if cfg.quantization and dequantize:
        model = model.dequantize(dtype=dtype)
    elif cfg.quantization:
        from peft import prepare_model_for_kbit_training

        for layer in quantized_linears(model):
            # bitsandbytes on an AVX512-BF16 CPU repacks a 4-bit weight in place at its first eval-mode
            # forward and from then on multiplies in bf16 without autograd, also in training (the
            # gradient into the layer's input is lost): keep the fp32 dequantize-and-matmul path.
            layer.support_avx512bf16_for_cpu = False
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(cfg.gradient_checkpointing))
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=_lora_targets(model, cfg.lora),
            layers_to_transform=cfg.lora.layers_to_transform,
            task_type="CAUSAL_LM",
        )
        with _seeded(cfg.init_seed):  # the adapter's random init must not depend on what ran before (ranks agree)
            # peft stores the adapter in the base's dtype, then (autocast_adapter_dtype) upcasts a
            # bf16 one to fp32: wanted under bf16-mixed, not under bf16-true.
            model = get_peft_model(model, lora, autocast_adapter_dtype=arith.trainable == torch.float32)
        if arith.autocast is not None:
            # peft casts a layer's input to the adapter's dtype (bf16 -> fp32) and autocast casts it
            # straight back at the adapter's matmul: an exact round trip, two copies per adapted
            # layer and forward (sampler and trainer alike; ~420 per decode step with LoRA on every
            # linear). peft's own switch (peft.helpers.disable_input_dtype_casting) turns it off;
            # every forward runs under precision_autocast, so the arithmetic is unchanged.
            from peft.tuners.tuners_utils import BaseTunerLayer

            for layer in model.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.cast_input_dtype_enabled = False
    if cfg.freeze_bottom_layers:
        _freeze_bottom(model, cfg.freeze_bottom_layers)
    if cfg.gradient_checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated, removed in v6); older ones have only that.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model._lldslight_arithmetic = arith  # read by precision_autocast (trainer and sampler)
    return model, tokenizer


def _freeze_bottom(model: nn.Module, n: int) -> None:
    """Freeze the input embeddings (a head tied to them with them) and decoder layers 0..n-1."""
    decoder = causal_lm(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    require(isinstance(layers, nn.ModuleList), "model.policy.freeze_bottom_layers", "0 for this model", n,
            "its decoder has no 'layers' list to freeze the bottom of")
    require(n < len(layers), "model.policy.freeze_bottom_layers", f"< the model's {len(layers)} decoder layers", n)
    decoder.get_input_embeddings().requires_grad_(False)
    for layer in list(layers)[:n]:
        layer.requires_grad_(False)


def _lora_targets(model: nn.Module, lora: LoRAConfig) -> Union[str, list[str]]:
    """peft refuses layers_to_transform with "all-linear": spell out the linear layers' names."""
    if lora.target_modules != "all-linear" or lora.layers_to_transform is None:
        return lora.target_modules
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head})


BNB_INSTALL = "pip install -e '.[gpu]' in your lldslight clone (bitsandbytes>=0.50, which runs on CPU too)"


def require_bitsandbytes(what: str):
    """The bitsandbytes module, or an error naming ``what`` needs it and how to install it."""
    try:
        import bitsandbytes
    except ImportError as err:
        raise ImportError(f"{what} needs bitsandbytes: {BNB_INSTALL}") from err
    version = tuple(int(x) for x in bitsandbytes.__version__.split(".")[:2] if x.isdigit())
    if version < (0, 50) and not torch.cuda.is_available():
        raise ImportError(f"{what} on CPU needs bitsandbytes>=0.50 (found {bitsandbytes.__version__}): {BNB_INSTALL}")
    return bitsandbytes


def _bnb_config(kind: str, compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    try:
        require_bitsandbytes(f"policy.quantization={kind!r}")
    except ImportError as err:
        raise PolicyLoadError(str(err)) from err
    if kind == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def causal_lm(model: nn.Module) -> nn.Module:
    """The underlying transformers CausalLM (LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder stack returning hidden states, lm_head): log-probs are computed from hidden states
    in chunks, so full-vocabulary logits never exist for a whole batch."""
    lm = causal_lm(model)
    return lm.get_decoder(), lm.get_output_embeddings()


def quantized_linears(model: nn.Module) -> list[nn.Module]:
    """bitsandbytes' Linear4bit / Linear8bitLt layers: linear layers whose weight holds integers."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and not m.weight.is_floating_point()]


def has_adapter(model: nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def save_merged(model: nn.Module, tokenizer, out: Path, dtype: torch.dtype, meta: dict) -> Path:
    """The model as a plain Hugging Face directory: adapter merged, ``meta`` in lldslight_export.json."""
    if has_adapter(model):
        model = model.merge_and_unload()
    model = model.to(dtype)
    model.config.use_cache = True
    # All files or none: a full disk must not leave a config.json without its weights.
    with directory_written_whole(out, "saving the model") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "lldslight_export.json").write_text(json.dumps(meta, indent=2, default=str))
    return out
