"""Dynamic sampling: train only on groups whose rewards differ (DAPO, arXiv 2503.14476, §3.2; veRL's
``algorithm.filter_groups``).

A group whose G rollouts all got the same reward has advantage 0 on every row: GRPO's gradient on it
is exactly zero, and with per-response averaging it only dilutes the mini-batch. On small models and
hard questions most groups tie (all wrong), so most steps carry little or no signal. Dynamic
sampling keeps the groups with mixed rewards, samples further prompts (the datamodule's refill
stream, ``SearchQADataModule.refill_prompts``) until the rollout batch holds ``data.batch_size``
mixed groups per rank, and gives up after ``max_rounds`` extra rounds: it then trains on the mixed
groups it has (warning once; ``rollout/filled`` < 1 every such step). If some rank has none at all,
every rank trains on its first round as sampled, as vanilla GRPO would (``rollout/filled`` 0).

Under DDP and FSDP2 every rank must run the same number of sampling rounds (FSDP2 gathers the
sharded weights collectively once per generate call) and end with the same number of rows (every
forward and backward of the update is a collective): ranks agree after each round whether all of
them are full, and finally keep the smallest count of mixed groups any rank has.

Off by default and in the paper recipes (the paper does not use it). It is an option of the
rollout callback, ``SearchRollout(dynamic_sampling={enabled: true, max_rounds: 4})``, which calls
:func:`sample_mixed_groups`; a config composed after the one that defines the SearchRollout sets it
by appending ``SearchRolloutOptions`` with that option (``configs/dynamic_sampling.yaml``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from lldslight.data.example import QAExample
from lldslight.policy.distributed import all_ranks_agree, all_ranks_min
from lldslight.errors import require
from lldslight.trajectory import Trajectory


@dataclass
class DynamicSamplingConfig:
    """Dynamic sampling (DAPO, arXiv 2503.14476; veRL ``filter_groups``): keep only groups with mixed
    rewards and sample further prompts until the rollout batch is full of them.

    Args:
        enabled: turn it on (off by default and in the paper recipes: the paper does not use it).
        max_rounds: extra sampling rounds per training step at most (each samples ``data.batch_size``
            more prompts per rank); when they run out, train on the mixed groups found so far.
    """

    enabled: bool = False
    max_rounds: int = 4

    def __post_init__(self) -> None:
        require(self.max_rounds >= 0, "dynamic_sampling.max_rounds", ">= 0", self.max_rounds)


def mixed_groups(reward: Tensor, group_id: Tensor) -> tuple[list[int], list[int]]:
    """(group ids whose rewards differ, group ids whose rewards are all equal), each in order of
    first appearance. A one-rollout group counts as equal (it has no variance)."""
    mixed, tied = [], []
    for g in dict.fromkeys(group_id.tolist()):
        r = reward[group_id == g]
        (mixed if bool(r.max() > r.min()) else tied).append(g)
    return mixed, tied


@dataclass
class SampleResult:
    """What one step's dynamic sampling produced."""

    traj: Trajectory  # the rows to train on
    rounds: int  # sampling rounds (generate calls), the first included
    kept_groups: int  # groups in ``traj``
    sampled_groups: int  # groups sampled over all rounds
    filled: float  # share of the batch filled with mixed groups (1 = full; 0 = the first round as sampled)


def sample_mixed_groups(
    generate: Callable[[list[QAExample]], Trajectory],
    refill: Callable[[int], list[QAExample]],
    batch: list[QAExample],
    max_rounds: int,
    device: torch.device,
) -> SampleResult:
    """Sample ``batch``, then ``refill(len(batch))`` prompts per extra round, until ``len(batch)`` groups
    with mixed rewards are in hand on every rank or ``max_rounds`` extra rounds are used.

    Collective under torch.distributed: every rank must call it (one small all-reduce per round and
    one at the end), and every rank calls ``generate`` the same number of times.
    """
    want = len(batch)
    parts: list[Trajectory] = []
    kept: list[int] = []  # group ids with mixed rewards, in sampling order
    first = None
    rounds = sampled = 0
    prompts = batch
    while True:
        traj = generate(prompts)
        rounds += 1
        first = traj if first is None else first
        mixed, tied = mixed_groups(traj.reward, traj.group_id)
        sampled += len(mixed) + len(tied)
        # A prompt can come back in a later round (the refill stream has its own order); its second
        # group would merge with the first in the advantage, so a prompt is kept once per step.
        new = [g for g in mixed if g not in kept]
        if new:
            parts.append(traj.select(torch.isin(traj.group_id, torch.tensor(new, device=traj.group_id.device)).nonzero()[:, 0]))
            kept += new
        everyone_full = all_ranks_agree(len(kept) >= want, device)  # called every round on every rank
        if everyone_full or rounds > max_rounds:
            break
        prompts = refill(want)
    count = all_ranks_min(min(len(kept), want), device)
    if count == 0:
        return SampleResult(first, rounds, len(batch), sampled, 0.0)
    joined = Trajectory.concat(parts)
    keep = torch.isin(joined.group_id, torch.tensor(kept[:count], device=joined.group_id.device))
    return SampleResult(joined.select(keep.nonzero()[:, 0]), rounds, count, sampled, count / want)
