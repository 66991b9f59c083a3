"""reduce_over_ranks on two real gloo processes, against the values computed by hand."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lldslight.policy.distributed import reduce_over_ranks

KINDS = {"a_sum": "sum", "b_mean": "mean", "c_max": "max", "d_min": "min"}
RANK_VALUES = [{"a_sum": 1.0, "b_mean": 2.0, "c_max": 3.0, "d_min": -1.0},
               {"a_sum": 10.0, "b_mean": 4.0, "c_max": -5.0, "d_min": 7.0}]
EXPECTED = {"a_sum": 11.0, "b_mean": 3.0, "c_max": 3.0, "d_min": -1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results[rank] = reduce_over_ranks(RANK_VALUES[rank], KINDS, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_every_reduction_kind_over_two_gloo_ranks() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), results), nprocs=2, join=True)
        assert dict(results[0]) == EXPECTED == dict(results[1])


@pytest.mark.parametrize("kinds", [{"a_sum": "sum"}, {"a_sum": "sum", "b_mean": "average"}])
def test_a_key_without_a_known_reduction_is_refused_by_name(kinds: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="b_mean"):  # a ConfigError, which is a ValueError
        reduce_over_ranks({"a_sum": 1.0, "b_mean": 2.0}, kinds, torch.device("cpu"))
