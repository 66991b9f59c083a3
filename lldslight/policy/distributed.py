"""Scale-out: FSDP2 sharding of the policy, and what sharding changes in a GRPO step.

Under Lightning's ``ModelParallelStrategy`` (or ``FSDP2Strategy`` below, which sets its mesh for
us), ``GRPOModule.configure_model`` calls :func:`shard_policy`: every decoder layer becomes one
FSDP2 unit (``fully_shard``), then the whole model becomes the root unit (embeddings, final norm
and LM head; tied embedding/head weights must share a unit). Activation checkpointing stays the
policy's own (transformers' per-layer, non-reentrant), which composes with FSDP2's hooks.

Two things differ from the usual ``loss = model(batch)`` FSDP2 program, and this file handles both:

- lldslight calls the decoder and the LM head separately (log-probs in chunks from hidden states;
  token-by-token decoding with a KV cache) rather than the root module's ``forward``. FSDP2 needs
  its root hooks to run (they gather the root unit's weights, pick the root lazily, and queue the
  backward callback that reduce-scatters the gradients), so :func:`through_root` runs such code *as*
  the root module's forward.
- Each rank samples its own prompts, so ranks run different numbers of decode steps. A layer that
  all-gathers its weights at every forward would then issue collectives the other ranks never
  match (a hang). :func:`gathered_generate` gathers every layer once per rollout batch, decodes
  with no collective at all, and frees the gathered weights at the end (one all-gather per layer
  per rollout instead of one per layer per token).

Gradient accumulation over micro-batches holds the gradient reduction back until a mini-batch's
last backward (:func:`gradient_sync`: DDP's ``no_sync`` through Lightning, FSDP2's
``set_requires_gradient_sync``), so a mini-batch costs one reduction however it is cut.

Lightning's ``FSDPStrategy`` (FSDP1) would need both done differently (its root is Lightning's
wrapper, generation would go through ``summon_full_params``); that is not implemented, so the
module refuses FSDP1 with a message pointing here. DDP needs nothing from this file except
:func:`all_ranks_agree` and :func:`all_ranks_min`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Optional, TypeVar

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lldslight.errors import require
from lldslight.run.metric_rules import REDUCTIONS
from lldslight.policy.load import causal_lm

T = TypeVar("T")
DTypeName = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FSDPConfig:
    """FSDP2 settings, used only when the strategy gives the module a device mesh.

    Args:
        param_dtype: dtype weights are gathered and computed in; None = the stored dtype. With
            ``policy.precision: fp32`` and ``param_dtype: bfloat16`` the optimiser keeps fp32 master
            weights and compute runs in bf16 (needed for full fine-tuning at lr 1e-6: a bf16 weight
            cannot represent an update that small).
        reduce_dtype: dtype gradients are reduce-scattered in; None = ``param_dtype``.
        reshard_after_forward: free each layer's gathered weights after its forward in training
            (less memory, one more all-gather per layer in backward). Generation always gathers
            once and keeps them until the rollout batch is done.
    """

    param_dtype: Optional[DTypeName] = None
    reduce_dtype: Optional[DTypeName] = None
    reshard_after_forward: bool = True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers CausalLM (LoRA layers stay injected in them)."""
    decoder = causal_lm(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) == 0:
        raise TypeError(f"{type(decoder).__name__} has no `.layers`: cannot shard it per decoder layer")
    return list(layers)


def is_sharded(model: Optional[nn.Module]) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_policy(model: nn.Module, mesh: Any, config: FSDPConfig) -> nn.Module:
    """Apply FSDP2 in place: one unit per decoder layer, then the root. Returns ``model``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    quantized = getattr(getattr(causal_lm(model), "config", None), "quantization_config", None) is not None or getattr(
        causal_lm(model), "is_loaded_in_4bit", False
    )
    require(not quantized, "trainer.strategy", "ddp with policy.quantization (QLoRA; each GPU holds the whole "
            "4-bit model)", "FSDP2", "bitsandbytes' packed 4-bit weights are not DTensors, so FSDP2 cannot shard them")
    mp = MixedPrecisionPolicy(
        param_dtype=_DTYPES[config.param_dtype] if config.param_dtype else None,
        reduce_dtype=_DTYPES[config.reduce_dtype] if config.reduce_dtype else None,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # LoRA merging rewrites base weights in place: invalid on sharded parameters (policy.sampling_weights).
    model._lldslight_no_merge = True
    model._lldslight_reshard_after_forward = config.reshard_after_forward
    return model


def through_root(model: nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` run as the forward of the FSDP2 root ``model`` (just ``fn()`` when not sharded).

    ``fn`` may call any submodule (decoder, LM head) and return tensors that need gradients: the
    root's pre-forward gathers the root unit and its post-forward registers the backward hooks on
    the returned tensors, exactly as for an ordinary ``model(...)`` call.
    """
    if not is_sharded(model):
        return fn()
    had_own = "forward" in model.__dict__
    saved = model.__dict__.get("forward")
    model.forward = lambda: fn()  # instance attribute: nn.Module.__call__ runs it between FSDP's hooks
    try:
        return model()
    finally:
        if had_own:
            model.forward = saved
        else:
            del model.forward


