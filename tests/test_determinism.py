"""Deterministic mode (trainer.deterministic: true): the rollout engine schedules retrieval by
step, not by the clock, and two runs of the same command give bit-identical metrics."""
from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from run_helpers import TINY_RUN_HEAD, ParityReward

from lldslight.rollout import RolloutConfig, RolloutEngine


class JitteryRetriever:
    """BM25 answers after a random delay drawn from its own clock-seeded stream: without a
    by-step schedule, which rows decode together depends on when each answer lands."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rng = random.Random(time.perf_counter_ns())

    def search(self, queries, k):
        time.sleep(self.rng.uniform(0.0, 0.03))
        return self.inner.search(queries, k)


@pytest.fixture(scope="module")
def engine_and_examples(protocol_examples, bm25, protocol_model):
    model, tok = protocol_model
    engine = RolloutEngine(tok, JitteryRetriever(bm25), ParityReward(),
                           RolloutConfig(group_size=3, max_turns=2, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=400, topk=1))
    return model, engine, protocol_examples  # questions the tiny model was trained to search for


def _sample(model, engine, examples):
    torch.manual_seed(3)
    traj = engine.generate(model, examples)
    return traj.extras["sampled_ids"], traj.sample_logp, dict(engine.stats)


def test_deterministic_mode_waits_for_each_search_where_it_is_sent(engine_and_examples) -> None:
    model, engine, examples = engine_and_examples
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ids_a, logp_a, stats_a = _sample(model, engine, examples)
        ids_b, logp_b, stats_b = _sample(model, engine, examples)
    finally:
        torch.use_deterministic_algorithms(before)
    assert stats_a["retrieval_calls"] > 0
    assert stats_a["overlap_steps"] == 0 and stats_b["overlap_steps"] == 0  # no decode step ran beside a search in flight
    assert ids_a == ids_b and torch.equal(logp_a, logp_b)
    assert stats_a["decode_steps"] == stats_b["decode_steps"]


class SlowRetriever:
    """BM25 answering 0.2 s late: longer than a tiny model's decode step even on a loaded machine
    (with the fixture's 0-30 ms a busy CPU's slower steps let every search land before the next
    step looked, and the contrast below saw no overlap although the engine allowed it)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def search(self, queries, k):
        time.sleep(0.2)
        return self.inner.search(queries, k)


def test_default_mode_overlaps_decoding_with_retrieval(engine_and_examples, bm25) -> None:
    """The contrast that lets the test above fail: by default decoding goes on while a search is out."""
    model, engine, examples = engine_and_examples
    assert not torch.are_deterministic_algorithms_enabled()
    slow = RolloutEngine(engine.tokenizer, SlowRetriever(bm25), ParityReward(), engine.config)
    _, _, stats = _sample(model, slow, examples)
    assert stats["overlap_steps"] > 0


CONFIG = TINY_RUN_HEAD + """        reward: {{class_path: run_helpers.ParityReward}}
        rollout: {{group_size: 2, max_turns: 2, max_new_tokens: 12, max_obs_tokens: 48, max_response_tokens: 120, topk: 2, temperature: 1.0}}
    - class_path: lldslight.callbacks.LLDMonitor
      init_args: {{plot: false}}
  deterministic: true
model:
  update: {{updates_per_rollout: 2}}
"""


def _fit(tmp: Path, name: str) -> dict:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(CONFIG.format(steps=4, save_dir=tmp / name))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", "configs/tiny.yaml", "--config", str(cfg)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp / name).glob("tiny/version_*/metrics.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {(r["step"], k): v for r in rows for k, v in r.items() if not k.startswith("time/") and v != ""}


@pytest.mark.slow
def test_two_deterministic_runs_are_bit_identical(tmp_path) -> None:
    a, b = _fit(tmp_path, "a"), _fit(tmp_path, "b")
    assert any(k[1] == "train/grad_norm" for k in a)
    assert a == b
