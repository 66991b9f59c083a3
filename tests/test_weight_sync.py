"""After every weight update, the generation backend must sample from the updated weights
(lldslight/rollout/sync.py): real fits of configs/tiny.yaml through the CLI.

- Both shipped backends pass, and their probe moves as the policy's does (the probe's log-prob
  change through the sampler's path against the plain forward's, step by step).
- A backend that keeps the weights it first saw (an inference server whose weight sync silently
  did not take) stops the run after the first step that changed the weights, with the error that
  says so; the same backend with every update vetoed is not judged (no weight changed) and the
  run goes on.
"""
from __future__ import annotations

import copy
import csv
import math
import re

import lightning.pytorch as pl
import pytest
import yaml

from lldslight.rollout import RolloutEngine
from tests.conftest import ROOT


class StaleEngine(RolloutEngine):
    """The engine sampling from a copy of the policy taken at its first call and never updated:
    what a backend whose weight sync does not take does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.copy = None

    def _stale(self, model):
        if self.copy is None:
            self.copy = copy.deepcopy(model)
        return self.copy

    def generate(self, model, examples, group_size=None, greedy=None):
        return super().generate(self._stale(model), examples, group_size, greedy)

    def probe_logprob(self, model, ids):
        return super().probe_logprob(self._stale(model), ids)


class VetoAll(pl.Callback):
    """A step gate that vetoes every update: no weight changes."""

    def setup(self, trainer, pl_module, stage):
        pl_module.add_step_gate("veto_all", lambda ctx: False)


def fit(tmp_path, monkeypatch, backend: str, steps: int = 2, veto: bool = False, exit_code: int = 0) -> list[dict]:
    from lldslight.cli import main

    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    rollout = config["trainer"]["callbacks"][0]
    rollout["init_args"]["backend"] = backend
    # rewards 0, 1, 0, 1: every group mixed, so every step moves the policy (tiny.yaml's random policy
    # earns 0 everywhere, and a step without advantage leaves its LoRA product at 0)
    rollout["init_args"]["reward"] = {"class_path": "tests.test_signal.Alternate"}
    config["trainer"]["callbacks"] = [rollout] + ([{"class_path": "tests.test_weight_sync.VetoAll"}] if veto else [])
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    assert main(["fit", "--config", str(tmp_path / "fit.yaml"), "--trainer.max_steps", str(steps)]) == exit_code
    if exit_code:
        return []
    with open(tmp_path / "runs" / "tiny" / "version_0" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("train/reward")]


@pytest.mark.parametrize("backend", ["lldslight.rollout.RolloutEngine",
                                     pytest.param("lldslight.rollout.HFGenerate", marks=pytest.mark.slow)])  # generate: a turn per call
def test_the_shipped_backends_follow_every_update(backend, tmp_path, monkeypatch):
    rows = fit(tmp_path, monkeypatch, backend)
    assert len(rows) == 2
    for row in rows:
        policy, sampler = float(row["sync/policy_delta"]), float(row["sync/backend_delta"])
        assert abs(policy) > 1e-4, row  # the step moved the weights
        # the sampler's path (LoRA folded into the weights, or generate's forward) scores the probe as
        # the plain forward does, within float rounding
        assert math.isclose(sampler, policy, rel_tol=1e-3, abs_tol=1e-5), (sampler, policy)


def test_a_backend_that_keeps_the_old_weights_stops_the_run(tmp_path, monkeypatch, capsys):
    """In one line (exit 2), naming the step."""
    fit(tmp_path, monkeypatch, "tests.test_weight_sync.StaleEngine", exit_code=2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"lldslight fit: error: weight sync failed after step 0: the generation backend samples from old "
                        r"weights\. .* the backend's did not move at all.*", lines[-1]), lines[-3:]


def test_a_step_whose_updates_were_all_vetoed_is_not_judged(tmp_path, monkeypatch):
    rows = fit(tmp_path, monkeypatch, "tests.test_weight_sync.StaleEngine", veto=True)
    assert [float(r["train/vetoed_updates"]) for r in rows] == [2.0, 2.0]  # both updates of both steps
    assert [float(r["sync/policy_delta"]) for r in rows] == [0.0, 0.0]
    assert [float(r["sync/backend_delta"]) for r in rows] == [0.0, 0.0]


def test_the_probe_runs_under_the_policys_precision():
    """bf16-mixed (the demo's precision where the CPU has bf16): a bf16 base under an fp32 adapter.
    The probe's plain forward runs under the policy's autocast, as every trainer and sampler
    forward does, and agrees with an fp32 copy's (it failed with a dtype mismatch)."""
    import dataclasses

    from lldslight.policy import load_policy
    from lldslight.rollout.sync import policy_logprob, probe_ids
    from tests.conftest import tiny_policy_config

    model, tokenizer = load_policy(dataclasses.replace(tiny_policy_config(), precision="bf16-mixed", dtype=None))
    ids = probe_ids(tokenizer)
    value = policy_logprob(model, ids)
    assert math.isfinite(value) and value < 0
    import torch

    full = copy.deepcopy(model).float()  # the same weights in fp32, run without autocast
    with torch.no_grad():
        tokens = torch.tensor([ids])
        logp = torch.log_softmax(full(input_ids=tokens).logits[0, :-1].double(), -1).gather(-1, tokens[0, 1:, None]).sum()
    assert abs(float(logp) - value) <= 0.05 * abs(value)  # bf16 rounding apart
