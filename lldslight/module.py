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

from lldslight import objectives as obj
from lldslight.logprobs import token_logprobs
from lldslight.policy import PolicyConfig, has_adapter, load_policy
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
        optimizer: "adamw" or "adamw8bit" (bitsandbytes, GPU).
        updates_per_rollout: mini-batches (optimiser updates) per rollout batch; the first is
            on-policy, the rest are increasingly off-policy (LLDS needs >= 2).
        micro_batch_size: rollouts per forward/backward; gradients accumulate over a mini-batch.
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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if updates_per_rollout < 1 or micro_batch_size < 1:
            raise ValueError("updates_per_rollout and micro_batch_size must be >= 1")
        self.policy_config = policy
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
        self.timings: dict[str, float] = {}
        self.last_step_metrics: dict[str, float] = {}
        self.eval_records: list[dict] = []
        self.last_eval: dict[str, Any] = {}
        self.vetoed_updates = 0

    # -- model ------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy, self.tokenizer = load_policy(self.policy_config)
        if not has_adapter(self.policy) and self.hparams.kl_coef > 0:
            # Full fine-tuning: the reference must be a separate frozen copy of the initial weights.
            self.reference = copy.deepcopy(self.policy).eval()
            self.reference.requires_grad_(False)

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
            try:
                import bitsandbytes as bnb
            except ImportError as err:
                raise ImportError("optimizer: adamw8bit needs bitsandbytes: pip install 'lldslight[gpu]'") from err
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
        return token_logprobs(
            model,
            traj.input_ids,
            traj.attention_mask,
            traj.loss_mask,
            chunk_size=hp.logprob_chunk_size,
            temperature=hp.logprob_temperature,
            with_entropy=with_entropy,
        )

    @torch.no_grad()
    def _batch_logprobs(self, traj: Trajectory, reference: bool) -> Tensor:
        out = torch.zeros(traj.input_ids.shape, dtype=torch.float32, device=traj.input_ids.device)
        mb = self.hparams.micro_batch_size
        for start in range(0, len(traj), mb):
            idx = list(range(start, min(start + mb, len(traj))))
            sub = traj.select(idx)
            if reference and self.reference is None:
                with self.policy.disable_adapter():
                    logp, _ = self._logprobs(sub)
            else:
                logp, _ = self._logprobs(sub, reference=reference)
            out[start : start + len(idx), : logp.shape[1]] = logp
        return out

    def prepare_rollout(self, traj: Trajectory) -> Trajectory:
        """Old and reference log-probs and group advantages, once per rollout batch."""
        hp = self.hparams
        t0 = time.perf_counter()
        traj.old_logp = self._batch_logprobs(traj, reference=False)
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
        hp = self.hparams
        optimizer = self.optimizers(use_pl_optimizer=False)  # stepped unwrapped: see _count_training_step
        scheduler = self.lr_schedulers()
        self.prepare_rollout(traj)

        t0 = time.perf_counter()
        order = torch.randperm(len(traj)) if hp.shuffle_minibatches else torch.arange(len(traj))
        minibatches = [m for m in torch.tensor_split(order, hp.updates_per_rollout) if len(m)]
        sums: dict[str, list[float]] = {}
        for update_index, mini in enumerate(minibatches):
            metrics = self._update(traj, mini, update_index, optimizer)
            for k, v in metrics.items():
                sums.setdefault(k, []).append(v)
        scheduler.step()
        self._count_training_step()
        self.timings["update_s"] = time.perf_counter() - t0
        self._log_step(traj, sums)

    def _update(self, traj: Trajectory, mini: Tensor, update_index: int, optimizer) -> dict[str, float]:
        hp = self.hparams
        optimizer.zero_grad(set_to_none=True)
        mb = hp.micro_batch_size
        acc: dict[str, float] = {}
        total_loss = 0.0
        loss_ok = True
        for start in range(0, len(mini), mb):
            idx = mini[start : start + mb]
            sub = traj.select(idx)
            logp, entropy = self._logprobs(sub, with_entropy=True)
            mask = sub.loss_mask
            finite = torch.isfinite(logp) & torch.isfinite(sub.old_logp)
            nonfinite = int((mask & ~finite).sum())
            if nonfinite:
                mask = mask & finite
                logp = torch.where(finite, logp, torch.zeros_like(logp))
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
            weight = len(idx) / len(mini)
            if not torch.isfinite(loss):
                loss_ok = False  # never backpropagate a NaN: it would poison every gradient
                stats["nonfinite_loss"] = 1.0
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
        step = StepContext(module=self, grad_norm=grad_norm, loss=total_loss, update_index=update_index)
        accept = loss_ok and bool(torch.isfinite(grad_norm))
        for gate in self.step_gates.values():
            if not accept:
                break
            accept = bool(gate(step))
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
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=n, sync_dist=self.trainer.world_size > 1)

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
        if not self.trainer.sanity_checking:
            # Every rank already holds the gathered numbers; no second reduction.
            self.log_dict(flat, on_step=False, on_epoch=True, rank_zero_only=False, sync_dist=False)
