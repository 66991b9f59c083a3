"""The policy: its settings, its arithmetic, where its weights come from, how it loads, what it
samples with, its FSDP2 sharding and its export. One concern per file:

- config.py: PolicyConfig, LoRAConfig, PolicyLoadError;
- precision.py: bf16 support, the precision ``auto`` resolves to, the autocast of every forward;
- files.py: the weights and tokenizer found (HF directory, hub id, GGUF, the demo) and checked;
- load.py: the policy as trained (LoRA, QLoRA, frozen bottom layers), saved merged;
- sampling.py, lora_forward.py: the weights a rollout samples with, and the adapter's lean forward;
- activation_checkpointing.py: recomputation of the layers that train (``gradient_checkpointing``);
- distributed.py: FSDP2 sharding, FSDP2Strategy, the collectives across ranks;
- export.py: ``lldslight export``, the adapter merged into a HF directory.

Names are imported on first use (PEP 562): ``from lldslight.policy import PolicyConfig`` reads
config.py alone. Inside lldslight, code imports the module that defines a name.
"""
from __future__ import annotations

import logging

from lldslight.lazy import lazy_exports

# On an AVX512-BF16 CPU, importing bitsandbytes (peft does) warns that a hub kernel for its bf16
# 4-bit inference path is missing; load_policy keeps that path off, so the warning is noise here.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(["DEMO_MODELS", "LoRAConfig", "PolicyConfig", "PolicyLoadError"], "config"),
    **dict.fromkeys(["Bf16Support", "cpu_bf16_support", "cpu_description", "precision_autocast", "resolve_precision"], "precision"),
    **dict.fromkeys(["load_tokenizer", "resolve_model_dir"], "files"),
    **dict.fromkeys(["decoder_and_head", "load_policy", "quantized_linears"], "load"),
    "sampling_weights": "sampling",
})
