"""LLDProbe: a single-step likelihood-displacement probe (the paper's Fig. 3a), every N steps.

From the current weights: sample G rollouts of a fixed set of training questions, keep the groups
whose rewards differ (mixed groups: both A > 0 and A < 0 rollouts), take ONE plain GRPO gradient
step of fixed length on them, and measure, per mixed group, whether its correct (A > 0) responses
lost log-likelihood (Delta = mean over their model tokens of log pi_after - log pi_before < 0).
Then the weights, gradients and every random stream are put back exactly: training is untouched.

Why a probe: the run's own Delta (lld/delta_correct) depends on the learning-rate schedule, on
AdamW's moments and on LLDS, which optimises exactly that quantity. The probe's step does not:
it is the unit-norm on-policy GRPO gradient (the policy-gradient term at ratio 1, the module's
aggregation and advantage normalisation) scaled to ``step_norm`` in weight space, so its sign
pattern measures how the current weights respond to GRPO's own signal; LLDS is not in it.

Logged (at the steps it runs; empty elsewhere): probe/lld_share (share of mixed groups whose
correct responses lost likelihood), probe/delta_correct (mean of the groups' Delta, nats/token),
probe/mixed_groups (how many groups were mixed), probe/reward (mean reward of the probe's rollouts).
"""
from __future__ import annotations

import random
from typing import Optional

import lightning.pytorch as pl
import numpy as np
import torch

from lldslight.update import objectives as obj
from lldslight.errors import ConfigError, require
from lldslight.run.events import log_event


class LLDProbe(pl.Callback):
    """Args:
        every_n_steps: probe after every N training steps (and never during the first N).
        questions: the first N training questions (a fixed set, so probes are comparable).
        group_size: rollouts per question (None = the rollout callback's group size).
        step_norm: L2 length of the probe step over the trainable weights.
        seed: the probe's sampling seed (the same rollouts for the same weights).
    """

    def __init__(self, every_n_steps: int = 50, questions: int = 32, group_size: Optional[int] = None, step_norm: float = 0.1,
                 seed: int = 1234) -> None:
        require(every_n_steps >= 1, "LLDProbe.every_n_steps", ">= 1", every_n_steps)
        require(questions >= 1, "LLDProbe.questions", ">= 1", questions)
        require(group_size is None or group_size >= 2, "LLDProbe.group_size", ">= 2 or null", group_size)
        require(step_norm > 0, "LLDProbe.step_norm", "> 0", step_norm)
        self.every_n_steps = every_n_steps
        self.questions = questions
        self.group_size = group_size
        self.step_norm = step_norm
        self.seed = seed
        self.results: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps:
            return
        from lldslight.callbacks.rollout import SearchRollout

        rollout = next((c for c in trainer.callbacks if isinstance(c, SearchRollout)), None)
        datamodule = trainer.datamodule
        if rollout is None or datamodule is None or not getattr(datamodule, "train_examples", None):
            raise ConfigError("LLDProbe needs a SearchRollout callback and a datamodule with train_examples (SearchQADataModule)")
        examples = datamodule.train_examples[: self.questions]
        result = self.probe(pl_module, rollout.train_engine(pl_module), examples)
        result["step"] = step
        self.results.append(result)
        # the row of the step just trained (global_step already counts it)
        log_event(trainer, {f"probe/{k}": float(v) for k, v in result.items() if k != "step"}, step - 1)

    @torch.no_grad()
    def _logp(self, module, traj) -> torch.Tensor:
        return module.batch_logprobs(traj)

    def probe(self, module, engine, examples) -> dict:
        """One probe from the module's current weights; everything restored afterwards."""
        states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        params = module.trainable_parameters()
        saved = [p.detach().clone() for p in params]
        grads = [p.grad for p in params]
        try:
            torch.manual_seed(self.seed)
            traj = engine.generate(module.policy, examples, group_size=self.group_size)
            cfg = module.update_config
            adv = obj.group_advantages(traj.reward, traj.group_id, normalize_std=cfg.normalize_adv_std).to(traj.input_ids.device)
            mixed = [g for g in torch.unique(traj.group_id).tolist()
                     if bool((adv[traj.group_id == g] > 0).any()) and bool((adv[traj.group_id == g] < 0).any())]
            out = {"mixed_groups": len(mixed), "reward": float(traj.reward.mean())}
            if not mixed:
                return {**out, "lld_share": float("nan"), "delta_correct": float("nan")}
            rows = torch.cat([(traj.group_id == g).nonzero()[:, 0] for g in mixed])
            sub = traj.select(rows)
            sub.advantage = adv[rows.to(adv.device)]
            before = self._logp(module, sub)
            for p in params:
                p.grad = None
            # The on-policy GRPO gradient: ratio 1, so the clipped surrogate's gradient is -A grad log pi.
            mask = sub.loss_mask
            n = float(mask.any(-1).sum()) if cfg.aggregation == "seq-mean-token-mean" else float(mask.sum())
            logp, _ = module.logprobs(sub)
            pg, _, _ = obj.clipped_surrogate(logp, before.to(logp.dtype), sub.advantage.to(logp.dtype))
            obj.aggregate(pg, mask, cfg.aggregation, max(n, 1.0)).backward()
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
            with torch.no_grad():
                for p in params:
                    if p.grad is not None and norm > 0:
                        p.sub_(p.grad * (self.step_norm / norm).to(p.dtype))
            after = self._logp(module, sub)
            deltas = []
            for g in mixed:
                pos = (sub.group_id == g) & (sub.advantage > 0)
                m = mask & pos.unsqueeze(-1)
                deltas.append(float(((after - before) * m).sum() / m.sum().clamp(min=1)))
            return {**out, "lld_share": sum(d < 0 for d in deltas) / len(deltas), "delta_correct": sum(deltas) / len(deltas)}
        finally:
            with torch.no_grad():
                for p, value, grad in zip(params, saved, grads):
                    p.copy_(value)
                    p.grad = grad
            torch.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])

    def state_dict(self) -> dict:
        return {"results": list(self.results)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.results = list(state_dict.get("results", []))
