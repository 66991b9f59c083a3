"""GRPOModule: the policy and its frozen reference, orchestrated for GRPO (docs/architecture.md, One training step).

This file sets up the models, the optimiser (update/optim.py) and the checkpoint state, and logs; the updates
themselves (old/reference log-probs, mini/micro-batches, the loss and its terms, step gates, the
optimiser step) read top to bottom in update/train.py, and the formulas live in update/objectives.py.
Callbacks extend an update through ``add_loss_term`` (LLDS) and ``add_step_gate`` (the
gradient-spike guard); see update/train.py for the contracts. GRPOModule is update/train.py's ``Learner``
(what an update needs from the model) and takes the update's settings whole, an
``update.UpdateConfig`` (``model.update``): ``self.update_config``, which callbacks read too; the
optimiser's are an ``optim.OptimConfig`` (``model.optim``): ``self.optim_config``.

The rollout callback hands its trajectories over through one method, :meth:`GRPOModule.receive_rollout`;
every attribute a callback may set or read is declared, typed, in ``__init__``.

One "step" (``trainer.global_step``, ``max_steps``, checkpoint intervals) is one rollout batch,
as in veRL and TRL logs, however many optimiser updates it holds.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, ContextManager, Literal, Mapping, Optional, get_args

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lldslight.rollout import evaluation
from lldslight.errors import require
from lldslight.policy.activation_checkpointing import activation_budget
from lldslight.policy.config import PolicyConfig
from lldslight.policy.distributed import (
    FSDPConfig,
    data_parallel_mesh,
    fsdp2_strategy_check,
    gradient_sync,
    reduce_over_ranks,
    shard_policy,
    through_root,
)
from lldslight.policy.files import check_policy
from lldslight.policy.load import has_adapter, load_policy
from lldslight.policy.precision import model_arithmetic, resolve_precision
from lldslight.run import deprecated_keys
from lldslight.run.checkpoint_io import capture_rng, check_state_keys, gather_rng, pick_rng, restore_rng
from lldslight.run.metric_rules import reduction
from lldslight.trajectory import Trajectory
from lldslight.update import frozen_prefix, train
from lldslight.update.logprobs import token_logprobs
from lldslight.update.optim import OptimConfig, build_optimizer, set_learning_rate
from lldslight.update.train import LossContext, LossTerm, StepContext, StepGate, UpdateConfig  # noqa: F401 (the hooks' contracts)

RolloutStage = Literal["train", "eval"]


class GRPOModule(pl.LightningModule):
    """GRPO on search trajectories; update/train.py's ``Learner``.

    Its settings come in groups, each a typed dataclass taken whole (``model.<group>.<field>`` in
    YAML; every field documented in docs/configuration.md and by ``lldslight fit --help``): a field
    added to a group appears in YAML with no code here.

    Args:
        policy: which model, LoRA, precision, checkpointing (policy.PolicyConfig).
        update: what one rollout batch's updates do: mini- and micro-batches, the PPO clip, KL,
            entropy, gradient clipping, ... (update.UpdateConfig; ``self.update_config``).
        optim: the optimiser and its warm-up: learning rate, betas, weight decay, ...
            (optim.OptimConfig; ``self.optim_config``).
        logprob_temperature: temperature applied to logits for training log-probs; keep it equal
            to the sampling temperature so the first update is exactly on-policy.
        logprob_chunk_size: positions per vocabulary-projection chunk; null sizes a chunk's fp32 logits
            to 32 MiB (170 positions at a 49k vocabulary, 55 at 152k; logprobs.py).
        fsdp: FSDP2 settings (mixed precision, resharding); used only under ModelParallelStrategy /
            lldslight.policy.distributed.FSDP2Strategy.
    """

    def __init__(
        self,
        policy: PolicyConfig = PolicyConfig(),
        update: UpdateConfig = UpdateConfig(),
        optim: OptimConfig = OptimConfig(),
        logprob_temperature: float = 1.0,
        logprob_chunk_size: Optional[int] = None,
        fsdp: FSDPConfig = FSDPConfig(),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        require(0 < logprob_temperature < math.inf, "model.logprob_temperature", "> 0 and finite", logprob_temperature)
        # A group checks its own ranges when it is built ("model.update.<key> must be ..."); from
        # YAML (or a checkpoint's hyper-parameters), a mapping here is built now.
        update, optim = _built(UpdateConfig, update), _built(OptimConfig, optim)
        self.update_config: UpdateConfig = update
        self.optim_config: OptimConfig = optim
        if update.old_logp_source == "rollout" and policy.precision != "fp32":
            arith = resolve_precision(policy)  # "auto" asks the hardware now (cheap), so this fails before loading
            require(arith.precision == "fp32", "model.update.old_logp_source", "'recompute' under policy.precision "
                    f"{policy.precision}{' -> ' + arith.precision if policy.precision == 'auto' else ''}", update.old_logp_source,
                    "the sampler's and the trainer's bf16 forwards round differently, so the on-policy ratio would not be 1; "
                    "'recompute' costs no forward for the on-policy mini-batch (reuse_onpolicy_logp)")
        self.policy_config = policy
        self.fsdp_config = fsdp
        self.logprob_temperature: float = logprob_temperature  # of the training log-probs (SearchRollout checks the sampler's)
        self.logprob_chunk_size: Optional[int] = logprob_chunk_size
        self.automatic_optimization = False
        # Checkpoints hold only trainable weights (the adapter under LoRA): loading is non-strict.
        self.strict_loading = False
        # Every attribute a callback may set or read, declared here (tests/test_handoff.py checks it).
        self.policy: Optional[torch.nn.Module] = None  # the trained model (configure_model)
        self.reference: Optional[torch.nn.Module] = None  # the frozen copy for KL (full fine-tuning); Heal may set it
        self.tokenizer = None  # the policy's tokenizer (configure_model)
        self.loss_terms: dict[str, LossTerm] = {}  # add_loss_term (LLDS)
        self.step_gates: dict[str, StepGate] = {}  # add_step_gate (GradientSpikeGuard)
        self.rollout_batch: Optional[Trajectory] = None  # receive_rollout(stage="train"): the next step's rollouts
        self.eval_batch: Optional[Trajectory] = None  # receive_rollout(stage="eval"): the next eval step's rollouts
        self.last_rollout: Optional[Trajectory] = None  # the step's rollouts, prepared (LLDMonitor, RunSummary read it)
        self.timings: dict[str, float] = {}  # seconds per phase of the last step, logged as time/<key>
        self.last_step_metrics: dict[str, float] = {}  # the last step's train/* metrics, reduced over ranks
        self.eval_records: list[dict] = []  # this evaluation's per-question records
        self.last_eval: dict[str, Any] = {}  # the last evaluation's result (evaluation.finish)
        # SearchRollout's before/after-fit dev summaries (evaluation.summarise, plus "records"), by "before"/"after"
        self.eval_history: dict[str, dict] = {}
        self.vetoed_updates = 0  # updates vetoed so far (update.step)
        self.loaded_step: Optional[int] = None  # global_step of the checkpoint loaded, if any
        self.rng_after_step: Optional[dict] = None  # RNG at the end of the last step (exact resume; Heal restores it)
        self._saved_hparams: Optional[dict] = None  # the resumed checkpoint's hyper-parameters (on_train_start)
        self._prefix_shared: dict[str, Any] = {}  # _reference_shares_prefix's answer for the current reference

    # -- model ------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        # Lightning runs this after the data and callbacks are set up and before configure_model
        # loads the weights: settings that need the trainer, and the model's location, fail here.
        # Lightning's precision plugins autocast training_step but not the callbacks that sample:
        # the sampler and the trainer would compute differently. policy.precision covers both.
        precision = str(getattr(self.trainer, "precision", "32-true"))
        require(precision in ("32-true", "32", "64-true", "64"), "trainer.precision", "'32-true' (set model.policy.precision "
                "instead: it applies to sampling and training alike)", precision)
        optim = self.optim_config
        if stage == "fit" and optim.warmup_steps is None and optim.warmup_ratio > 0:
            require(self.trainer.max_steps > 0, "trainer.max_steps", "> 0 with model.optim.warmup_ratio > 0 (or set "
                    "model.optim.warmup_steps)", self.trainer.max_steps, "the warm-up is a fraction of max_steps")
        if self.policy is None:
            check_policy(self.policy_config)

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy, self.tokenizer = load_policy(self.policy_config)
        # from_pretrained returns eval mode; HF's gradient checkpointing only acts in train mode.
        self.policy.train()
        if self._trainer is not None:
            fsdp2_strategy_check(self._trainer.strategy)
        # FSDP2 (ModelParallelStrategy), else None
        mesh = data_parallel_mesh(self.device_mesh, micro_batch_tokens=self.update_config.micro_batch_tokens, optimizer=self.optim_config.optimizer)
        if mesh is not None:
            shard_policy(self.policy, mesh, self.fsdp_config)
        if not has_adapter(self.policy) and self.update_config.kl_coef > 0:
            # Full fine-tuning: the reference must be a separate frozen copy of the initial weights.
            # Sharded, it is loaded again (a sharded model cannot be deep-copied, and two full
            # copies on the host at once would double the peak host memory of every rank).
            self.reference = (load_policy(self.policy_config)[0] if mesh is not None else copy.deepcopy(self.policy)).eval()
            self.reference.requires_grad_(False)
            arith = model_arithmetic(self.reference)
            if arith is not None:
                self.reference.to(arith.frozen)  # frozen: bf16 under bf16-mixed, whose policy trains in fp32
            if mesh is not None:
                shard_policy(self.reference, mesh, self.fsdp_config)

    def configure_callbacks(self) -> list[pl.Callback]:
        # Lightning's default bar counts batches of an epoch ("Epoch 0/-2" under max_steps): a step
        # bar replaces it (Lightning swaps a returned subclass in for its base class's instance).
        from lldslight.callbacks.progress import step_bar_for
        from lldslight.callbacks.signal import GroupSignal

        bar = step_bar_for(self._trainer.progress_bar_callback) if self._trainer is not None else None
        added: list[pl.Callback] = [bar] if bar is not None else []
        # The group-signal guard runs in every fit (a run without GRPO signal says so); one the
        # config names wins (Lightning would replace it with a returned instance of its type).
        callbacks = self._trainer.callbacks if self._trainer is not None else []
        if not any(isinstance(cb, GroupSignal) for cb in callbacks):
            added.append(GroupSignal())
        from lldslight.callbacks.step_row import StepRow

        if not any(isinstance(cb, StepRow) for cb in callbacks):
            added.append(StepRow())  # a checkpoint carries its step's metrics row (a resume writes a lost one back)
        return added

    def add_loss_term(self, name: str, fn: LossTerm) -> None:
        self.loss_terms[name] = fn

    def add_step_gate(self, name: str, fn: StepGate) -> None:
        self.step_gates[name] = fn

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def gradient_sync(self, enabled: bool) -> ContextManager[None]:
        """Backward passes inside reduce gradients over ranks only when ``enabled`` (update.Learner)."""
        return gradient_sync(self, enabled)

    def reconfigure_update(self, **changes: Any) -> None:
        """Change update settings mid-run (Heal's remedies: ``updates_per_rollout``, ``kl_coef``):
        ``update_config`` (checked again) and the hyper-parameters saved in checkpoints alike."""
        self.update_config = dataclasses.replace(self.update_config, **changes)
        saved = self.hparams["update"]  # a mapping under LightningCLI (its config), else the UpdateConfig given
        self.hparams["update"] = {**saved, **dataclasses.asdict(self.update_config)} if isinstance(saved, Mapping) else self.update_config

    def receive_rollout(
        self, trajectory: Trajectory, stage: RolloutStage = "train", timings: Optional[Mapping[str, float]] = None
    ) -> None:
        """The rollout callback's hand-off (SearchRollout, before each step): ``trajectory`` is what
        the next training step trains on (``stage="train"``) or the next validation/test step scores
        (``"eval"``); ``timings`` (seconds, e.g. ``rollout_s``, ``retrieval_s``) are logged with the
        step as ``time/<key>``."""
        require(stage in get_args(RolloutStage), "receive_rollout stage", f"one of {get_args(RolloutStage)}", stage)
        if stage == "train":
            self.rollout_batch = trajectory
        else:
            self.eval_batch = trajectory
        if timings:
            self.timings.update(timings)

    def configure_optimizers(self):
        max_steps = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else 0
        optimizer, scheduler = build_optimizer(self.trainable_parameters(), self.optim_config, max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- log-probs ----------------------------------------------------------------------------------

    def logprobs(self, traj: Trajectory, reference: bool = False, with_entropy: bool = False) -> tuple[Tensor, Tensor]:
        """Token log-probs and entropies [b, T] of ``traj``'s model tokens under the policy, or under
        the frozen reference: its own copy (full fine-tuning) or the policy with the adapter off."""
        model = self.reference if reference and self.reference is not None else self.policy
        adapter_off = self.policy.disable_adapter() if reference and self.reference is None else contextlib.nullcontext()
        boundary = None
        if traj.frozen_hidden is not None and traj.frozen_start is not None and (not reference or self._reference_shares_prefix(traj.frozen_start)):
            boundary = frozen_prefix.Boundary(traj.frozen_hidden, traj.frozen_start)
        budget = self.policy_config.activation_budget_mb * 2**20 if self.policy_config.gradient_checkpointing == "auto" else None
        with adapter_off, activation_budget(model, budget):
            return through_root(model, lambda: token_logprobs(  # FSDP2 root hooks around direct decoder/head calls
                model,
                traj.input_ids,
                traj.attention_mask,
                traj.loss_mask,
                chunk_size=self.logprob_chunk_size,
                temperature=self.logprob_temperature,
                with_entropy=with_entropy,
                entropy_grad=bool(self.update_config.entropy_coef),  # else the entropy is a logged diagnostic only
                groups=traj.group_id if self.update_config.shared_prefix else None,
                boundary=boundary,
            ))

    def with_frozen_prefix(self, traj: Trajectory, micro: list[Tensor]) -> Trajectory:
        """``traj`` with the hidden state entering the first trained decoder layer stored on it
        (``frozen_hidden``), computed once in the micro-batches ``micro``, so that every later pass
        of this rollout batch runs only the layers from there up (lldslight/update/frozen_prefix.py);
        ``traj`` unchanged where that does not apply (said once when it is turned on but cannot run)."""
        if not self.update_config.frozen_prefix or self.policy is None:
            return traj
        start, why = frozen_prefix.start_layer(self.policy)
        if start is None:
            if why:
                frozen_prefix.say_once(why, f"model.update.frozen_prefix: every pass runs the whole decoder ({why})")
            return traj
        budget = self.update_config.frozen_prefix_max_mb * 2**20
        size = frozen_prefix.boundary_bytes(self.policy, traj.input_ids.shape)
        if size > budget:
            frozen_prefix.say_once("budget", f"model.update.frozen_prefix: a rollout batch's layer-{start} hidden states take "
                                   f"{size / 2**20:.0f} MiB, over frozen_prefix_max_mb = {self.update_config.frozen_prefix_max_mb:g}: "
                                   "every pass runs the whole decoder (raise the budget to reuse them)")
            return traj
        hidden = frozen_prefix.compute(self.policy, traj.input_ids, traj.attention_mask,
                                       traj.group_id if self.update_config.shared_prefix else None, start, micro)
        return dataclasses.replace(traj, frozen_hidden=hidden, frozen_start=start)

    def _reference_shares_prefix(self, start: int) -> bool:
        """Whether the reference computes the policy's layers below ``start`` (checked once per
        reference object and start: Heal may set a new reference)."""
        key = (id(self.reference), start)
        if self._prefix_shared.get("key") != key:
            self._prefix_shared = {"key": key, "value": frozen_prefix.reference_shares(self.policy, self.reference, start)}
        return bool(self._prefix_shared["value"])

    def batch_logprobs(self, traj: Trajectory, reference: bool = False, rows: Optional[Tensor] = None) -> Tensor:
        """No-grad log-probs [B, T] of ``rows`` (default: all) in micro-batches (update.batch_logprobs;
        LLDMonitor and LLDProbe use it)."""
        return train.batch_logprobs(self, traj, reference=reference, rows=rows)

    # -- training -------------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> None:
        traj = self.rollout_batch
        require(traj is not None, "the rollouts of a training step", "handed over with GRPOModule.receive_rollout (add the "
                "SearchRollout callback to trainer.callbacks, see configs/demo.yaml)", traj)
        self.rollout_batch = None
        optimizer = self.optimizers(use_pl_optimizer=False)  # stepped unwrapped: see _count_training_step
        result = train.train_on_rollout(self, traj, optimizer, self.lr_schedulers())
        self.last_rollout = result.trajectory
        self._count_training_step()
        self.timings.update(result.timings)
        self._log_step(result)
        # Exact resume: the next step starts from this RNG state, here and after a restart.
        self.rng_after_step = capture_rng()

    def _count_training_step(self) -> None:
        # Lightning counts a manual-optimisation step per optimizer.step(); we want one per rollout
        # batch whatever the number of updates or vetoes, so the loop's counter is advanced here
        # and the optimiser is stepped unwrapped (see LightningOptimizer's step_progress).
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    def _log_step(self, result: train.RolloutUpdates) -> None:
        traj = result.trajectory
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
            "train/lr": result.lr,
        }
        per_update, summed = result.step_metrics()
        metrics.update(per_update)
        for k, v in self.timings.items():
            metrics[f"time/{k}"] = v
        # Across ranks, by lldslight/run/metric_rules.py (maxima stay maxima, shares and counts add up, a
        # step takes as long as its slowest rank, the rest is averaged); an update's key without a
        # rule (your loss term's or gate's) by its channel. Reduced here, once, so that callbacks
        # reading last_step_metrics see the same global values on every rank (every rank logs the
        # same keys).
        kinds = {k: reduction(k, default="sum" if k in summed else "mean") for k in metrics}
        self.last_step_metrics = reduce_over_ranks(metrics, kinds, self.device)
        self.log_dict(self.last_step_metrics, on_step=True, on_epoch=False, batch_size=n, sync_dist=False)

    # -- checkpoints (lldslight/run/checkpoint_io.py) ----------------------------------------------------

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
            "rng": gather_rng(self.rng_after_step if self.rng_after_step is not None else capture_rng()),
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
            self.rng_after_step = pick_rng(meta.get("rng"), trainer.global_rank, trainer.world_size)
            self._saved_hparams = dict(checkpoint.get("hyper_parameters") or {})

    def on_train_start(self) -> None:
        # The optimiser and scheduler states restored from a checkpoint carry the old run's lr,
        # betas and weight decay (and LambdaLR its base_lrs). Where the configured value differs
        # from the checkpoint's saved hyper-parameter, the user overrode it (--resume_override):
        # apply it. Comparing with the saved hyper-parameter, not the restored optimiser, keeps a
        # rate lowered during the run (e.g. by a callback) on a plain resume.
        saved, self._saved_hparams = getattr(self, "_saved_hparams", None), None
        if not saved:
            return
        before = OptimConfig(**deprecated_keys.nested(saved)["optim"])  # an earlier lldslight's flat keys too
        optim = self.optim_config
        changed = {k for k in ("lr", "betas", "weight_decay") if getattr(before, k) != getattr(optim, k)}
        if not changed:
            return
        optimizer = self.optimizers(use_pl_optimizer=False)
        for group in optimizer.param_groups:
            if "betas" in changed:
                group["betas"] = optim.betas
            if "weight_decay" in changed:
                group["weight_decay"] = optim.weight_decay
        if "lr" in changed:
            schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs] or [None]
            for scheduler in schedulers:
                set_learning_rate(optimizer, scheduler, optim.lr)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Start each training step from the RNG state the previous one ended with (restored from the
        # checkpoint after a restart): random draws between steps (the data loader draws a seed when
        # it starts an epoch, and again when a resumed run restarts it) then never shift the stream.
        if self._trainer is not None and self._trainer.training and self.rng_after_step is not None:
            restore_rng(self.rng_after_step)
        return batch

    # -- evaluation (lldslight/rollout/evaluation.py) --------------------------------------------------------

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step()

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step()

    def _eval_step(self) -> None:
        traj = self.eval_batch
        require(traj is not None, "the rollouts of an evaluation step", "handed over with GRPOModule.receive_rollout(..., "
                "stage='eval') (add the SearchRollout callback to trainer.callbacks, see configs/demo.yaml)", traj)
        self.eval_batch = None
        self.eval_records.extend(evaluation.trajectory_records(traj))

    def on_validation_epoch_start(self) -> None:
        self.eval_records = []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._finish_eval("val")

    def on_test_epoch_end(self) -> None:
        self._finish_eval("test")

    def _finish_eval(self, stage: str) -> None:
        sanity = self.trainer.sanity_checking
        # Named after the weights' training step: in validate/test, the loaded checkpoint's own step
        # (Lightning leaves global_step at 0 there).
        step = self.global_step if self.trainer.state.fn == "fit" or self.loaded_step is None else self.loaded_step
        self.last_eval = evaluation.finish(self.eval_records, stage, self.trainer, write=not sanity, step=step)
        if sanity:
            return
        # Every rank already holds the gathered numbers; no second reduction.
        self.log_dict(evaluation.flat_metrics(self.last_eval["summary"], stage), on_step=False, on_epoch=True,
                      rank_zero_only=False, sync_dist=False)
        report = self.last_eval.get("report")
        if report and self.trainer.state.fn in ("validate", "test"):
            print(f"\n{stage} results ({Path(report).with_suffix('.json')}):\n" + Path(report).read_text(), flush=True)


def _built(cls: type, value: Any) -> Any:
    """A group's dataclass from an instance, or from a mapping of its fields (hyper-parameters)."""
    return value if isinstance(value, cls) else cls(**dict(value))
