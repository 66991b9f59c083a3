"""The generation seam: what a rollout backend receives and must return.

SearchRollout (lldslight/callbacks/rollout.py) builds its backend from a factory, named in YAML by
``class_path`` as LightningCLI takes an optimizer: a class whose first four parameters are
``(tokenizer, retriever, reward_fn, config)`` and whose other parameters are the ``init_args``::

    trainer:
      callbacks:
        - class_path: lldslight.callbacks.SearchRollout
          init_args:
            backend: lldslight.rollout.HFGenerate      # default: lldslight.rollout.RolloutEngine

Three backends ship: :class:`~lldslight.rollout.RolloutEngine` (engine.py; continuous batching over a
ragged KV cache, the default), :class:`~lldslight.rollout.HFGenerate` (hf_generate.py;
transformers' ``generate``, one rollout and one turn per call: the reference the engine is tested
against, and the fallback for a model whose attention the engine's cache cannot serve) and
:class:`~lldslight.rollout.VLLMGenerate` (vllm_generate.py; a vLLM server or ``vllm.LLM``, the LoRA
adapter pushed after every update). All play the protocol through rollout/episode.py, so their
greedy outputs are the same tokens. docs/generation_backends.md says when to use which.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

from torch import nn

from lldslight.data.example import QAExample
from lldslight.retrieval.base import Retriever
from lldslight.rewards import RewardFn
from lldslight.trajectory import Trajectory

from .engine import RolloutConfig


@runtime_checkable
class GenerationBackend(Protocol):
    """A rollout backend. Built once per sampling setting (training, evaluation) by
    ``factory(tokenizer, retriever, reward_fn, config)``, then called before every step.

    Optionally it keeps ``stats``, a dict of seconds and counts of the last ``generate`` call:
    SearchRollout logs its ``retrieval_s`` as ``time/retrieval_s`` (0 without it). (An attribute
    is not part of the Protocol: a Protocol with one cannot be checked with issubclass, which is
    how a ``class_path`` is checked against it.)

    Two optional methods let SearchRollout guard it (docs/guards.md), both shipped backends have
    them, and a backend without them is run unchecked (one warning for the second):

    - ``sampling_settings(greedy=None) -> SamplingSettings`` (settings.py): what it samples with,
      printed when training starts and refused when it differs from the config;
    - ``probe_logprob(model, ids) -> float``: the summed log-prob of ``ids[1:]`` through its own
      sampling path with the weights it samples from now; after every training step it must
      change when the policy's did (sync.py)."""

    def generate(self, model: nn.Module, examples: list[QAExample], group_size: Optional[int] = None,
                 greedy: Optional[bool] = None) -> Trajectory:
        """Sample ``group_size`` (default ``config.group_size``) rollouts of each example with the
        current weights of ``model`` (greedy: argmax, as evaluation does), and return them scored.

        The Trajectory must hold, per rollout in example order (G consecutive rows per example):
        the token ids exactly as sampled (never re-tokenised; ``loss_mask`` and ``action_id`` on
        them), observations tokenised by rollout/protocol.py, ``group_id`` from the example,
        ``sample_logp`` [B, T]: the sampler's log-probability of each sampled token under the
        temperature-scaled distribution (before top-k/top-p), 0 elsewhere (``model.update.
        old_logp_source: rollout`` trains on it, ``rollout/logp_mismatch`` compares it with the
        trainer's), and the reward, EM/F1 and turns: build it with
        ``rollout.episode.EpisodeRules.to_trajectory`` and it holds all of them."""


BackendFactory = Callable[[Any, Retriever, RewardFn, RolloutConfig], GenerationBackend]
"""What SearchRollout's ``backend`` is: a GenerationBackend class (or any callable) taking
``(tokenizer, retriever, reward_fn, config)``."""
