"""The token layout of one trajectory (prompt, then model actions and observations in order) and
the packer that turns a batch of them into the right-padded tensors a Trajectory holds.

Its own file because two producers share it: the rollout engine fills a Layout token by token as
it samples, the warm start (lldslight/sft.py) builds one from a gold trajectory. One packer means
the supervised and the RL batches mark model tokens, action ids and the prompt the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor


@dataclass
class Layout:
    """One trajectory's tokens: the prompt, then segments in order, each the ids of model action
    ``action`` (0, 1, ...) or of an observation (``action`` = -1)."""

    prompt: list[int]
    segments: list[tuple[list[int], int]] = field(default_factory=list)

    def add(self, ids: list[int], action: int) -> None:
        self.segments.append((ids, action))

    def actions(self) -> list[list[int]]:
        """The model's own token ids, one list per action."""
        return [ids for ids, act in self.segments if act >= 0]

    def __len__(self) -> int:
        return len(self.prompt) + sum(len(ids) for ids, _ in self.segments)


def pack(layouts: Sequence[Layout], pad_id: int) -> dict[str, Tensor]:
    """Right-padded tensors of a batch of layouts (Trajectory's contract):
    input_ids, attention_mask [B, T] long; loss_mask [B, T] bool (model tokens);
    action_id [B, T] long (-1 off model tokens); prompt_len [B] long."""
    B, T = len(layouts), max(len(lay) for lay in layouts)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((B, T), dtype=torch.long)  # [B, T]
    action_id = torch.full((B, T), -1, dtype=torch.long)  # [B, T]
    for b, lay in enumerate(layouts):
        ids, acts = list(lay.prompt), [-1] * len(lay.prompt)
        for seg, act in lay.segments:
            ids += seg
            acts += [act] * len(seg)
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, : len(ids)] = 1
        action_id[b, : len(ids)] = torch.tensor(acts, dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": action_id >= 0,
        "action_id": action_id,
        "prompt_len": torch.tensor([len(lay.prompt) for lay in layouts], dtype=torch.long),  # [B]
    }
