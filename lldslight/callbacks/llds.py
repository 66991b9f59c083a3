"""LLDS: adds lambda * L_LLDS to the GRPO loss (docs/llds.md), as a callback composed in YAML.

The formula is ``objectives.llds_penalty``; this file chooses its options, turns the rollout
batch's V (computed once per rollout batch by update/train.py, over all ranks) into the LLDS-MA answer
weight, registers the loss term and logs its diagnostics. "Official code" below is the authors'
github.com/vengdeng/LLDS-On-Group-Relative-Policy-Optimization-Collapse-in-Search-R1
(verl/workers/actor/dp_actor.py).
"""
from __future__ import annotations

from typing import Literal, Optional, Union, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lldslight.update import objectives as obj
from lldslight.errors import ConfigError, require

AnswerMasking = Literal["off", "fixed", obj.BetaRule]  # off, a fixed beta, or a beta rule of objectives.py


class LLDS(pl.Callback):
    """Lazy-likelihood-displacement shrinkage: pull preserved responses' tokens back to pi_old.

    Args:
        coef: lambda, the weight of L_LLDS in the loss (paper: 0.2; 0.3 for Qwen2.5-7B-Instruct).
        gate: "action" (paper's best: an action's tokens count when the action's total
            log-likelihood fell), "response" (the same over the whole response) or "token" (no gate).
        normaliser: "preserving" (paper: divide by the model tokens of the mini-batch's responses
            with A >= 0) or "all" (official code: by every model
            token of the mini-batch; there it is a micro-batch mean).
        answer_masking: LLDS-MA, the weight beta of the final <answer> span's tokens: "off" (1),
            "fixed" (``answer_beta``), "paper" (min(V/2, 1), paper §LLDS-MA) or "official" (the
            official code's ``mask_adaptive``: answer tokens get min(answer_coef * max(V-1, 0), coef)
            instead of coef), with V the mean number of valid searches per trajectory of the
            rollout batch (all ranks). YAML reads a bare ``off`` as false, which is accepted as "off".
        answer_beta: the weight used by answer_masking="fixed".
        answer_coef: lambda_ans of answer_masking="official" (the official code's
            ``answer_no_reduce_lambda``); None = ``coef``, which makes beta = clip(V-1, 0, 1).
        skip_on_policy: skip the first update of each rollout batch. It is on-policy, so the term is
            zero in exact arithmetic, but the separately computed old log-probs differ from the
            current ones by float noise, which would open gates at random and apply a full
            -grad log p pull on about half of the preserved tokens. False computes it anyway (the
            official code's behaviour).
    """

    def __init__(
        self,
        coef: float = 0.2,
        gate: obj.LLDSGate = "action",
        normaliser: obj.LLDSNormaliser = "preserving",
        answer_masking: Union[AnswerMasking, bool] = "off",
        answer_beta: float = 1.0,
        answer_coef: Optional[float] = None,
        skip_on_policy: bool = True,
    ) -> None:
        require(coef >= 0, "LLDS.coef", ">= 0", coef)
        # The choice sets are objectives.py's (the formulas that take them) and AnswerMasking above.
        require(gate in get_args(obj.LLDSGate), "LLDS.gate", f"one of {get_args(obj.LLDSGate)}", gate)
        require(normaliser in get_args(obj.LLDSNormaliser), "LLDS.normaliser", f"one of {get_args(obj.LLDSNormaliser)}", normaliser)
        if answer_masking is False:
            answer_masking = "off"
        masking = tuple(m for m in get_args(AnswerMasking) if m != "off")
        require(answer_masking is not True, "LLDS.answer_masking", f"one of {masking} (or 'off')", answer_masking,
                "true is ambiguous")
        require(answer_masking in get_args(AnswerMasking), "LLDS.answer_masking", f"one of {get_args(AnswerMasking)}", answer_masking)
        require(0.0 <= answer_beta <= 1.0, "LLDS.answer_beta", "in [0, 1]", answer_beta)
        require(answer_coef is None or answer_coef >= 0, "LLDS.answer_coef", ">= 0 or null", answer_coef)
        self.coef = coef
        self.gate = gate
        self.normaliser = normaliser
        self.answer_masking = answer_masking
        self.answer_beta = answer_beta
        self.answer_coef = answer_coef
        self.skip_on_policy = skip_on_policy
        self.last_beta: Optional[float] = None  # the beta of the last rollout batch the term ran on

    # -- wiring -------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require(hasattr(pl_module, "add_loss_term"), "model (for LLDS)", "a module with add_loss_term (GRPOModule)",
                type(pl_module).__name__)
        existing = getattr(pl_module, "loss_terms", {}).get("llds")
        if existing is not None and getattr(existing, "__self__", None) is not self:
            raise ConfigError(
                "two LLDS callbacks in trainer.callbacks: compose only one of configs/llds*.yaml "
                "(each appends its own LLDS callback)"
            )
        pl_module.add_loss_term("llds", self.loss_term)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        updates = pl_module.update_config.updates_per_rollout
        if updates == 1:
            rank_zero_warn(
                "LLDS is on but model.update.updates_per_rollout=1: every update is on-policy, so L_LLDS is "
                "identically zero and LLDS does nothing. Set model.update.updates_per_rollout >= 2 "
                "(the paper's recipe has 10 mini-batch updates per rollout batch)."
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.last_beta = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.last_beta is not None:  # one value per rollout batch, the same on every rank
            pl_module.log("llds/beta", self.last_beta, on_step=True, on_epoch=False, batch_size=1)

    # -- the term -------------------------------------------------------------------------------------

    def beta(self, mean_valid_searches: float) -> float:
        """The answer-span weight for a rollout batch with V = ``mean_valid_searches`` (1.0 when off)."""
        if self.answer_masking == "off":
            return 1.0
        if self.answer_masking == "fixed":
            return self.answer_beta
        return obj.answer_weight_beta(mean_valid_searches, self.answer_masking, self.coef, self.answer_coef)

    def loss_term(self, ctx) -> Tensor:
        if self.skip_on_policy and ctx.update_index == 0:
            return ctx.logp.new_zeros(())
        beta = self.last_beta = self.beta(ctx.mean_valid_searches)
        weight = None
        if beta != 1.0:
            weight = torch.ones_like(ctx.logp, requires_grad=False).masked_fill(ctx.answer_mask.bool(), beta)
        n = ctx.totals.preserving_tokens if self.normaliser == "preserving" else ctx.totals.tokens
        loss, diag = obj.llds_penalty(
            ctx.logp, ctx.old_logp, ctx.advantage, ctx.loss_mask, ctx.action_id, n, gate=self.gate, token_weight=weight
        )
        # This micro-batch's share of the mini-batch's L_LLDS, and counts: both add up.
        ctx.metrics["llds/loss"] = float(loss.detach())
        ctx.metrics["llds/active_actions"] = float(diag["active_actions"])
        ctx.metrics["llds/active_tokens"] = float(diag["active_tokens"])
        return self.coef * loss
