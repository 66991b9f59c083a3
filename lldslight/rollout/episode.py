"""One rollout's turns under the Search-R1 protocol, whichever backend decodes them: when a turn
stops, what closes it (an answer, a search, an invalid action, the end of the turns or of the
budget), the observation that follows, and the finished rollouts packed and scored into a
Trajectory.

Its own file because every generation backend (lldslight/rollout/backend.py) must play the protocol
identically, token for token: the in-process engine (engine.py) and the Hugging Face ``generate``
loop (hf_generate.py) both drive an :class:`Episode` through :class:`EpisodeRules`, and both score
through :meth:`EpisodeRules.to_trajectory`. A backend owns only how the tokens of a turn are decoded.

The reward sees only the model's own text (its actions; lldslight/rewards.py), and the reward and
EM/F1 score one answer, the one in its last action (rewards.final_answer).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from lldslight.data.example import QAExample
from lldslight.rewards import ModelText, RewardCaller, exact_match, f1_score, final_answer
from lldslight.trajectory import Trajectory, Turn

from .answer import answer_token_span
from .layout import Layout, pack
from .protocol import INVALID_ACTION, STOP_TAGS, eos_ids, format_observation, observation_ids, parse_action


@dataclass
class Episode:
    """One rollout as it moves through its turns. phase: "decode" (sampling a turn), "wait" (its
    search is queued or being retrieved), "ready" (an observation waits to be prefilled), "done"."""

    example: QAExample
    layout: Layout
    phase: str = "decode"
    turn_index: int = 0
    turn: list[int] = field(default_factory=list)
    turn_logp: list[float] = field(default_factory=list)
    budget: int = 0
    sample_logp: list[float] = field(default_factory=list)
    response_len: int = 0
    actions: int = 0
    searches: int = 0
    invalid: int = 0
    finish: str = ""
    queries: list[Optional[str]] = field(default_factory=list)  # per action: the query it searched for, or None


class EpisodeRules:
    """The protocol's rules for one tokenizer and one set of sampling settings (a RolloutConfig).

    Args:
        tokenizer: the policy's tokenizer.
        config: the rollout settings (turns, budgets, top-k passages).
        reward_fn: the reward (rewards.RewardFn; called through rewards.RewardCaller).
    """

    def __init__(self, tokenizer, config, reward_fn) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.reward = RewardCaller(reward_fn)
        self.eos_ids = eos_ids(tokenizer)
        self.eos = frozenset(self.eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    # -- a turn -----------------------------------------------------------------------------------

    def start_turn(self, ep: Episode) -> None:
        cfg = self.config
        ep.phase, ep.turn, ep.turn_logp = "decode", [], []
        # >= 1: a rollout that is not done has room left in its response budget
        ep.budget = min(cfg.max_new_tokens, cfg.max_response_tokens - ep.response_len)

    def turn_stops(self, ep: Episode, token: int) -> bool:
        """Whether the turn ends with ``token``, just appended to ``ep.turn``: EOS, the turn's
        budget, or a completed stop tag."""
        return token in self.eos or len(ep.turn) >= ep.budget or (token in self._tag_closers and self._hit_stop(ep.turn))

    @functools.cached_property
    def _tag_closers(self) -> frozenset[int]:
        """Ids of the tokens that can complete a stop tag (their text holds its final '>'); byte
        tokens ('<0x3E>') are kept too. Only after one of these is the decoded tail searched."""
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return frozenset(i for i, p in enumerate(pieces) if p is not None and (">" in p or p.startswith("<0x")))

    def _hit_stop(self, turn: list[int]) -> bool:
        # A tag is at most 9 characters, so the last 12 tokens always hold a freshly completed one.
        tail = self.tokenizer.decode(turn[-12:], skip_special_tokens=False)
        return any(tag in tail for tag in STOP_TAGS)

    def close_turn(self, ep: Episode) -> Optional[str]:
        """Record the turn as the rollout's next action and decide what follows; returns the query
        when it searched (the caller retrieves, then calls :meth:`observe_passages`)."""
        cfg = self.config
        ep.layout.add(ep.turn, ep.actions)
        ep.sample_logp.extend(ep.turn_logp)
        ep.actions += 1
        ep.response_len += len(ep.turn)
        ep.queries.append(None)
        kind, content = parse_action(self.tokenizer.decode(ep.turn, skip_special_tokens=True))
        if kind == "answer":
            ep.finish = "answer"
        elif ep.turn_index == cfg.max_turns:
            ep.finish = "max_turns"
        elif ep.response_len >= cfg.max_response_tokens:
            ep.finish = "length"
        elif kind == "search" and content:
            ep.phase = "wait"
            ep.queries[-1] = content
            return content
        else:
            ep.invalid += 1
            self.observe(ep, INVALID_ACTION)
        if ep.finish:
            ep.phase = "done"
        return None

    def observe_passages(self, ep: Episode, passages: list) -> None:
        """The retrieved passages of the rollout's search become its observation."""
        ep.searches += 1
        self.observe(ep, format_observation(passages))

    def observe(self, ep: Episode, text: str) -> None:
        """Append an observation, cut to max_obs_tokens and to what is left of the response budget."""
        room = self.config.max_response_tokens - ep.response_len
        obs = observation_ids(self.tokenizer, text, self.config.max_obs_tokens)[: max(room, 0)]
        ep.layout.add(obs, -1)
        ep.response_len += len(obs)
        if ep.response_len >= self.config.max_response_tokens:
            ep.finish, ep.phase = "length", "done"
        else:
            ep.phase = "ready"

    # -- packing and scoring ----------------------------------------------------------------------

    def to_trajectory(self, episodes: list[Episode], device: torch.device) -> Trajectory:
        packed = pack([ep.layout for ep in episodes], self.pad_id)
        B, T = packed["input_ids"].shape
        answer_mask = torch.zeros((B, T), dtype=torch.bool)  # [B, T]: the final answer's tokens
        sample_logp = torch.zeros((B, T), dtype=torch.float32)  # [B, T]: log-probs as sampled, on model tokens
        for b, ep in enumerate(episodes):
            sample_logp[b, packed["loss_mask"][b]] = torch.tensor(ep.sample_logp, dtype=torch.float32)
            if ep.finish == "answer":
                last = ep.layout.segments[-1][0]
                start = len(ep.layout) - len(last)
                for offset in answer_token_span(self.tokenizer, last):
                    answer_mask[b, start + offset] = True
        scores = self._score(episodes)
        traj = Trajectory(
            input_ids=packed["input_ids"],
            attention_mask=packed["attention_mask"],
            prompt_len=packed["prompt_len"],
            loss_mask=packed["loss_mask"],
            action_id=packed["action_id"],
            answer_mask=answer_mask,
            group_id=torch.tensor([ep.example.group_id for ep in episodes], dtype=torch.long),
            reward=torch.tensor(scores["reward"], dtype=torch.float32),
            num_searches=torch.tensor([ep.searches for ep in episodes], dtype=torch.long),
            num_invalid=torch.tensor([ep.invalid for ep in episodes], dtype=torch.long),
            num_actions=torch.tensor([ep.actions for ep in episodes], dtype=torch.long),
            finish_reason=[ep.finish for ep in episodes],
            data_source=[ep.example.data_source for ep in episodes],
            responses=scores["responses"],
            questions=[ep.example.question for ep in episodes],
            golden_answers=[list(ep.example.golden_answers) for ep in episodes],
            model_texts=scores["model_texts"],
            answers=scores["answers"],
            turns=scores["turns"],
            em=torch.tensor(scores["em"], dtype=torch.float32),
            f1=torch.tensor(scores["f1"], dtype=torch.float32),
            sample_logp=sample_logp,
        )
        # The ids exactly as sampled, per rollout: tests check the trajectory never re-tokenised them.
        traj.extras["sampled_ids"] = [[t for ids in ep.layout.actions() for t in ids] for ep in episodes]
        return traj.to(device)

    def turns(self, ep: Episode) -> list[Turn]:
        """The rollout's turns: each action's text and query, and the token span of the observation
        that followed it (positions in the packed row)."""
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        out: list[Turn] = []
        at = len(ep.layout.prompt)
        for ids, act in ep.layout.segments:
            if act >= 0:
                out.append(Turn(action=decode(ids), query=ep.queries[act], observation_span=None))
            elif out:
                out[-1] = Turn(out[-1].action, out[-1].query, (at, at + len(ids)))
            at += len(ids)
        return out

    def _score(self, episodes: list[Episode]) -> dict[str, list]:
        """Reward, EM and F1 from the model's own words only: the reward gets the text of its actions
        (no observation, no invalid-action message) as a ModelText, and, if it asks for them, the
        question, the data source and the turns (rewards.RewardCaller); it and EM/F1 score the same
        answer, the last action's (rewards.final_answer). The full response text, observations
        included, is kept for logging."""
        out: dict[str, list] = {k: [] for k in ("responses", "model_texts", "answers", "reward", "em", "f1", "turns")}
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        for ep in episodes:
            turns = self.turns(ep)
            text = ModelText([t.action for t in turns])
            answer = final_answer(text)
            gold = ep.example.golden_answers
            out["responses"].append(decode([t for ids, _ in ep.layout.segments for t in ids]))
            out["model_texts"].append(str(text))
            out["answers"].append(answer)
            out["turns"].append(turns)
            reward = self.reward(text, gold, question=ep.example.question, data_source=ep.example.data_source, turns=tuple(turns))
            out["reward"].append(float(reward) + 0.0)  # + 0.0: a reward of -0.0 is 0.0
            out["em"].append(exact_match(answer, gold))
            out["f1"].append(f1_score(answer, gold))
        return out
