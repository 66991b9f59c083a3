"""The reference generation backend: transformers' ``model.generate``, one rollout at a time and one
turn per call, with the search between turns.

Plain on purpose. Each turn re-encodes the rollout's whole context (prompt, earlier turns and
observations) and decodes with transformers' own cache and sampling, so it shares nothing with the
engine's ragged cache, scheduler or sampler (engine.py) except the protocol's rules
(episode.py): a test asserts the two give the same tokens greedily. It is also the fallback for a
model whose attention the engine's cache cannot serve (any model ``generate`` runs), at the cost of
speed: no batching across rollouts, no cache across turns.

Sampling (not greedy) uses transformers' sampler and torch's global random stream: the same seed
gives the same rollouts from this backend, but not the engine's (which draws one uniform per token
from each rollout's own stream). The sampler's log-probs are those of the temperature-scaled
distribution before top-k/top-p, as the engine's.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from lldslight.data.example import QAExample
from lldslight.policy.sampling import sampling_weights
from lldslight.retrieval.base import Retriever
from lldslight.rewards import RewardFn
from lldslight.trajectory import Trajectory

from .engine import RolloutConfig
from .episode import Episode, EpisodeRules
from .layout import Layout
from .protocol import prompt_token_ids
from .settings import SamplingSettings, processed_scores_mismatch, without_generation_config
from .sync import summed_logprob


class _TurnStop(StoppingCriteria):
    """Ends ``generate`` where the protocol ends a turn (EpisodeRules.turn_stops, the engine's rule)."""

    def __init__(self, rules: EpisodeRules, ep: Episode, context: int) -> None:
        self.rules, self.ep, self.context = rules, ep, context

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.ep.turn = input_ids[0, self.context:].tolist()
        stop = bool(self.ep.turn) and self.rules.turn_stops(self.ep, self.ep.turn[-1])
        return torch.tensor([stop], dtype=torch.bool, device=input_ids.device)


class HFGenerate:
    """Samples Search-R1 trajectories with ``model.generate`` (a GenerationBackend; backend.py).

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        retriever: any object with ``search(queries, k) -> list[list[Passage]]``.
        reward_fn: the reward (rewards.RewardFn).
        config: sampling settings (rollout.RolloutConfig).
    """

    def __init__(self, tokenizer, retriever: Retriever, reward_fn: RewardFn, config: RolloutConfig) -> None:
        self.tokenizer, self.retriever, self.config = tokenizer, retriever, config
        self.rules = EpisodeRules(tokenizer, config, reward_fn)
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def generate(self, model: nn.Module, examples: list[QAExample], group_size: Optional[int] = None,
                 greedy: Optional[bool] = None) -> Trajectory:
        cfg = self.config
        G = cfg.group_size if group_size is None else group_size
        greedy = cfg.greedy if greedy is None else greedy
        self.stats = {"retrieval_s": 0.0, "retrieval_calls": 0.0, "generate_calls": 0.0}
        was_training = model.training
        model.eval()
        episodes = []
        try:
            with sampling_weights(model):
                for example in examples:
                    prompt = prompt_token_ids(self.tokenizer, example.messages)
                    for _ in range(G):
                        episodes.append(self._rollout(model, Episode(example, Layout(list(prompt))), greedy))
        finally:
            model.train(was_training)
        return self.rules.to_trajectory(episodes, next(model.parameters()).device)

    def _rollout(self, model: nn.Module, ep: Episode, greedy: bool) -> Episode:
        rules = self.rules
        rules.start_turn(ep)
        while ep.phase != "done":
            self._turn(model, ep, greedy)
            query = rules.close_turn(ep)
            if query is not None:
                t0 = time.perf_counter()
                passages = self.retriever.search([query], self.config.topk)[0]
                self.stats["retrieval_s"] += time.perf_counter() - t0
                self.stats["retrieval_calls"] += 1
                rules.observe_passages(ep, passages)
            if ep.phase == "ready":
                ep.turn_index += 1
                rules.start_turn(ep)
        return ep

    @torch.no_grad()
    def probe_logprob(self, model: nn.Module, ids: list[int]) -> float:
        """The summed log-prob of ``ids`` (tokens 2..n) through the forward ``generate`` runs
        (sampling weights, eval mode), raw logits: the weight-sync check's probe (sync.py)."""
        was_training = model.training
        model.eval()
        try:
            with sampling_weights(model):
                tokens = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
                return summed_logprob(model(input_ids=tokens).logits[0, :-1], tokens[0])  # logits [n-1, V]
        finally:
            model.train(was_training)

    def sampling_settings(self, greedy: Optional[bool] = None) -> SamplingSettings:
        """What ``generate`` is asked to sample with (settings.py); every turn checks that it did."""
        greedy = self.config.greedy if greedy is None else greedy
        gen = self._generation_config(self.config.max_new_tokens, greedy)
        return dataclasses.replace(
            SamplingSettings.configured(self.config, self.tokenizer, self.rules.eos_ids), greedy=greedy,
            temperature=gen.temperature if not greedy else self.config.temperature,
            top_p=gen.top_p if not greedy else self.config.top_p, top_k=gen.top_k if not greedy else self.config.top_k,
            max_new_tokens=gen.max_new_tokens,
        )

    def _generation_config(self, budget: int, greedy: bool) -> GenerationConfig:
        cfg = self.config
        return GenerationConfig(
            max_new_tokens=budget, do_sample=not greedy, temperature=None if greedy else cfg.temperature,
            top_p=None if greedy else cfg.top_p, top_k=None if greedy else cfg.top_k,
            eos_token_id=self.rules.eos_ids, pad_token_id=self.rules.pad_id, output_logits=True, output_scores=True,
            return_dict_in_generate=True,
        )

    def _turn(self, model: nn.Module, ep: Episode, greedy: bool) -> None:
        """Decode one turn into ``ep.turn`` / ``ep.turn_logp``."""
        cfg = self.config
        context = ep.layout.prompt + [t for ids, _ in ep.layout.segments for t in ids]
        device = next(model.parameters()).device
        ids = torch.tensor([context], dtype=torch.long, device=device)
        # A config of its own, and nothing for generate to fill in from the model's generation_config
        # (an instruct model's sampling defaults must not change what the protocol asks for).
        with without_generation_config(model):
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=self._generation_config(ep.budget, greedy),
                                 stopping_criteria=StoppingCriteriaList([_TurnStop(self.rules, ep, len(context))]))
        self.stats["generate_calls"] += 1
        # What generate sampled the first token from, against the settings: a logits processor the
        # settings do not name (from a generation_config, or a transformers default) fails here.
        wrong = processed_scores_mismatch(out.logits[0][0], out.scores[0][0], self.sampling_settings(greedy))
        if wrong is not None:
            raise RuntimeError(f"HFGenerate: transformers' generate did not sample as configured: {wrong}. Sampled "
                               f"rollouts and their log-probs would not be the configured policy's ({self.sampling_settings(greedy).text()})")
        turn = out.sequences[0, len(context):].tolist()
        # The raw logits of each step, before temperature and top-k/top-p: log-probs as the engine's
        # sampler reports them (greedy: of the unscaled distribution).
        logits = torch.stack([step[0] for step in out.logits]).float()  # [n, V]
        if not greedy and cfg.temperature != 1.0:
            logits = logits / cfg.temperature
        token_logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(turn, device=logits.device)[:, None])[:, 0]
        ep.turn, ep.turn_logp = turn, token_logp.tolist()
