"""The update path: what one rollout batch's updates do, and everything only they use.

- train.py: ``train_on_rollout``, the loop (advantages, pi_old's and the reference's log-probs,
  micro-batches, the optimiser step), read top to bottom; UpdateConfig and the hooks' contracts
  (Learner, LossContext, StepContext, LossTerm, StepGate);
- objectives.py: the formulas (advantages, the clipped surrogate, KL estimators, aggregation);
- logprobs.py: token log-probs of a batch, chunked so the full vocabulary is never held twice;
- shared_prefix.py: a group's shared prompt encoded once;
- frozen_prefix.py: the frozen bottom layers run once per rollout batch;
- optim.py: OptimConfig, the optimiser and its schedule, ``set_learning_rate``.

Names are imported on first use (PEP 562): ``from lldslight.update import UpdateConfig`` works,
and ``import lldslight.update.objectives`` (the science imports the formulas) loads neither the
loop nor Lightning. Inside lldslight, code imports the module that defines a name.
"""
from __future__ import annotations

from lldslight.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(
    ["Learner", "LossContext", "LossTerm", "StepContext", "StepGate", "UpdateConfig", "train_on_rollout"], "train"))