def gathered_generate(model: nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` (decoding, no gradients) with every FSDP2 unit of ``model`` gathered once.

    Every rank must call this the same number of times (once per rollout batch: each rank has the
    same number of batches); inside, ranks may run any number of forwards.
    """
    if not is_sharded(model):
        return fn()
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    after = getattr(model, "_lldslight_reshard_after_forward", True)

    def body() -> T:
        # The same module order on every rank: the all-gathers pair up.
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            return fn()
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(after, recurse=False)

    try:
        return through_root(model, body)
    finally:
        model.reshard()  # the root unit stays gathered after a forward by default; free it now


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True only if ``flag`` is True on every rank (one tiny all-reduce; no-op in one process).

    Decisions that change weights (accept or veto an update) must be identical on all ranks, or
    replicas silently diverge (DDP) or collectives go unmatched (FSDP).
    """
    return all_ranks_min(1 if flag else 0, device) == 1


def all_ranks_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over all ranks (one tiny all-reduce; ``value`` in one process)."""
    if world_size() == 1:
        return value
    t = torch.tensor([int(value)], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every rank (one all-reduce; ``t`` itself in one process)."""
    if world_size() > 1:
        t = t.clone()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


def reduce_over_ranks(values: dict[str, float], kinds: dict[str, str], device: torch.device) -> dict[str, float]:
    """``values`` reduced over ranks by their kind (``metric_rules.REDUCTIONS``: "sum", "max", "mean"
    or "min"): one all-reduce per kind. Every rank must pass the same keys. A key without a kind,
    or with another kind, is refused on every rank alike (before any collective, so no rank hangs
    waiting for another that raised) rather than logged unreduced."""
    bad = {k: kinds.get(k) for k in values if kinds.get(k) not in REDUCTIONS}
    require(not bad, "reduce_over_ranks: every key's reduction", f"one of {REDUCTIONS}", bad,
            "lldslight/run/metric_rules.py names them")
    if world_size() == 1:
        return dict(values)
    out = dict(values)
    ops = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}
    for kind in REDUCTIONS:
        keys = sorted(k for k in values if kinds[k] == kind)
        if not keys:
            continue
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, ops[kind]))
        if kind == "mean":
            t = t / world_size()
        out.update(zip(keys, t.tolist()))
    return out


@contextlib.contextmanager
def gradient_sync(pl_module: Any, enabled: bool) -> Iterator[None]:
    """Backward passes in this block reduce gradients across ranks only when ``enabled``; otherwise
    they accumulate locally (each rank may then run any number of them) and the next enabled
    backward reduces the sum. DDP: Lightning's ``strategy.block_backward_sync()`` (DDP's
    ``no_sync``); FSDP2: ``set_requires_gradient_sync`` on the sharded policy."""
    trainer = getattr(pl_module, "_trainer", None)
    if enabled or trainer is None or trainer.world_size <= 1:
        yield
    elif is_sharded(pl_module.policy):
        pl_module.policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            pl_module.policy.set_requires_gradient_sync(True)
    else:
        block = getattr(trainer.strategy, "block_backward_sync", None)
        with block() if block is not None else contextlib.nullcontext():
            yield


def data_parallel_mesh(mesh: Any, micro_batch_tokens: Optional[int], optimizer: str) -> Any:
    """The data-parallel mesh to shard the policy over with FSDP2, from the one Lightning's
    ModelParallelStrategy gives the module (None under DDP or on one device: no sharding). Refuses
    the settings sharding cannot serve (``model.update.micro_batch_tokens``, ``model.optim.optimizer``), before
    the model is loaded."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    tp = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
    require(tp <= 1, "ModelParallelStrategy.tensor_parallel_size", "1 (lldslight shards with FSDP2 over data "
            "parallelism only)", tp, "use lldslight.policy.distributed.FSDP2Strategy, or set data_parallel_size to the "
            "number of processes and tensor_parallel_size: 1")
    require(not micro_batch_tokens, "model.update.micro_batch_tokens", "null under FSDP2 (use "
            "model.update.micro_batch_size; packing works under strategy: ddp)", micro_batch_tokens,
            "it packs each process's rows on its own, and under FSDP2 every forward is a collective that needs "
            "the same number of micro-batches on every rank")
    require(optimizer != "adamw8bit", "model.optim.optimizer", "adamw under FSDP2 (or strategy: ddp "
            "for 8-bit AdamW)", optimizer, "bitsandbytes cannot step FSDP2's sharded DTensor parameters")
    return mesh["data_parallel"] if "data_parallel" in names else mesh


def fsdp2_strategy_check(strategy: Any) -> None:
    """Refuse strategies whose sharding lldslight cannot drive correctly (see the module docstring)."""
    from lightning.pytorch.strategies import FSDPStrategy

    require(not isinstance(strategy, FSDPStrategy), "trainer.strategy", "class_path lldslight.policy.distributed."
            "FSDP2Strategy (FSDP2 through Lightning's ModelParallelStrategy) or ddp", type(strategy).__name__,
            "FSDP1 is not supported: lldslight calls the decoder and LM head directly and decodes a different "
            "number of tokens on each rank, which it arranges for FSDP2 only (lldslight/policy/distributed.py)")


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with every process in one data-parallel (FSDP2) dimension.

    ``ModelParallelStrategy``'s defaults (data_parallel_size = nodes, tensor_parallel_size = GPUs per
    node) suit tensor parallelism, which lldslight does not use; this sets data_parallel_size to
    the world size and tensor_parallel_size to 1, so one config runs on 1 GPU, 4 GPUs or N nodes.

    Args:
        save_distributed_checkpoint: False (default) assembles one checkpoint file on rank 0 (it
            loads in a single process: ``lldslight export``, evaluation); True writes one shard per
            rank into a directory (faster for large full fine-tunes; resume with the same world size).
        process_group_backend: "nccl" on GPUs, "gloo" on CPU by default.
    """

    def __init__(self, save_distributed_checkpoint: bool = False, process_group_backend: Optional[str] = None) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
