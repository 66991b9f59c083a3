"""One rollout batch's GRPO updates, top to bottom (docs/algorithm.md §2 and §4; docs/architecture.md, One training step).

rollout.py makes a Trajectory, this file turns it into optimiser updates, objectives.py holds the
formulas. ``GRPOModule.training_step`` calls :func:`train_on_rollout` once per rollout batch:

  1. prepare        group advantages; pi_old's and the reference's log-probs (no grad)
  2. per mini-batch (``updates_per_rollout`` of them; the first is on-policy):
     a. totals      its normalisers (model tokens, rows with tokens, preserving tokens), summed
                    over ranks once, before its first micro-batch
     b. per micro-batch: log-probs -> loss = policy loss + KL + entropy + registered terms, each
                    a sum over the micro-batch divided by a total -> backward; gradients are
                    reduced across ranks only in the last micro-batch's backward
     c. grad norm -> step gates (may veto) -> optimiser step
  3. one scheduler step

Since every term is (sum over the micro-batch) / (mini-batch total), a mini-batch's loss is the
sum of its micro-batches' however it is cut (``micro_batch_size``, ``micro_batch_tokens``) or
spread over ranks: DDP and FSDP2 average gradients over ranks, so each rank backpropagates its
part times the world size, and 2 ranks x 2 rows give the gradient of 1 rank x 4 rows.

The update owns its interface: :class:`UpdateConfig` holds every setting it reads (typed, each
default defined once, here), and :class:`Learner` is what it needs from the model it trains
(log-probs, trainable parameters, backward, gradient sync, loss terms, step gates). GRPOModule
implements Learner and builds its UpdateConfig from its hyper-parameters once; this file imports
nothing from module.py (tests/test_import_graph.py: no import cycles).

Callbacks extend an update through two hooks registered on the module:
- loss terms, fn(LossContext) -> scalar tensor, added to the loss (LLDS is one): a sum over the
  micro-batch divided by one of ``ctx.totals``. A term must not run collectives: ranks may run
  different numbers of micro-batches (token packing under DDP);
- step gates, fn(StepContext) -> bool, after the mini-batch's backward and before the optimiser
  step: False vetoes the update (the gradient-spike guard is one).
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Literal, Mapping, Optional, Protocol, get_args, runtime_checkable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lldslight.run import hostmem
from lldslight.update import shared_prefix
from lldslight.update import objectives as obj
from lldslight.policy.distributed import all_ranks_agree, sum_over_ranks, world_size
from lldslight.errors import require
from lldslight.run.metric_rules import logged_name, over_updates, reduction
from lldslight.trajectory import Trajectory


DRIFT_PREFIX = "drift/"
# Per update, each a share of a mini-batch token mean (update.drift_shares); logged as the mean over
# the step's updates and as ``<key>_last``, the last update's.
DRIFT_PER_UPDATE = ("drift/kl_k3", "drift/kl_k1", "drift/log_ratio_m2", "drift/ratio_m2", "drift/clip_frac")

OldLogpSource = Literal["recompute", "rollout"]
MinibatchGrouping = Literal["rows", "prompts"]
ZeroGradient = Literal["step", "skip"]


@dataclass(frozen=True)
class UpdateConfig:
    """Every setting the update reads (``model.update.<field>`` in YAML; docs/configuration.md says more).

    GRPOModule takes it whole (its ``update`` argument; a field added here is a YAML key with no
    other code). Frozen: a change mid-run (Heal's remedies) goes through
    ``GRPOModule.reconfigure_update``, which also updates the hyper-parameters saved in checkpoints.
    """

    updates_per_rollout: int = 1
    """Mini-batches (optimiser updates) per rollout batch; the first is on-policy."""
    micro_batch_size: int = 4
    """Rows per forward/backward; gradients accumulate over a mini-batch."""
    micro_batch_tokens: Optional[int] = None
    """When set, micro-batches are packed by this token budget (rows x longest row) instead."""
    reuse_onpolicy_logp: bool = True
    """The on-policy mini-batch's old log-probs are its own detached log-probs (no separate pass)."""
    old_logp_source: OldLogpSource = "recompute"
    """pi_old's log-probs: a no-grad forward pass, or the sampler's own (fp32 only)."""
    clip_eps: float = 0.2
    """PPO clip epsilon, lower side."""
    clip_eps_high: Optional[float] = None
    """PPO clip epsilon, upper side (None = ``clip_eps``)."""
    ratio_clamp: Optional[float] = None
    """Cap on the importance ratio before the PPO clip (None = no cap)."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling: weight each token's policy-gradient loss by min(pi_old / q, cap),
    q the sampler's probability (``sample_logp``), for a sampler whose kernels differ from the
    trainer's (vLLM; objectives.truncated_importance_weight). None = off; TRL and veRL use 2."""
    aggregation: obj.Aggregation = "seq-mean-token-mean"
    """How token losses become a mini-batch loss (objectives.aggregate)."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's std."""
    kl_coef: float = 0.001
    """KL-to-reference coefficient; 0 skips the reference's log-probs."""
    kl_estimator: obj.KLEstimator = "k3"
    """The KL estimator (objectives.kl_penalty)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0: the entropy is a logged diagnostic only)."""
    grad_clip: float = 1.0
    """Max total gradient norm (0 = no clipping)."""
    shuffle_minibatches: bool = True
    """Shuffle rows (or groups) before splitting them into mini-batches."""
    minibatch_grouping: MinibatchGrouping = "rows"
    """Split rows, or whole prompts' groups, into mini-batches."""
    negative_advantages: obj.NegativeAdvantages = "keep"
    """A collapse-lab control on the policy gradient of rows with A < 0 (objectives.policy_gradient_weight)."""
    target_kl: Optional[float] = None
    """Drift bound: stop a rollout batch's remaining updates once a mini-batch's measured
    KL(pi_old || pi_theta) (k3, on its model tokens, before its step) passes ``target_kl_factor x
    target_kl``; that mini-batch's update is not applied (Stable-Baselines3's ``target_kl``). None = off."""
    target_kl_factor: float = 1.5
    """The early stop fires above this multiple of ``target_kl`` (1.5, as Stable-Baselines3 and Spinning Up)."""
    shared_prefix: bool = True
    """Encode a group's shared prompt once per micro-batch in every update forward (shared_prefix.py;
    the same log-probs and gradients); micro-batches keep a group's rows together."""
    frozen_prefix: bool = True
    """When only the decoder layers from L up train (LoRA's ``layers_to_transform``, or
    ``policy.freeze_bottom_layers``), compute the embeddings and layers below L once per rollout
    batch and run every later pass (old, reference, training, LLDMonitor's) from layer L
    (frozen_prefix.py; the same log-probs and gradients). No effect where every layer trains."""
    frozen_prefix_max_mb: float = 2048.0
    """The most memory the stored hidden states (rows x tokens x hidden size) may take, in MiB;
    above it every pass runs the whole decoder (said once)."""
    zero_gradient: ZeroGradient = "step"
    """An update whose gradient is exactly zero (every advantage in its mini-batch 0 and no other
    loss term: its groups all tied): ``step`` runs the optimiser step anyway, as TRL and veRL do, so
    AdamW moves the policy along its momentum (and decays its weights) with no signal; ``skip``
    leaves the weights and the optimiser state exactly as they were (``train/skipped_updates``).
    configs/stable.yaml skips: on the demo, tied batches stepped on momentum alone lost runs."""

    def __post_init__(self) -> None:
        require(self.grad_clip >= 0, "model.update.grad_clip", ">= 0 (0 = no clipping)", self.grad_clip)
        require(self.clip_eps > 0, "model.update.clip_eps", "> 0 (PPO's clip range; the paper uses 0.2)", self.clip_eps)
        require(self.clip_eps_high is None or self.clip_eps_high > 0, "model.update.clip_eps_high", "> 0 or null (= clip_eps)", self.clip_eps_high)
        require(self.kl_coef >= 0, "model.update.kl_coef", ">= 0 (0 = no KL term)", self.kl_coef)
        require(self.updates_per_rollout >= 1, "model.update.updates_per_rollout", ">= 1", self.updates_per_rollout)
        require(self.micro_batch_size >= 1, "model.update.micro_batch_size", ">= 1", self.micro_batch_size)
        require(self.micro_batch_tokens is None or self.micro_batch_tokens >= 1, "model.update.micro_batch_tokens", ">= 1 or null",
                self.micro_batch_tokens)
        # Each choice set is defined once, as a Literal: here, or in objectives.py beside the formula that takes it.
        for key, choices in (("old_logp_source", OldLogpSource), ("minibatch_grouping", MinibatchGrouping),
                             ("aggregation", obj.Aggregation), ("kl_estimator", obj.KLEstimator),
                             ("negative_advantages", obj.NegativeAdvantages), ("zero_gradient", ZeroGradient)):
            value = getattr(self, key)
            require(value in get_args(choices), f"model.update.{key}", f"one of {get_args(choices)}", value)
        require(self.target_kl is None or (math.isfinite(self.target_kl) and self.target_kl > 0), "model.update.target_kl",
                "a finite number > 0 (a KL in nats per token, e.g. 0.01-0.05) or null (no drift bound)", self.target_kl)
        require(math.isfinite(self.target_kl_factor) and self.target_kl_factor >= 1.0, "model.update.target_kl_factor",
                "a finite number >= 1 (Stable-Baselines3 uses 1.5)", self.target_kl_factor)
        require(self.frozen_prefix_max_mb >= 0 and math.isfinite(self.frozen_prefix_max_mb), "model.update.frozen_prefix_max_mb",
                "a finite number >= 0 (MiB)", self.frozen_prefix_max_mb)
        require(self.tis_cap is None or self.tis_cap >= 1.0, "model.update.tis_cap", ">= 1 (TRL and veRL use 2) or null", self.tis_cap)
        require(self.ratio_clamp is None or self.ratio_clamp > 1.0, "model.update.ratio_clamp", "> 1 (the official LLDS code uses 100) or null",
                self.ratio_clamp)


@dataclass
class Totals:
    """One mini-batch's normalisers, summed over ranks, counted once before its first micro-batch
    (a token dropped later as non-finite still counts)."""

    tokens: float  # model tokens
    rows: float  # rows with at least one model token
    preserving_tokens: float  # model tokens of rows with A >= 0 (LLDS's preserving set P)

    def for_aggregation(self, mode: obj.Aggregation) -> float:
        return self.rows if mode == "seq-mean-token-mean" else self.tokens


@dataclass
class LossContext:
    """What a loss term sees for one micro-batch. Per-token tensors are [b, T], per-row [b]."""

    logp: Tensor  # with grad; 0 where dropped as non-finite
    old_logp: Tensor
    ref_logp: Optional[Tensor]  # None when kl_coef = 0
    advantage: Tensor  # [b]
    loss_mask: Tensor  # [b, T] bool: model tokens with finite log-probs
    action_id: Tensor
    answer_mask: Tensor
    num_searches: Tensor  # [b]
    totals: Totals  # the mini-batch's normalisers (all ranks)
    mean_valid_searches: float  # V of the whole rollout batch (all ranks): LLDS-MA's beta
    update_index: int  # 0 = the on-policy mini-batch
    # Diagnostics a term records, the same keys on every rank: summed over micro-batches and ranks
    # (so record this micro-batch's share of a mini-batch value, or a count), max for "_max" keys.
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class StepContext:
    """What a step gate sees after backward, before the optimiser step."""

    module: Learner
    grad_norm: Tensor  # total pre-clip gradient norm (all ranks)
    loss: float  # this rank's part of the mini-batch loss
    update_index: int
    metrics: dict[str, float] = field(default_factory=dict)  # the same on every rank
    vetoed: bool = False  # already rejected (non-finite loss or norm, or an earlier gate)


LossTerm = Callable[[LossContext], Tensor]
StepGate = Callable[[StepContext], bool]


@runtime_checkable
class Learner(Protocol):
    """What the update needs from the model it trains (GRPOModule implements it)."""

    vetoed_updates: int  # updates vetoed so far; the update counts each veto here

    @property
    def update_config(self) -> UpdateConfig:
        """The update's settings."""

    @property
    def loss_terms(self) -> Mapping[str, LossTerm]:
        """Terms added to every micro-batch's loss, by name (LLDS is one)."""

    @property
    def step_gates(self) -> Mapping[str, StepGate]:
        """Gates that may veto an optimiser step, by name (the gradient-spike guard is one)."""

    @property
    def device(self) -> torch.device:
        """Where the trajectory's tensors and the collectives' tensors live."""

    @property
    def global_step(self) -> int:
        """The training step being trained (step gates read it)."""

    def logprobs(self, traj: Trajectory, reference: bool = False, with_entropy: bool = False) -> tuple[Tensor, Tensor]:
        """Token log-probs and entropies [b, T] of ``traj``'s rows under the policy (with grad when
        enabled) or the frozen reference; zero off model tokens."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimiser steps (their gradients are clipped and gated)."""

    def with_frozen_prefix(self, traj: Trajectory, micro: list[Tensor]) -> Trajectory:
        """``traj`` with whatever its later passes can reuse computed once (GRPOModule: the frozen
        bottom layers' output, frozen_prefix.py), in the micro-batches ``micro``; or ``traj``."""

    def manual_backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` (through the strategy: DDP, FSDP2)."""

    def gradient_sync(self, enabled: bool) -> ContextManager[None]:
        """Backward passes inside reduce gradients over ranks only when ``enabled``
        (distributed.gradient_sync)."""


@dataclass
class RolloutUpdates:
    """What one rollout batch's updates produced, for logging."""

    trajectory: Trajectory  # with advantages and old/reference log-probs
    summed: dict[str, list[float]]  # per update: this rank's share of a mini-batch value, or a count
    shared: dict[str, list[float]]  # per update: the same on every rank (grad norm, gates, veto)
    lr: float  # the learning rate the updates used
    timings: dict[str, float]

    def step_metrics(self) -> tuple[dict[str, float], set[str]]:
        """The step's values of the per-update metrics, combined over updates by
        ``metric_rules.over_updates`` (mean over the updates that recorded a finite value; sum for
        counts of non-finite values and vetoes; max for "_max" keys), named ``train/<key>`` unless a
        callback namespaced the key itself, and the names whose per-rank values add up over ranks
        (the ``summed`` channel: the default of a key metric_rules has no rule for)."""
        metrics = {"train/vetoed_updates": float(sum(self.shared.get("vetoed", [0.0])))}
        if "skipped" in self.shared:  # model.update.zero_gradient: skip
            metrics["train/skipped_updates"] = float(sum(self.shared["skipped"]))
        summed = set()
        for channel in (self.summed, self.shared):
            for k, values in channel.items():
                if k in ("vetoed", "skipped"):
                    continue
                name = logged_name(k)
                metrics[name] = _over_updates(over_updates(name), values)
                if k == "grad_norm":
                    metrics["train/grad_norm_max"] = max(values)
                if name.startswith(DRIFT_PREFIX) and name in DRIFT_PER_UPDATE:
                    # The last update's value: the drift the rollout batch ended with (the mean
                    # over updates dilutes it with the on-policy update's zero).
                    metrics[name + "_last"] = values[-1]
                    if channel is self.summed:
                        summed.add(name + "_last")
                if channel is self.summed:
                    summed.add(name)
        return metrics, summed


def _over_updates(kind: str, values: list[float]) -> float:
    """A step's value of a key from its per-update values: a sum counts every value (a non-finite
    count stays visible), the others ignore non-finite ones (NaN when none is left)."""
    if kind == "sum":
        return sum(values)
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return float("nan")
    return max(finite) if kind == "max" else min(finite) if kind == "min" else sum(finite) / len(finite)


# -- 0. the rollout batch ----------------------------------------------------------------------------


def train_on_rollout(module: Learner, traj: Trajectory, optimizer, scheduler) -> RolloutUpdates:
    cfg = module.update_config
    order = minibatch_order(traj.group_id.cpu(), cfg.shuffle_minibatches, cfg.minibatch_grouping == "prompts")
    minibatches = [m for m in torch.tensor_split(order, cfg.updates_per_rollout) if len(m)]
    hostmem.trim()  # what the rollout freed: the update's peak starts from the idle process
    t0 = time.perf_counter()
    # The frozen bottom layers' output, once for every pass of this rollout batch (frozen_prefix.py).
    traj = module.with_frozen_prefix(traj, micro_batches(module, traj, torch.arange(len(traj))))
    timings = {"frozen_prefix_s": time.perf_counter() - t0}
    traj = prepare(module, traj, onpolicy_rows=minibatches[0] if cfg.reuse_onpolicy_logp else None)
    # V for LLDS-MA: once per rollout batch, on every rank (a collective), never inside an update.
    searches = mean_valid_searches(traj) if module.loss_terms else float("nan")
    timings["logprob_s"] = time.perf_counter() - t0
    hostmem.trim()
    # Rows with a non-zero advantage, all ranks: none when every group tied (a collective every rank runs, once per step).
    advantaged = float(sum_over_ranks(torch.tensor([float((traj.advantage != 0).sum())], dtype=torch.float64, device=module.device))[0])

    t0 = time.perf_counter()
    lr = float(optimizer.param_groups[0]["lr"])  # the scheduler steps after the updates
    summed: dict[str, list[float]] = {}
    shared: dict[str, list[float]] = {}
    applied = 0
    for update_index, rows in enumerate(minibatches):
        result = update(module, traj, rows, update_index, optimizer, searches)
        if result.old_logp is not None:  # the on-policy mini-batch measured its own old log-probs
            traj = dataclasses.replace(traj, old_logp=result.old_logp, old_logp_pending=None)
        for out, part in ((summed, result.summed), (shared, result.shared)):
            for k, v in part.items():
                out.setdefault(k, []).append(v)
        if result.stopped:
            break  # the drift bound: this rollout batch has moved the policy far enough
        applied += 1
    # Every rank records the same keys: the shared channel carries the stop, the same on every rank.
    shared["drift/updates"] = [float(applied)]
    shared["drift/stopped"] = [float(applied < len(minibatches))]
    shared["drift/signal"] = [float(drift_has_signal(advantaged, len(summed.get("drift/kl_k3", [])), shared))]
    with warnings.catch_warnings():
        # A batch whose every update was vetoed or skipped (zero_gradient: skip) steps the schedule without an
        # optimiser step, on purpose: the schedule counts rollout batches. torch's warning would say otherwise.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
        scheduler.step()
    timings["update_s"] = time.perf_counter() - t0
    hostmem.trim()
    return RolloutUpdates(traj, summed, shared, lr, timings)


def drift_has_signal(advantaged_rows: float, measured: int, shared: Mapping[str, list[float]]) -> bool:
    """Whether the drift a rollout batch ended with (``drift/*_last``) measures what its updates did:
    some row had a non-zero advantage (on any rank) *and* an update before the last measured one was
    applied with a finite, non-zero gradient norm. Otherwise the batch carries no information about
    the rate: when every group tied, the policy gradient is zero and the policy moves only by the
    optimiser's momentum and weight decay; with one update per rollout batch (or every earlier update
    vetoed) the last KL is measured before any step. Logged as ``drift/signal``; AdaptiveRate and the
    target's calibration leave such batches out.

    ``measured``: updates whose KL was measured (applied, plus the one the drift bound stopped);
    ``shared``: the per-update shared channel, ``grad_norm`` and ``vetoed`` for the updates that stepped."""
    norms, vetoed = shared.get("grad_norm", []), shared.get("vetoed", [])
    before_last = zip(norms[: max(measured - 1, 0)], vetoed[: max(measured - 1, 0)])
    moved = any(math.isfinite(norm) and norm > 0 and not veto for norm, veto in before_last)
    return advantaged_rows > 0 and moved


def minibatch_order(group_id: Tensor, shuffle: bool, by_prompt: bool) -> Tensor:
    """The order rows are split into mini-batches in: shuffled rows, or whole groups shuffled
    with each group's rows kept contiguous (``minibatch_grouping: prompts``)."""
    if not by_prompt:
        return torch.randperm(len(group_id)) if shuffle else torch.arange(len(group_id))
    groups = torch.unique(group_id)  # sorted; one draw per group keeps the RNG use small
    groups = groups[torch.randperm(len(groups))] if shuffle else groups
    return torch.cat([(group_id == g).nonzero()[:, 0] for g in groups.tolist()])


# -- 1. prepare: advantages, old and reference log-probs ---------------------------------------------


def prepare(module: Learner, traj: Trajectory, onpolicy_rows: Optional[Tensor] = None) -> Trajectory:
    """A copy of ``traj`` with group advantages and old and reference log-probs.

    ``onpolicy_rows``: rows of the first (on-policy) mini-batch: its update runs on the weights
    that sampled them, so its own log-probs, detached, are the old ones (``reuse_onpolicy_logp``).
    They are marked in ``old_logp_pending`` and left at zero here.
    """
    cfg = module.update_config
    pending = torch.zeros(len(traj), dtype=torch.bool)
    if onpolicy_rows is not None:
        pending[onpolicy_rows] = True
    if cfg.old_logp_source == "rollout" and traj.sample_logp is not None:
        # The sampler's own log-probs (same weights, same temperature): no extra forward pass.
        old_logp = traj.sample_logp
        pending[:] = False
    else:
        old_logp = batch_logprobs(module, traj, reference=False, rows=(~pending).nonzero()[:, 0])
    advantage = obj.group_advantages(traj.reward, traj.group_id, normalize_std=cfg.normalize_adv_std)
    negatives = cfg.negative_advantages
    shared = None
    if negatives == "unshared":
        shared = obj.shared_prefix_negatives(traj.input_ids, traj.attention_mask, traj.loss_mask, traj.group_id, advantage)
    return dataclasses.replace(
        traj,
        advantage=advantage,
        pg_weight=obj.policy_gradient_weight(advantage, traj.loss_mask, negatives, shared),
        old_logp=old_logp,
        ref_logp=batch_logprobs(module, traj, reference=True) if cfg.kl_coef > 0 else None,
        old_logp_pending=pending.to(traj.input_ids.device) if bool(pending.any()) else None,
    )


@torch.no_grad()
def batch_logprobs(module: Learner, traj: Trajectory, reference: bool = False, rows: Optional[Tensor] = None) -> Tensor:
    """Log-probs [B, T] of ``rows`` (default: all) under the policy or the reference, zero elsewhere."""
    out = torch.zeros(traj.input_ids.shape, dtype=torch.float32, device=traj.input_ids.device)
    rows = torch.arange(len(traj)) if rows is None else rows
    for idx in micro_batches(module, traj, rows):
        logp, _ = module.logprobs(traj.select(idx), reference=reference)
        out = out.to(logp.dtype)  # float64 for a float64 model (tests), else a no-op
        out[idx.to(out.device), : logp.shape[1]] = logp
    return out


def mean_valid_searches(traj: Trajectory) -> float:
    """V: valid searches per trajectory over the rollout batch of all ranks."""
    stats = torch.tensor([float(traj.num_searches.sum()), float(len(traj))], dtype=torch.float64, device=traj.input_ids.device)
    stats = sum_over_ranks(stats)
    return float(stats[0] / stats[1].clamp(min=1.0))


# -- 2. one mini-batch: totals, micro-batches, gates, optimiser step ---------------------------------


@dataclass
class _Update:
    summed: dict[str, float]
    shared: dict[str, float]
    old_logp: Optional[Tensor]  # the rollout batch's old log-probs with the pending rows filled in
    stopped: bool = False  # the drift bound stopped the rollout batch here; this update was not applied


def micro_batches(module: Learner, traj: Trajectory, rows: Tensor) -> list[Tensor]:
    """Split ``rows`` into micro-batches: ``micro_batch_size`` rows each, or packed by
    ``micro_batch_tokens`` (sorted by length, so rows of similar length share a batch; as many per
    micro-batch as fit in rows x longest row <= budget, a longer row alone). With ``shared_prefix``
    a group's rows are kept together (shared_prefix.micro_batches)."""
    cfg = module.update_config
    budget = cfg.micro_batch_tokens
    if cfg.shared_prefix and shared_prefix.supported(getattr(module, "policy", None)):
        return shared_prefix.micro_batches(traj.input_ids, traj.attention_mask, traj.group_id, rows, cfg.micro_batch_size, budget)
    if not budget:
        return [rows[i : i + cfg.micro_batch_size] for i in range(0, len(rows), cfg.micro_batch_size)]
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


def mini_batch_totals(traj: Trajectory, rows: Tensor) -> Totals:
    mask = traj.loss_mask[rows.to(traj.loss_mask.device)]  # [m, T]
    tokens = mask.sum(-1)  # [m]
    preserving = traj.advantage[rows.to(traj.advantage.device)] >= 0  # [m]
    local = torch.stack([tokens.sum(), (tokens > 0).sum(), tokens[preserving].sum()]).to(torch.float64)
    return Totals(*sum_over_ranks(local).tolist())


def update(module: Learner, traj: Trajectory, rows: Tensor, update_index: int, optimizer, searches: float) -> _Update:
    """One optimiser update on the mini-batch ``rows`` of ``traj``."""
    optimizer.zero_grad(set_to_none=True)
    totals = mini_batch_totals(traj, rows)
    scale = float(world_size())  # DDP / FSDP2 average gradients over ranks; the loss is a sum over them
    micro = micro_batches(module, traj, rows)
    summed: dict[str, Tensor | float] = {}
    filled: list[tuple[Tensor, Tensor]] = []
    loss_ok = True
    for i, idx in enumerate(micro):
        sub = traj.select(idx)
        logp, entropy = module.logprobs(sub, with_entropy=True)
        if sub.old_logp_pending is not None and bool(sub.old_logp_pending.any()):
            if update_index != 0 or not bool(sub.old_logp_pending.all()):
                raise RuntimeError("old log-probs were deferred for rows outside the first mini-batch")
            # No optimiser step since sampling: the current log-probs are the old ones (ratio 1).
            sub = dataclasses.replace(sub, old_logp=logp.detach().masked_fill(~sub.loss_mask, 0.0))
            filled.append((idx, sub.old_logp))
        loss, stats = micro_batch_loss(module, sub, logp, entropy, totals, searches, update_index)
        if update_index == 0 and sub.sample_logp is not None:
            stats.update(logp_mismatch(sub.sample_logp, logp.detach(), sub.loss_mask, totals.tokens))
        with module.gradient_sync(enabled=i == len(micro) - 1):
            if bool(torch.isfinite(loss)):
                module.manual_backward(loss * scale)
            else:
                loss_ok = False  # never backpropagate a NaN: it would poison every gradient
                stats["nonfinite_loss"] = 1.0
                if world_size() > 1:
                    # The other ranks' backward takes part in collectives with this one's (FSDP2
                    # gathers weights in every backward; gradients are reduced in the last): join
                    # them with a zero gradient. The update is then vetoed on every rank.
                    module.manual_backward(logp.sum() * 0.0)
        for k, v in stats.items():  # shares and counts add up over micro-batches, maxima stay maxima (metric_rules)
            summed[k] = v if k not in summed else _combine(reduction(logged_name(k), default="sum"), summed[k], v)
    stopped = drift_bound_passed(module.update_config, summed, update_index, module.device)
    if stopped:
        # Measured, not applied: the gradient of a mini-batch beyond the bound is dropped, as
        # Stable-Baselines3 stops before the step whose KL passed its target.
        optimizer.zero_grad(set_to_none=True)
        shared = {}
    else:
        shared = step(module, optimizer, update_index, loss_ok, float(summed.get("loss", float("nan"))))
    old_logp = None
    if filled:
        old_logp = traj.old_logp.clone()
        for idx, values in filled:
            old_logp[idx.to(old_logp.device), : values.shape[1]] = values
    return _Update({k: float(v) for k, v in summed.items()}, shared, old_logp, stopped)


def drift_bound_passed(cfg: UpdateConfig, summed: Mapping[str, Tensor | float], update_index: int, device) -> bool:
    """Whether this mini-batch's KL(pi_old || pi_theta), measured before its step, passes the drift
    bound (``target_kl_factor x target_kl``). The on-policy first update is never stopped (its KL
    is the sampler/trainer mismatch, not drift). The KL is this rank's share: summed over ranks
    here (a collective every rank runs, once per update) so that every rank decides alike."""
    if cfg.target_kl is None or update_index == 0:
        return False
    share = torch.tensor([float(summed.get("drift/kl_k3", 0.0))], dtype=torch.float64, device=device)
    return float(sum_over_ranks(share)[0]) > cfg.target_kl_factor * cfg.target_kl


def _combine(kind: str, a: Tensor | float, b: Tensor | float) -> Tensor | float:
    """Two micro-batches' values of one key: the rows of a mini-batch are split over micro-batches
    as over ranks, so by the key's across-ranks rule (a share or count adds up)."""
    if kind == "max":
        return max(float(a), float(b))
    if kind == "min":
        return min(float(a), float(b))
    return a + b


def log_ratio(new: Tensor, old: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per token log r = log new - log old [b, T] in float64 (k3 ~ (log r)^2 / 2 for tiny log r is below
    float32's resolution), 0 off ``mask`` and where either side is not finite; and where it is defined."""
    ok = mask & torch.isfinite(new) & torch.isfinite(old)
    return torch.where(ok, new.double() - old.double(), 0.0), ok


def logp_mismatch(sampler: Tensor, trainer: Tensor, mask: Tensor, tokens: float) -> dict[str, Tensor]:
    """The sampler/trainer mismatch on the on-policy mini-batch (docs/precision.md), this
    micro-batch's share: sums over its model tokens divided by the mini-batch's ``tokens``, so
    the shares add up (over micro-batches and ranks) to means over the mini-batch.

    The trainer's log-probs are those of the mini-batch's first forward: the weights that sampled,
    so no extra forward. ``rollout/logp_mismatch``: mean |log q - log p| in nats per token, q the
    sampler, p the trainer. ``rollout/logp_mismatch_kl``: the k3 estimator of KL(q || p) on
    tokens drawn from q, (r - 1) - log r with r = p / q, unbiased and >= 0 for every token."""
    d, _ = log_ratio(trainer, sampler, mask)
    n = max(tokens, 1.0)
    return {"rollout/logp_mismatch": d.abs().sum() / n, "rollout/logp_mismatch_kl": (torch.expm1(d) - d).sum() / n}


def drift_shares(logp: Tensor, old_logp: Tensor, mask: Tensor, tokens: float) -> dict[str, Tensor]:
    """How far pi_theta has moved from pi_old on these rows' model tokens, before the step: this
    micro-batch's share of each mini-batch token mean (sums over its tokens divided by the
    mini-batch's ``tokens``, so shares add up over micro-batches and ranks).

    With log r = log pi_theta - log pi_old per token (tokens drawn from pi_old):
    - ``drift/kl_k1``: mean of -log r, the plain estimator of KL(pi_old || pi_theta) (unbiased, may
      be negative on a mini-batch);
    - ``drift/kl_k3``: mean of (r - 1) - log r, Schulman's k3 estimator of the same KL (unbiased,
      >= 0 token by token; the one the drift bound reads);
    - ``drift/log_ratio_m2``: mean of (log r)^2, M2PO's second moment of the log-ratio;
    - ``drift/ratio_m2``: mean of r^2, the second moment of the importance ratio itself
      (1 + the chi-square divergence; it explodes first when a token's ratio does)."""
    d, ok = log_ratio(logp, old_logp, mask)
    n = max(tokens, 1.0)
    return {
        "drift/kl_k3": (torch.expm1(d) - d).sum() / n,
        "drift/kl_k1": (-d).sum() / n,
        "drift/log_ratio_m2": d.square().sum() / n,
        "drift/ratio_m2": torch.where(ok, torch.exp(2 * d), 0.0).sum() / n,
    }


def micro_batch_loss(
    module: Learner, sub: Trajectory, logp: Tensor, entropy: Tensor, totals: Totals, searches: float, update_index: int
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """The micro-batch's part of the mini-batch loss: policy loss + KL + entropy bonus + the
    registered terms, each (sum over these rows) / a mini-batch total. Returns (loss, diagnostics)."""
    cfg = module.update_config
    mask, old_logp, ref_logp = sub.loss_mask, sub.old_logp, sub.ref_logp
    finite = torch.isfinite(logp) & torch.isfinite(old_logp)
    if ref_logp is not None:
        finite = finite & torch.isfinite(ref_logp)
    nonfinite = (mask & ~finite).sum()
    if not bool(finite.all()):
        # Drop non-finite positions from every operand, not just the mask: 0 * NaN is NaN.
        mask = mask & finite
        logp, old_logp = logp.masked_fill(~finite, 0.0), old_logp.masked_fill(~finite, 0.0)
        ref_logp = ref_logp.masked_fill(~finite, 0.0) if ref_logp is not None else None
    n = totals.for_aggregation(cfg.aggregation)
    tokens = max(totals.tokens, 1.0)

    pg, ratio, clipped = obj.clipped_surrogate(
        logp, old_logp, sub.advantage, cfg.clip_eps, cfg.clip_eps_high, cfg.ratio_clamp
    )
    drift = drift_shares(logp.detach(), old_logp, mask, tokens)
    drift["drift/clip_frac"] = (clipped & mask).sum() / tokens
    if sub.pg_weight is not None:
        pg = pg * sub.pg_weight  # a negative-gradient control: the weight changes the gradient, not the normaliser
    if cfg.tis_cap is not None and sub.sample_logp is not None:
        pg = pg * obj.truncated_importance_weight(old_logp, sub.sample_logp, cfg.tis_cap)
    pg_loss = obj.aggregate(pg, mask, cfg.aggregation, n)
    loss = pg_loss
    stats: dict[str, Tensor | float] = {
        "pg_loss": pg_loss.detach(),
        "clip_frac": (clipped & mask).sum() / tokens,
        "entropy": (entropy.detach() * mask).sum() / tokens,  # token mean whatever the aggregation
        "ratio_max": ratio.detach().masked_fill(~mask, 0.0).max() if bool(mask.any()) else 1.0,
        "nonfinite_tokens": nonfinite,
        "nonfinite_loss": 0.0,  # set by update(): every rank logs the same keys
        **drift,
    }
    if cfg.kl_coef > 0:
        kl = obj.aggregate(obj.kl_penalty(logp, ref_logp, cfg.kl_estimator), mask, cfg.aggregation, n)
        loss = loss + cfg.kl_coef * kl
        stats["kl"] = kl.detach()
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * obj.aggregate(entropy, mask, cfg.aggregation, n)
    if module.loss_terms:
        ctx = LossContext(
            logp=logp, old_logp=old_logp, ref_logp=ref_logp, advantage=sub.advantage, loss_mask=mask,
            action_id=sub.action_id, answer_mask=sub.answer_mask, num_searches=sub.num_searches,
            totals=totals, mean_valid_searches=searches, update_index=update_index,
        )
        for fn in module.loss_terms.values():
            loss = loss + fn(ctx)
        stats.update(ctx.metrics)
    stats["loss"] = loss.detach()
    return loss, stats


def step(module: Learner, optimizer, update_index: int, loss_ok: bool, loss: float) -> dict[str, float]:
    """Gradient norm, step gates, then the optimiser step, or a veto that changes nothing."""
    params = module.trainable_parameters()
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()  # FSDP2: already global (Replicate); gates get a plain tensor
    loss_ok = all_ranks_agree(loss_ok, module.device)  # gates must see the same inputs on every rank
    ctx = StepContext(module=module, grad_norm=grad_norm, loss=loss, update_index=update_index)
    ctx.vetoed = not (loss_ok and bool(torch.isfinite(grad_norm)))
    for gate in module.step_gates.values():
        # Every gate sees every update (a guard counts consecutive vetoes); none can undo a veto.
        if not gate(ctx):
            ctx.vetoed = True
    accept = all_ranks_agree(not ctx.vetoed, module.device)  # one rank stepping alone splits the replicas
    # No gradient, no step (zero_gradient: skip): the norm is global (reduced over ranks), so every rank skips alike.
    skip = accept and module.update_config.zero_gradient == "skip" and float(grad_norm) == 0.0
    if accept and not skip:
        if module.update_config.grad_clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, module.update_config.grad_clip, ctx.grad_norm)
        optimizer.step()
    else:
        # A vetoed or skipped update leaves weights and optimiser state exactly as they were.
        optimizer.zero_grad(set_to_none=True)
        if not accept:
            module.vetoed_updates += 1
    out = {**ctx.metrics, "grad_norm": float(grad_norm), "vetoed": 0.0 if accept else 1.0}
    if module.update_config.zero_gradient == "skip":
        out["skipped"] = float(skip)
    return out
