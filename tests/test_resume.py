"""Exact resume: a tiny fit killed (SIGKILL) in the middle of a step and restarted with
``--ckpt_path last`` logs bit for bit the same metrics for the remaining steps as a run never
interrupted, and ends with the same weights. (Sampling with LoRA folds the adapter into a copy of
the weights, so the frozen base never drifts: rollout.py ``_lora_folded``.) The resumed run skips
``eval_before_fit``: its weights are trained, so its evaluation would not be a "before" number.

What has to survive for that: adapter weights, AdamW moments, the warm-up scheduler, the global
step, the data position, every RNG stream (sampling uses torch's) and the state of the LLDMonitor
(phase detector) and GradientSpikeGuard (window of gradient norms) callbacks, and with dynamic sampling
the refill stream's position. The run directory is found
by ``--ckpt_path last`` although the CSV logger numbers its runs (lldslight.checkpoint); the resumed
run logs to the next version directory.
"""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import KILL, TINY_RUN_HEAD

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AT = 4, 2  # the kill happens during step index 2, after checkpoints of steps 0 and 1

CONFIG = TINY_RUN_HEAD + """        reward: {reward}
        rollout: {{group_size: 2, max_turns: 2, max_new_tokens: 12, max_obs_tokens: 48, max_response_tokens: 120, topk: 2, temperature: 1.0}}
        eval_before_fit: true
        eval_max_turns: 1
{extra}{dynamic}    - class_path: lldslight.callbacks.LLDMonitor
      init_args: {{plot: false}}
    - class_path: lldslight.callbacks.GradientSpikeGuard
      init_args: {{factor: 1.5, window: 4, warmup: 1, max_consecutive_vetoes: 0}}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{save_last: true, every_n_train_steps: 1}}
model:
  warmup_steps: 3
"""
DYNAMIC = """    - class_path: lldslight.callbacks.DynamicSampling
      init_args: {max_rounds: 3}
"""



def fit(tmp: Path, name: str, save_dir: Path, extra: str = "", args: tuple[str, ...] = (), dynamic: bool = False) -> subprocess.CompletedProcess:
    cfg = tmp / f"{name}.yaml"
    # With dynamic sampling, half the prompts can never form a mixed group (SplitReward ties them by
    # their gold answer, whatever the policy does), so refills after the kill do not hinge on luck.
    reward = "{class_path: run_helpers.SplitReward, init_args: {tie_every: 2}}" if dynamic else "{class_path: run_helpers.ParityReward}"
    cfg.write_text(CONFIG.format(steps=STEPS, save_dir=save_dir, extra=extra, dynamic=DYNAMIC if dynamic else "", reward=reward))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", "configs/tiny.yaml", "--config", str(cfg), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def metrics(path: Path) -> dict[int, dict[str, float]]:
    """Step -> metrics; a step logged twice (before the kill and after the resume) keeps its last row."""
    out: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                out[int(row["step"])] = {k: float(v) for k, v in row.items() if v != "" and k != "step"}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic_sampling"])
def test_sigkilled_fit_resumes_exactly(tmp_path, dynamic):
    full_dir, run_dir = tmp_path / "full", tmp_path / "run"
    full = fit(tmp_path, "full", full_dir, dynamic=dynamic)
    assert full.returncode == 0, full.stderr[-3000:]

    killed = fit(tmp_path, "killed", run_dir, extra=KILL.format(step=KILL_AT), dynamic=dynamic)
    assert killed.returncode == -9, f"expected SIGKILL, got {killed.returncode}\n{killed.stderr[-3000:]}"
    ckpts = run_dir / "tiny" / "version_0" / "checkpoints"
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == KILL_AT
    assert not list(ckpts.glob(".*tmp*")), "a temporary checkpoint file was left behind"

    resumed = fit(tmp_path, "resumed", run_dir, args=("--ckpt_path", "last"), dynamic=dynamic)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr, "--ckpt_path last did not find the killed run's checkpoint"

    want = metrics(full_dir / "tiny" / "version_0" / "metrics.csv")
    before = metrics(run_dir / "tiny" / "version_0" / "metrics.csv")  # the killed run (flushed every step)
    after = metrics(run_dir / "tiny" / "version_1" / "metrics.csv")  # the resumed run logs to a new version
    assert sorted(want) == list(range(STEPS)), sorted(want)
    assert sorted(before) == list(range(KILL_AT)) and sorted(after) == list(range(KILL_AT, STEPS)), (sorted(before), sorted(after))
    got = {**before, **after}
    assert len({want[s]["train/lr"] for s in want}) > 1, "the warm-up should change lr between steps"
    assert any(0 < want[s]["train/reward"] < 1 for s in want), "rewards never mixed: the comparison would be vacuous"
    if dynamic:  # the refill stream was drawn from after the kill: its position had to survive
        assert any(want[s]["rollout/rounds"] > 1 for s in range(KILL_AT, STEPS)), "no refill after the resume: vacuous"
    for step in range(STEPS):
        # Everything the module, the monitor (its phase detector's smoothing) and the guard (its
        # window of norms decides vetoes) log, except wall times.
        keys = {k for k in want[step] if k.startswith(("train/", "lld/", "rollout/"))}
        assert keys == {k for k in got[step] if k.startswith(("train/", "lld/", "rollout/"))}, (step, keys ^ set(got[step]))
        assert "lld/logp_smooth" in keys and "train/vetoed_updates" in keys
        for key in sorted(keys):
            a, b = want[step][key], got[step][key]
            assert a == b or (math.isnan(a) and math.isnan(b)), (step, key, a, b)

    a = torch.load(full_dir / "tiny" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(run_dir / "tiny" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == STEPS
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all("lora_" in k for k in a["state_dict"]), "checkpoints should hold only the trainable adapter"
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    # The first run evaluated before training, through the same path as `lldslight validate`
    # (gathered records, summary, report files); the resumed one did not (and said so).
    first = (run_dir / "tiny" / "version_0" / "metrics.csv").read_text()
    assert "val_before/em" in first.splitlines()[0] and "val_before/em/" in first.splitlines()[0]
    report = run_dir / "tiny" / "version_0" / "val_before_step0.md"
    assert report.is_file() and "| data_source | n | EM |" in report.read_text()
    assert "val_before" not in (run_dir / "tiny" / "version_1" / "metrics.csv").read_text()
    assert "eval_before_fit skipped: resuming at step 2" in resumed.stdout
