"""The typed batch that flows from rollout to loss to metrics (docs/architecture.md, Contracts).

One row per rollout, right-padded. Per-token tensors are aligned with ``input_ids``: masks mark
the token at the same position, and log-prob tensors hold log pi(input_ids[t] | input_ids[:t]).
Padding is marked by ``attention_mask``, never by comparing ids with a pad id (a model may sample
the pad token as EOS).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Turn:
    """One turn of a rollout: what the model wrote, and where the environment's answer to it lies."""

    action: str  # the turn's text as the model wrote it (decoded without special tokens)
    query: Optional[str]  # the search query the action issued; None for an answer, an invalid action or a last turn
    observation_span: Optional[tuple[int, int]]  # [start, end) in the row's input_ids of the observation that followed, if any


@dataclass
class Trajectory:
    input_ids: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long, 1 on real tokens
    prompt_len: Tensor  # [B] long
    loss_mask: Tensor  # [B, T] bool, True on model-generated tokens only
    action_id: Tensor  # [B, T] long, index of the action a model token belongs to, -1 elsewhere
    answer_mask: Tensor  # [B, T] bool, the final <answer>...</answer> span
    group_id: Tensor  # [B] long, unique per prompt
    reward: Tensor  # [B] float
    num_searches: Tensor  # [B] long, valid searches
    num_invalid: Tensor  # [B] long, invalid actions
    num_actions: Tensor  # [B] long
    finish_reason: list[str]  # "answer" | "max_turns" | "length"
    data_source: list[str]
    responses: list[str]  # decoded response text, observations included (for logging)
    questions: list[str] = field(default_factory=list)
    golden_answers: list[list[str]] = field(default_factory=list)
    model_texts: list[str] = field(default_factory=list)  # the model's actions only: what the reward saw
    answers: list[str | None] = field(default_factory=list)  # the answer of the last action (EM/F1), or None
    turns: list[list[Turn]] = field(default_factory=list)  # per row, its turns in order (actions, queries, observation spans)
    em: Tensor | None = None  # [B] float
    f1: Tensor | None = None  # [B] float
    sample_logp: Tensor | None = None  # [B, T] log-probs seen while sampling (diagnostics)
    advantage: Tensor | None = None  # [B] float
    old_logp: Tensor | None = None  # [B, T]
    ref_logp: Tensor | None = None  # [B, T]
    old_logp_pending: Tensor | None = None  # [B] bool: old log-probs the first update fills in (update/train.py)
    pg_weight: Tensor | None = None  # [B, T] float: weight of each token's policy-gradient term (None = 1; model.update.negative_advantages)
    frozen_hidden: Tensor | None = None  # [B, T, H] the hidden state entering decoder layer frozen_start (frozen_prefix.py)
    frozen_start: int | None = None  # the first trained decoder layer; None when frozen_hidden is
    extras: dict[str, Any] = field(default_factory=dict)  # per-row lists/tensors are sliced by select

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> Tensor:
        return self.loss_mask.sum(-1)

    def select(self, index: Tensor | list[int]) -> "Trajectory":
        """Rows ``index`` (a mini- or micro-batch), trimmed to their longest row to cut padding.
        Per-row values in ``extras`` (lists and tensors of length B) are selected too."""
        idx = torch.as_tensor(index, dtype=torch.long)
        B, T = self.input_ids.shape
        width = int(self.attention_mask[idx.to(self.attention_mask.device)].sum(-1).max().item()) if len(idx) else 0

        def rows(value: Any) -> Any:
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == B:
                value = value[idx.to(value.device)]
                return value[:, :width] if value.dim() in (2, 3) and value.shape[1] == T else value
            if isinstance(value, list) and len(value) == B:
                return [value[i] for i in idx.tolist()]
            return value

        out = {f.name: rows(getattr(self, f.name)) for f in fields(self) if f.name != "extras"}
        return Trajectory(**out, extras={k: rows(v) for k, v in self.extras.items()})

    @staticmethod
    def concat(parts: list["Trajectory"]) -> "Trajectory":
        """The rows of ``parts`` one after the other, right-padded to the widest (padding: attention
        and loss masks 0, action_id -1, everything else 0). Optional tensors must be set in all parts
        or in none; per-row extras are concatenated, others taken from the first part."""
        # ValueError, not require()/ConfigError, in concat and check: no setting can cause these, they
        # are bugs in the code that built the parts (the rollout, a test), and keep their traceback.
        if not parts:
            raise ValueError("Trajectory.concat needs at least one part")
        width = max(p.input_ids.shape[1] for p in parts)
        out: dict[str, Any] = {}
        for f in fields(Trajectory):
            values = [getattr(p, f.name) for p in parts]
            if f.name == "extras":
                first = values[0]
                out[f.name] = {
                    k: [x for p in parts for x in p.extras[k]] if all(_per_row(p.extras.get(k), len(p)) for p in parts) else v
                    for k, v in first.items()
                }
            elif all(isinstance(v, Tensor) for v in values):
                if values[0].dim() == 2:
                    pad = -1 if f.name == "action_id" else 0
                    values = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=pad) for v in values]
                elif values[0].dim() == 3:  # [B, T, H]: pad the positions
                    values = [torch.nn.functional.pad(v, (0, 0, 0, width - v.shape[1])) for v in values]
                out[f.name] = torch.cat(values)
            elif all(v is None for v in values):
                out[f.name] = None
            elif f.name == "frozen_start" and len(set(values)) == 1:
                out[f.name] = values[0]
            elif all(isinstance(v, list) for v in values):
                out[f.name] = [x for v in values for x in v]
            else:
                raise ValueError(f"Trajectory.concat: field {f.name!r} is set in some parts and not in others")
        return Trajectory(**out)

    def to(self, device: torch.device | str) -> "Trajectory":
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                setattr(self, f.name, value.to(device))
        return self

    def check(self) -> None:
        """Raise if the invariants of the contract do not hold (used by tests and debug runs).
        A ValueError (see ``concat``): a broken invariant is a bug in the code that built the batch."""
        B, T = self.input_ids.shape
        for name in ("attention_mask", "loss_mask", "action_id", "answer_mask"):
            if getattr(self, name).shape != (B, T):
                raise ValueError(f"Trajectory.{name} has shape {tuple(getattr(self, name).shape)}, expected {(B, T)}")
        real = self.attention_mask.bool()
        if (self.loss_mask & ~real).any():
            raise ValueError("Trajectory.loss_mask is set on a padding position")
        positions = torch.arange(T, device=self.input_ids.device).unsqueeze(0)
        if (self.loss_mask & (positions < self.prompt_len.unsqueeze(-1))).any():
            raise ValueError("Trajectory.loss_mask is set on a prompt token")
        if ((self.action_id >= 0) != self.loss_mask).any():
            raise ValueError("Trajectory.action_id must be >= 0 exactly on model tokens")
        if (self.answer_mask & ~self.loss_mask).any():
            raise ValueError("Trajectory.answer_mask is set outside model tokens")


def _per_row(value: Any, rows: int) -> bool:
    return isinstance(value, list) and len(value) == rows
