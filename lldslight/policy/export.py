"""``lldslight export --ckpt CKPT --out DIR``: a training checkpoint as a plain Hugging Face model
directory (LoRA merged into the weights), which ``AutoModelForCausalLM.from_pretrained(DIR)``,
vLLM or any other transformers-compatible tool loads without lldslight.

A checkpoint holds only the trained weights (the adapter under LoRA); the base comes from the
policy config the checkpoint stores in its hyper-parameters (``model.policy``), loaded again from
the same place (hub id, directory, GGUF or random init with its seed). A quantized base (QLoRA)
is quantized as in training and dequantized to float32 before the merge: the adapter was trained
against the dequantized 4/8-bit weights, not the original ones, so the export is the policy that
was trained (saved in ``--dtype``, by default the policy's precision: float32 for fp32, else bfloat16).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch

from lldslight.errors import ArgumentParser, CheckpointError
from lldslight.policy.config import LoRAConfig, PolicyConfig
from lldslight.run.checkpoint_io import check_checkpoint
from lldslight.run.writes import check_out_dir


def policy_from_hparams(value: Any) -> PolicyConfig:
    """The PolicyConfig a checkpoint's ``hyper_parameters['policy']`` describes (a dict when the run
    was configured by the CLI, the dataclass itself when built in Python)."""
    if isinstance(value, PolicyConfig):
        return value
    if not isinstance(value, dict):
        raise CheckpointError(f"hyper_parameters['policy'] is a {type(value).__name__}, expected a PolicyConfig or dict")
    names = {f.name for f in dataclasses.fields(PolicyConfig)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise CheckpointError(f"hyper_parameters['policy'] has fields this lldslight does not know: {unknown}")
    cfg = dict(value)
    if isinstance(cfg.get("lora"), dict):
        cfg["lora"] = LoRAConfig(**cfg["lora"])
    return PolicyConfig(**cfg)


def load_checkpoint(path: Path) -> dict:
    from lldslight.policy.distributed import FSDPConfig

    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory (a sharded FSDP2 checkpoint, save_distributed_checkpoint: true). Export "
            "needs a single-file checkpoint: train with FSDP2Strategy(save_distributed_checkpoint=false), "
            "the default, or convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save."
        )
    check_checkpoint(path)  # missing or truncated: one line, with the newest valid checkpoint beside it
    # Our own config dataclasses may be pickled in the hyper-parameters; nothing else is trusted.
    with torch.serialization.safe_globals([PolicyConfig, LoRAConfig, FSDPConfig]):
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "hyper_parameters"):
        if key not in checkpoint:
            raise CheckpointError(f"{path} has no {key!r}: not a checkpoint written by lldslight fit")
    if "policy" not in checkpoint["hyper_parameters"]:
        raise CheckpointError(f"{path}: hyper_parameters has no 'policy' (not a GRPOModule checkpoint)")
    return checkpoint


def export(ckpt: str | Path, out: str | Path, dtype: Optional[str] = None, force: bool = False) -> Path:
    """Write the merged model and its tokenizer to ``out``; return ``out``. A non-empty ``out`` is
    written into only with ``force`` (checked before anything loads)."""
    from lldslight.policy.precision import export_dtype, resolve_dtype
    from lldslight.policy.load import load_policy, save_merged

    ckpt, out = Path(ckpt), Path(out)
    check_out_dir(out, force, "--out", "the export")
    checkpoint = load_checkpoint(ckpt)
    policy = policy_from_hparams(checkpoint["hyper_parameters"]["policy"])
    # Merge in float32 on whatever machine this runs on; cast once at the end.
    target = dtype or export_dtype(policy)
    build = dataclasses.replace(policy, precision="fp32", dtype=None, gradient_checkpointing=False)
    model, tokenizer = load_policy(build, dequantize=True)
    state = {k[len("policy."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("policy.")}
    if not state:
        raise CheckpointError(f"{ckpt}: the checkpoint holds no policy weights")
    result = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable & set(result.missing_keys))
    if result.unexpected_keys or missing:
        raise CheckpointError(
            f"{ckpt} does not fit model.policy {policy.model!r}: unexpected {result.unexpected_keys[:5]}, "
            f"missing trainable {missing[:5]}"
        )
    return save_merged(model, tokenizer, out, resolve_dtype(target), {
        "checkpoint": str(ckpt.resolve()),
        "global_step": checkpoint.get("global_step"),
        "policy": dataclasses.asdict(policy),
        "dtype": target,
        "adapter_merged": policy.lora is not None,
        "base": f"{policy.quantization} dequantized to float32" if policy.quantization else "as loaded, float32",
    })


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(
        prog="lldslight export",
        description="Merge a checkpoint's LoRA adapter into its base model and save a Hugging Face model directory.",
    )
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by lldslight fit (e.g. .../checkpoints/last.ckpt)")
    parser.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="dtype of the saved weights (default: float32 for model.policy.precision fp32, else bfloat16)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty --out (files of the same name, e.g. config.json, are replaced)")
    args = parser.parse_args(argv)
    out = export(args.ckpt, args.out, args.dtype, force=args.force)
    print(f"[lldslight] exported {args.ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
