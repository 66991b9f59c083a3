"""GRPOModule: the policy, its frozen reference, and one GRPO training step (DESIGN.md, step 3).

This file orchestrates; the formulas live in objectives.py. A training step takes the Trajectory
the SearchRollout callback attached, computes old and reference log-probs once, then runs
``updates_per_rollout`` optimiser updates over shuffled mini-batches with micro-batch gradient
accumulation. Callbacks extend the step through two hooks:
- loss terms (``add_loss_term``): fn(LossContext) -> scalar, added to the loss (LLDS is one);
- step gates (``add_step_gate``): fn(StepContext) -> bool, may veto or rescale an update after
  backward and before the optimiser step (the gradient-spike guard is one).

One "step" (``trainer.global_step``, ``max_steps``, checkpoint intervals) is one rollout batch,
as in veRL and TRL logs, however many optimiser updates it holds.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lldslight import objectives as obj
from lldslight.checkpoint import capture_rng, check_state_keys, gather_rng, pick_rng, restore_rng
from lldslight.distributed import FSDPConfig, all_ranks_agree, fsdp2_strategy_check, shard_policy, through_root
from lldslight.errors import require
from lldslight.logprobs import token_logprobs
from lldslight.policy import PolicyConfig, has_adapter, load_policy, require_bitsandbytes
from lldslight.preflight import check_policy
from lldslight.trajectory import Trajectory


@dataclass
class LossContext:
    """What a loss term sees for one micro-batch. Per-token tensors are [b, T]."""

    logp: Tensor  # with grad
    old_logp: Tensor
    ref_logp: Optional[Tensor]
    advantage: Tensor  # [b]
    loss_mask: Tensor
    action_id: Tensor
    answer_mask: Tensor
    num_searches: Tensor  # [b]
    rollout: Trajectory  # the whole rollout batch (for batch-level statistics)
    update_index: int  # 0 = the on-policy mini-batch
    metrics: dict[str, float] = field(default_factory=dict)  # a term may record its diagnostics here


@dataclass
class StepContext:
    """What a step gate sees after backward, before the optimiser step."""

    module: "GRPOModule"
    grad_norm: Tensor  # total pre-clip gradient norm (all ranks)
    loss: float
    update_index: int
    metrics: dict[str, float] = field(default_factory=dict)
    vetoed: bool = False  # already rejected (non-finite loss or norm, or an earlier gate)


def _trim_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc). On CPU, the rollout and the update each free
    hundreds of MB of mid-sized tensors that malloc would otherwise keep, so the next phase's
    peak would sit on top of the last one's leftovers. A few ms; a no-op elsewhere."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 (present on glibc only)
except (OSError, AttributeError):
    _LIBC = None


LossTerm = Callable[[LossContext], Tensor]
StepGate = Callable[[StepContext], bool]


class GRPOModule(pl.LightningModule):
    """GRPO on search trajectories.

    Args:
        policy: which model, LoRA, dtype, checkpointing.
        lr: AdamW learning rate (paper: 1e-6 full fine-tuning; LoRA wants ~1e-5..1e-4).
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear warm-up length in training steps; None uses ``warmup_ratio``.
        warmup_ratio: warm-up as a fraction of ``trainer.max_steps`` (paper: 0.285).
        grad_clip: max total gradient norm (0 = no clipping).
        optimizer: "adamw" or "adamw8bit" (bitsandbytes' 8-bit AdamW, CPU or GPU).
        updates_per_rollout: mini-batches (optimiser updates) per rollout batch; the first is
            on-policy, the rest are increasingly off-policy (LLDS needs >= 2).
        micro_batch_size: rollouts per forward/backward; gradients accumulate over a mini-batch.
        micro_batch_tokens: when set, micro-batches are packed by a token budget instead: rows
            sorted by length, as many per micro-batch as fit in ``rows x longest row <= budget``
            (a longer row goes alone). Less padding, same gradient (micro-batches are weighted by
            their share of the mini-batch's loss). One process only.
        old_logp_source: "recompute" runs a forward pass for pi_old's log-probs (veRL's way);
            "rollout" takes the log-probs the sampler computed while generating (identical weights
            and temperature; they agree to ~1e-5 in fp32, tested) and saves that pass. Prefer
            "recompute" in bf16 or with a separate inference engine.
        reuse_onpolicy_logp: the first mini-batch's update runs on the weights that sampled the
            rollouts, so its old log-probs are its own log-probs, detached: skip their separate
            no-grad pass (with ``updates_per_rollout: 1``, the whole pass). False computes them all
            up front, as before.
        clip_eps: PPO clip epsilon (lower side).
        clip_eps_high: upper clip epsilon (None = clip_eps; larger values = "clip-higher").
        aggregation: "seq-mean-token-mean" (paper) or "token-mean" (official code).
        normalize_adv_std: divide group-centred rewards by the group std.
        kl_coef: KL-to-reference coefficient; 0 skips the reference forward entirely.
        kl_estimator: "k3" (low-variance, default) or "k1".
        entropy_coef: entropy bonus (official code 0.001; veRL later judged it harmful).
        logprob_temperature: temperature applied to logits for training log-probs; keep it equal
            to the sampling temperature so the first update is exactly on-policy.
        logprob_chunk_size: positions per vocabulary-projection chunk.
        shuffle_minibatches: shuffle rollouts before splitting into mini-batches.
        fsdp: FSDP2 settings (mixed precision, resharding); used only under ModelParallelStrategy /
            lldslight.distributed.FSDP2Strategy.
    """

    def __init__(
        self,
        policy: PolicyConfig = PolicyConfig(),
        lr: float = 1e-6,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: Optional[int] = None,
        warmup_ratio: float = 0.0,
        grad_clip: float = 1.0,
        optimizer: Literal["adamw", "adamw8bit"] = "adamw",
        updates_per_rollout: int = 1,
        micro_batch_size: int = 4,
        micro_batch_tokens: Optional[int] = None,
        reuse_onpolicy_logp: bool = True,
        old_logp_source: Literal["recompute", "rollout"] = "recompute",
        clip_eps: float = 0.2,
        clip_eps_high: Optional[float] = None,
        aggregation: obj.Aggregation = "seq-mean-token-mean",
        normalize_adv_std: bool = True,
        kl_coef: float = 0.001,
        kl_estimator: obj.KLEstimator = "k3",
        entropy_coef: float = 0.0,
        logprob_temperature: float = 1.0,
        logprob_chunk_size: int = 512,
        shuffle_minibatches: bool = True,
        fsdp: FSDPConfig = FSDPConfig(),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        require(updates_per_rollout >= 1, "model.updates_per_rollout", ">= 1", updates_per_rollout)
        require(micro_batch_size >= 1, "model.micro_batch_size", ">= 1", micro_batch_size)
        require(micro_batch_tokens is None or micro_batch_tokens >= 1, "model.micro_batch_tokens", ">= 1 or null", micro_batch_tokens)
        require(warmup_steps is None or warmup_steps >= 0, "model.warmup_steps", ">= 0 or null", warmup_steps)
        require(0 <= warmup_ratio <= 1, "model.warmup_ratio", "in [0, 1]", warmup_ratio)
        require(logprob_temperature > 0, "model.logprob_temperature", "> 0", logprob_temperature)
        self.policy_config = policy
        self.fsdp_config = fsdp
        self._rng_after_step: Optional[dict] = None  # RNG at the end of the last step (exact resume)
        self.automatic_optimization = False
        # Checkpoints hold only trainable weights (the adapter under LoRA): loading is non-strict.
        self.strict_loading = False
        self.policy: Optional[torch.nn.Module] = None
        self.reference: Optional[torch.nn.Module] = None
        self.tokenizer = None
        self.loss_terms: dict[str, LossTerm] = {}
        self.step_gates: dict[str, StepGate] = {}
        self.rollout_batch: Optional[Trajectory] = None  # set by SearchRollout before each step
        self.eval_batch: Optional[Trajectory] = None
        self.last_rollout: Optional[Trajectory] = None
        self.timings: dict[str, float] = {}
        self.last_step_metrics: dict[str, float] = {}
        self.eval_records: list[dict] = []
        self.last_eval: dict[str, Any] = {}
        self.vetoed_updates = 0
        self.loaded_step: Optional[int] = None  # global_step of the checkpoint loaded, if any

    # -- model ------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        # Lightning runs this after the data and callbacks are set up and before configure_model
        # loads the weights: settings that need the trainer, and the model's location, fail here.
        if stage == "fit" and self.hparams.warmup_steps is None and self.hparams.warmup_ratio > 0:
            require(self.trainer.max_steps > 0, "trainer.max_steps", "> 0 with model.warmup_ratio > 0 (or set "
                    "model.warmup_steps)", self.trainer.max_steps, "the warm-up is a fraction of max_steps")
        if self.policy is None:
            check_policy(self.policy_config)

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy, self.tokenizer = load_policy(self.policy_config)
        # from_pretrained returns eval mode; HF's gradient checkpointing only acts in train mode.
        self.policy.train()
        mesh = self._fsdp_mesh()
        if mesh is not None:
            shard_policy(self.policy, mesh, self.fsdp_config)
        if not has_adapter(self.policy) and self.hparams.kl_coef > 0:
            # Full fine-tuning: the reference must be a separate frozen copy of the initial weights.
            # Sharded, it is loaded again (a sharded model cannot be deep-copied, and two full
            # copies on the host at once would double the peak host memory of every rank).
            self.reference = (load_policy(self.policy_config)[0] if mesh is not None else copy.deepcopy(self.policy)).eval()
            self.reference.requires_grad_(False)
            if mesh is not None:
                shard_policy(self.reference, mesh, self.fsdp_config)

    def _fsdp_mesh(self):
        """The data-parallel mesh to shard over with FSDP2 (ModelParallelStrategy), else None (DDP,
        one device). See lldslight/distributed.py."""
        if self._trainer is not None:
            fsdp2_strategy_check(self._trainer.strategy)
        mesh = self.device_mesh
        if mesh is None:
            return None
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"ModelParallelStrategy gave tensor_parallel_size={mesh['tensor_parallel'].size()}: lldslight "
                "shards with FSDP2 over data parallelism only. Use lldslight.distributed.FSDP2Strategy, or set "
                "data_parallel_size to the number of processes and tensor_parallel_size: 1."
            )
        if self.hparams.optimizer == "adamw8bit":
            raise ValueError(
                "model.optimizer: adamw8bit (bitsandbytes) cannot step FSDP2's sharded DTensor parameters; "
                "use optimizer: adamw under FSDP2, or strategy: ddp for 8-bit AdamW"
            )
        return mesh["data_parallel"] if "data_parallel" in names else mesh

    def add_loss_term(self, name: str, fn: LossTerm) -> None:
        self.loss_terms[name] = fn

    def add_step_gate(self, name: str, fn: StepGate) -> None:
        self.step_gates[name] = fn

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def configure_optimizers(self):
        params = self.trainable_parameters()
        hp = self.hparams
        if hp.optimizer == "adamw8bit":
            bnb = require_bitsandbytes("model.optimizer: adamw8bit")
            optimizer = bnb.optim.AdamW8bit(params, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay)
        else:
            optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay)
        warmup = hp.warmup_steps
        if warmup is None:
            max_steps = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else 0
            warmup = int(round(hp.warmup_ratio * max_steps))
        warmup = max(int(warmup), 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- log-probs ----------------------------------------------------------------------------------

    def _logprobs(self, traj: Trajectory, with_entropy: bool = False, reference: bool = False):
        hp = self.hparams
        if reference and self.reference is not None:
            model = self.reference
        else:
            model = self.policy
        return through_root(model, lambda: token_logprobs(  # FSDP2 root hooks around direct decoder/head calls
            model,
            traj.input_ids,
            traj.attention_mask,
            traj.loss_mask,
            chunk_size=hp.logprob_chunk_size,
            temperature=hp.logprob_temperature,
            with_entropy=with_entropy,
            entropy_grad=bool(hp.entropy_coef),  # else the entropy is a logged diagnostic only
        ))

    def _micro_batches(self, traj: Trajectory, rows: Tensor) -> list[Tensor]:
        """Split ``rows`` into micro-batches: ``micro_batch_size`` rows each, or packed by
        ``micro_batch_tokens`` (sorted by length, so rows of similar length share a batch)."""
        hp = self.hparams
        budget = hp.get("micro_batch_tokens")
        if not budget:
            return [rows[i : i + hp.micro_batch_size] for i in range(0, len(rows), hp.micro_batch_size)]
        if self._trainer is not None and self._trainer.world_size > 1:
            # Ranks would pack different numbers of micro-batches, and every forward/backward is a
            # collective under DDP/FSDP: they would wait on each other forever.
            raise ValueError("model.micro_batch_tokens packs per process; with more than one process use micro_batch_size")
        lengths = traj.attention_mask[rows.to(traj.attention_mask.device)].sum(-1).cpu()
        order = rows[torch.argsort(lengths, stable=True)]
        sorted_len = lengths.sort(stable=True).values.tolist()
        out, start = [], 0
        for i in range(1, len(order) + 1):
            # rows start..i-1 are sorted ascending, so row i-1 is the longest: padded size = count x it
            if i == len(order) or (i + 1 - start) * sorted_len[i] > budget:
                out.append(order[start:i])
                start = i
        return out

    def _micro_weight(self, sub: Trajectory, mini_mask: Tensor) -> float:
        """A micro-batch's share of the mini-batch loss, so that the accumulated gradient is the
        gradient of the whole mini-batch's loss however it is split: the share of responses that
        have tokens (seq-mean-token-mean) or of tokens (token-mean)."""
        mask = sub.loss_mask
        if self.hparams.aggregation == "token-mean":
            total = float(mini_mask.sum())
            return float(mask.sum()) / total if total else len(sub) / len(mini_mask)
        total = float(mini_mask.any(-1).sum())
        return float(mask.any(-1).sum()) / total if total else len(sub) / len(mini_mask)

    @torch.no_grad()
    def _batch_logprobs(self, traj: Trajectory, reference: bool, rows: Optional[Tensor] = None) -> Tensor:
        """Log-probs of ``rows`` (default: all), zero elsewhere."""
        out = torch.zeros(traj.input_ids.shape, dtype=torch.float32, device=traj.input_ids.device)
        rows = torch.arange(len(traj)) if rows is None else rows
        for idx in self._micro_batches(traj, rows):
            sub = traj.select(idx)
            if reference and self.reference is None:
                with self.policy.disable_adapter():
                    logp, _ = self._logprobs(sub)
            else:
                logp, _ = self._logprobs(sub, reference=reference)
            out[idx.to(out.device), : logp.shape[1]] = logp
        return out

    def prepare_rollout(self, traj: Trajectory, onpolicy_rows: Optional[Tensor] = None) -> Trajectory:
        """Old and reference log-probs and group advantages, once per rollout batch.

        ``onpolicy_rows``: rows whose old log-probs the first update fills in itself (see
        ``reuse_onpolicy_logp``); they are left at zero here.
        """
        hp = self.hparams
        t0 = time.perf_counter()
        rows = None
        self._old_pending = torch.zeros(len(traj), dtype=torch.bool)
        if onpolicy_rows is not None and len(onpolicy_rows):
            self._old_pending[onpolicy_rows] = True
            rows = (~self._old_pending).nonzero()[:, 0]
        if hp.get("old_logp_source", "recompute") == "rollout" and traj.sample_logp is not None:
            # The sampler's own log-probs (same weights, same temperature): no extra forward pass.
            traj.old_logp = traj.sample_logp.clone()
            self._old_pending.zero_()
        else:
            traj.old_logp = self._batch_logprobs(traj, reference=False, rows=rows)
        traj.ref_logp = self._batch_logprobs(traj, reference=True) if hp.kl_coef > 0 else None
        traj.advantage = obj.group_advantages(traj.reward, traj.group_id, normalize_std=hp.normalize_adv_std)
        self.timings["logprob_s"] = time.perf_counter() - t0
        return traj

    # -- training -------------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> None:
        traj = self.rollout_batch
        if traj is None:
            raise RuntimeError(
                "GRPOModule got no rollouts: add the SearchRollout callback to trainer.callbacks "
                "(see configs/demo.yaml)"
            )
        self.rollout_batch = None
        self.last_rollout = traj  # for callbacks that look at the step's rollouts afterwards
        hp = self.hparams
        optimizer = self.optimizers(use_pl_optimizer=False)  # stepped unwrapped: see _count_training_step
        scheduler = self.lr_schedulers()
        order = torch.randperm(len(traj)) if hp.shuffle_minibatches else torch.arange(len(traj))
        minibatches = [m for m in torch.tensor_split(order, hp.updates_per_rollout) if len(m)]
        self.prepare_rollout(traj, onpolicy_rows=minibatches[0] if hp.get("reuse_onpolicy_logp", True) else None)
        _trim_host_memory()

        t0 = time.perf_counter()
        sums: dict[str, list[float]] = {}
        for update_index, mini in enumerate(minibatches):
            metrics = self._update(traj, mini, update_index, optimizer)
            for k, v in metrics.items():
                sums.setdefault(k, []).append(v)
        scheduler.step()
        self._count_training_step()
        self.timings["update_s"] = time.perf_counter() - t0
        _trim_host_memory()
        self._log_step(traj, sums)
        # Exact resume: the next step starts from this RNG state, here and after a restart.
        self._rng_after_step = capture_rng()

    def _update(self, traj: Trajectory, mini: Tensor, update_index: int, optimizer) -> dict[str, float]:
        hp = self.hparams
        optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {}
        total_loss = 0.0
        loss_ok = True
        mini_mask = traj.loss_mask[mini.to(traj.loss_mask.device)]
        pending = getattr(self, "_old_pending", None)
        for idx in self._micro_batches(traj, mini):
            sub = traj.select(idx)
            logp, entropy = self._logprobs(sub, with_entropy=True)
            if pending is not None and bool(pending[idx].any()):
                if update_index != 0 or not bool(pending[idx].all()):
                    raise RuntimeError("old log-probs were deferred for rows outside the first mini-batch")
                # No optimiser step since sampling: the current log-probs are the old ones (ratio 1).
                sub.old_logp = logp.detach().masked_fill(~sub.loss_mask, 0.0)
                traj.old_logp[idx.to(traj.old_logp.device), : sub.old_logp.shape[1]] = sub.old_logp
                pending[idx] = False
            mask = sub.loss_mask
            finite = torch.isfinite(logp) & torch.isfinite(sub.old_logp)
            if sub.ref_logp is not None:
                finite = finite & torch.isfinite(sub.ref_logp)
            nonfinite = int((mask & ~finite).sum())
            if not bool(finite.all()):
                # Zero the dropped positions in every operand, not just the mask: 0 * NaN is NaN.
                mask = mask & finite
                logp = torch.where(finite, logp, torch.zeros_like(logp))
                sub.old_logp = torch.where(finite, sub.old_logp, torch.zeros_like(sub.old_logp))
                if sub.ref_logp is not None:
                    sub.ref_logp = torch.where(finite, sub.ref_logp, torch.zeros_like(sub.ref_logp))
            pg, ratio, clipped = obj.clipped_surrogate(logp, sub.old_logp, sub.advantage, hp.clip_eps, hp.clip_eps_high)
            loss = obj.aggregate(pg, mask, hp.aggregation)
            stats = {
                "pg_loss": float(loss.detach()),
                "clip_frac": float(obj.masked_mean(clipped.float(), mask)),
                "ratio_max": float(ratio.detach().masked_fill(~mask, 0).max()) if mask.any() else 1.0,
                "entropy": float(obj.masked_mean(entropy.detach(), mask)),
                "nonfinite_tokens": float(nonfinite),
            }
            if hp.kl_coef > 0:
                kl = obj.aggregate(obj.kl_penalty(logp, sub.ref_logp, hp.kl_estimator), mask, hp.aggregation)
                loss = loss + hp.kl_coef * kl
                stats["kl"] = float(kl.detach())
            if hp.entropy_coef:
                loss = loss - hp.entropy_coef * obj.aggregate(entropy, mask, hp.aggregation)
            if self.loss_terms:
                ctx = LossContext(
                    logp=logp,
                    old_logp=sub.old_logp,
                    ref_logp=sub.ref_logp,
                    advantage=sub.advantage,
                    loss_mask=mask,
                    action_id=sub.action_id,
                    answer_mask=sub.answer_mask,
                    num_searches=sub.num_searches,
                    rollout=traj,
                    update_index=update_index,
                )
                for fn in self.loss_terms.values():
                    loss = loss + fn(ctx)
                stats.update(ctx.metrics)
            weight = self._micro_weight(sub, mini_mask)
            if not torch.isfinite(loss):
                loss_ok = False  # never backpropagate a NaN: it would poison every gradient
                stats["nonfinite_loss"] = 1.0
                if self._trainer is not None and self._trainer.world_size > 1:
                    # The other ranks' backward waits on this rank's gradient collectives: join them
                    # with a zero gradient (the update is then vetoed on every rank, below).
                    self.manual_backward(logp.sum() * 0.0)
            else:
                self.manual_backward(loss * weight)
                total_loss += float(loss.detach()) * weight
            for k, v in stats.items():
                if k == "ratio_max":
                    acc[k] = max(acc.get(k, v), v)
                elif k.startswith("nonfinite"):
                    acc[k] = acc.get(k, 0.0) + v
                else:
                    acc[k] = acc.get(k, 0.0) + v * weight

        params = self.trainable_parameters()
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(grad_norm, DTensor):
            # FSDP2: the norm is already global (Replicate); hand gates a plain tensor.
            grad_norm = grad_norm.full_tensor()
        loss_ok = all_ranks_agree(loss_ok, self.device)  # gates must see the same inputs on every rank
        step = StepContext(module=self, grad_norm=grad_norm, loss=total_loss, update_index=update_index)
        step.vetoed = not (loss_ok and bool(torch.isfinite(grad_norm)))
        for gate in self.step_gates.values():
            # Every gate sees every update (a guard counts consecutive vetoes); none can undo a veto.
            if not gate(step):
                step.vetoed = True
        accept = all_ranks_agree(not step.vetoed, self.device)  # one rank stepping alone splits the replicas
        acc.update(step.metrics)
        acc["grad_norm"] = float(grad_norm)
        acc["loss"] = total_loss
        if accept:
            if hp.grad_clip > 0 and grads:
                torch.nn.utils.clip_grads_with_norm_(params, hp.grad_clip, step.grad_norm)
            optimizer.step()
        else:
            # A vetoed update leaves weights and optimiser state exactly as they were.
            optimizer.zero_grad(set_to_none=True)
            self.vetoed_updates += 1
        acc["vetoed"] = 0.0 if accept else 1.0
        return acc

    def _count_training_step(self) -> None:
        # Lightning counts a manual-optimisation step per optimizer.step(); we want one per rollout
        # batch whatever the number of updates or vetoes, so the loop's counter is advanced here
        # and the optimiser is stepped unwrapped (see LightningOptimizer's step_progress).
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    def _log_step(self, traj: Trajectory, sums: dict[str, list[float]]) -> None:
        n = len(traj)
        actions = traj.num_actions.float().clamp(min=1)
        groups = torch.unique(traj.group_id)
        zero_var = 0
        for g in groups:
            r = traj.reward[traj.group_id == g]
            zero_var += int(r.numel() > 1 and bool((r == r[0]).all()))
        metrics = {
            "train/reward": float(traj.reward.mean()),
            "train/em": float(traj.em.mean()) if traj.em is not None else float("nan"),
            "train/searches": float(traj.num_searches.float().mean()),
            "train/response_len": float(traj.response_len.float().mean()),
            "train/valid_action_rate": float((1 - traj.num_invalid.float() / actions).mean()),
            "train/answered_rate": float(sum(f == "answer" for f in traj.finish_reason) / n),
            "train/zero_var_groups": zero_var / max(len(groups), 1),
            "train/lr": float(self.lr_schedulers().get_last_lr()[0]),
            "train/vetoed_updates": float(sum(sums.get("vetoed", [0.0]))),
        }
        for k, values in sums.items():
            if k == "vetoed":
                continue
            finite = [v for v in values if math.isfinite(v)]
            if k == "ratio_max":
                metrics["train/ratio_max"] = max(finite) if finite else float("nan")
            elif k == "grad_norm":
                metrics["train/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
                metrics["train/grad_norm_max"] = max(values)
            elif k.startswith("nonfinite"):
                metrics[f"train/{k}"] = sum(values)
            elif k.endswith("_max"):
                metrics[k if "/" in k else f"train/{k}"] = max(finite) if finite else float("nan")
            else:
                # Keys a callback namespaced itself ("llds/loss") are logged as they are.
                name = k if "/" in k else f"train/{k}"
                metrics[name] = sum(finite) / len(finite) if finite else float("nan")
        for k, v in self.timings.items():
            metrics[f"time/{k}"] = v
        self.last_step_metrics = metrics
        # Across ranks: maxima stay maxima, counts add up, a step takes as long as its slowest rank.
        sync = self.trainer.world_size > 1
        parts: dict[str, dict[str, float]] = {"mean": {}, "max": {}, "sum": {}}
        for k, v in metrics.items():
            kind = "max" if (k.endswith("_max") or k.startswith("time/")) else "sum" if "nonfinite" in k else "mean"
            parts[kind][k] = v
        for kind, part in parts.items():
            if part:
                self.log_dict(part, on_step=True, on_epoch=False, batch_size=n, sync_dist=sync, reduce_fx=kind)

    # -- checkpoints (lldslight/checkpoint.py) ----------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        state = checkpoint.get("state_dict")
        # Only trainable weights (the adapter under LoRA; never the frozen reference): the rest is
        # rebuilt from model.policy. A sharded FSDP2 checkpoint (DTensor values) keeps every key,
        # since distributed-checkpoint loading asks for the model's full key set.
        if state and not any(isinstance(v, DTensor) for v in state.values()):
            checkpoint["state_dict"] = {k: v for k, v in state.items() if k in trainable}
        checkpoint["lldslight"] = {
            "trainable_keys": sorted(trainable),
            "rng": gather_rng(self._rng_after_step if self._rng_after_step is not None else capture_rng()),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.policy is None:
            self.configure_model()  # GRPOModule.load_from_checkpoint: build the model its weights load into
        self.loaded_step = checkpoint.get("global_step")  # validate/test: Lightning leaves global_step at 0
        meta = checkpoint.get("lldslight", {})
        state = checkpoint.get("state_dict")  # absent under FSDP2, whose strategy loaded it already
        shapes = {k: p.shape for k, p in self.state_dict(keep_vars=True).items()}
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        if state:
            saved = {k: getattr(v, "shape", None) for k, v in state.items()}
        else:
            saved = {k: None for k in meta.get("trainable_keys", trainable)}
        check_state_keys(shapes, trainable, saved, source=str(getattr(self._trainer, "ckpt_path", None) or "being loaded"))
        if state:
            # The frozen weights are already in place: complete the dict with them, so the (non-strict)
            # load that follows does not list every base weight as missing.
            for k, v in self.state_dict().items():
                state.setdefault(k, v)
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == "fit":  # resuming training, not just loading weights
            self._rng_after_step = pick_rng(meta.get("rng"), trainer.global_rank, trainer.world_size)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Start each training step from the RNG state the previous one ended with (restored from the
        # checkpoint after a restart): random draws between steps (the data loader draws a seed when
        # it starts an epoch, and again when a resumed run restarts it) then never shift the stream.
        if self._trainer is not None and self._trainer.training and self._rng_after_step is not None:
            restore_rng(self._rng_after_step)
        return batch

    # -- evaluation ---------------------------------------------------------------------------------

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step()

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step()

    def _eval_step(self) -> None:
        traj = self.eval_batch
        if traj is None:
            raise RuntimeError("GRPOModule got no evaluation rollouts: add the SearchRollout callback")
        self.eval_batch = None
        from lldslight.evaluation import trajectory_records

        self.eval_records.extend(trajectory_records(traj))

    def on_validation_epoch_start(self) -> None:
        self.eval_records = []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._finish_eval("val")

    def on_test_epoch_end(self) -> None:
        self._finish_eval("test")

    def _finish_eval(self, stage: str) -> None:
        from lldslight.evaluation import gather_records, summarise

        records = gather_records(self.eval_records)
        summary = summarise(records)
        self.last_eval = {"stage": stage, "summary": summary, "step": self.global_step}
        flat = {f"{stage}/{k}": v for k, v in summary["overall"].items()}
        for source, values in summary["per_source"].items():
            flat[f"{stage}/em/{source}"] = values["em"]
        if self.trainer.sanity_checking:
            return
        # Every rank already holds the gathered numbers; no second reduction.
        self.log_dict(flat, on_step=False, on_epoch=True, rank_zero_only=False, sync_dist=False)
        if self.trainer.is_global_zero and self.trainer.log_dir:
            from lldslight.evaluation import write_report

            # Named after the weights' training step: a checkpoint's own step in validate/test.
            step = self.global_step if self.trainer.state.fn == "fit" or self.loaded_step is None else self.loaded_step
            json_path, md_path = write_report(summary, records, self.trainer.log_dir, f"{stage}_step{step}")
            self.last_eval["report"] = str(md_path)
            if self.trainer.state.fn in ("validate", "test"):
                print(f"\n{stage} results ({json_path}):\n" + md_path.read_text(), flush=True)
