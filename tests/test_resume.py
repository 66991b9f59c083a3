"""Exact resume: a tiny fit killed (SIGKILL) in the middle of a step and restarted with
``--ckpt_path last`` logs bit for bit the same metrics for the remaining steps as a run never
interrupted, and ends with the same weights. (Sampling with LoRA folds the adapter into a copy of
the weights, so the frozen base never drifts: lldslight/policy/sampling.py ``sampling_weights``.) The resumed run skips
``eval_before_fit``: its weights are trained, so its evaluation would not be a "before" number.

What has to survive for that: adapter weights, AdamW moments, the warm-up scheduler, the global
step, the data position, every RNG stream (sampling uses torch's) and the state of the LLDMonitor
(phase detector) and GradientSpikeGuard (window of gradient norms) callbacks, and with dynamic sampling
the refill stream's position. The run directory is found
by ``--ckpt_path last`` although the CSV logger numbers its runs (lldslight.run.checkpoint_io); the resumed
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
  optim: {{warmup_steps: 3}}
"""
DYNAMIC = """    - class_path: lldslight.callbacks.SearchRolloutOptions
      init_args: {dynamic_sampling: {enabled: true, max_rounds: 3}}
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
def test_a_kill_between_a_checkpoint_and_its_row_keeps_one_row_a_step(tmp_path):
    """SIGKILL after step 1's last.ckpt was renamed into place and before its metrics row was
    written: the resumed run starts at step 2, so without the row saved in the checkpoint
    (lldslight/callbacks/step_row.py) step 1 had no row anywhere."""
    full_dir, run_dir = tmp_path / "full", tmp_path / "run"
    full = fit(tmp_path, "full", full_dir)
    assert full.returncode == 0, full.stderr[-3000:]
    kill = (f"trainer:\n  logger:\n    class_path: run_helpers.KillBeforeRow\n    init_args: {{save_dir: {run_dir}, name: tiny, "
            "flush_logs_every_n_steps: 1, kill_step: 1}\n")
    killed = fit(tmp_path, "killed", run_dir, args=("--config", kill))
    assert killed.returncode == -9, f"expected SIGKILL, got {killed.returncode}\n{killed.stderr[-3000:]}"
    ckpts = run_dir / "tiny" / "version_0" / "checkpoints"
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 2
    assert sorted(metrics(run_dir / "tiny" / "version_0" / "metrics.csv")) == [0]  # step 1's row never written

    resumed = fit(tmp_path, "resumed", run_dir, args=("--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the metrics of step 1 were not written before the run stopped; written now" in resumed.stderr
    want = metrics(full_dir / "tiny" / "version_0" / "metrics.csv")
    before = metrics(run_dir / "tiny" / "version_0" / "metrics.csv")
    after = metrics(run_dir / "tiny" / "version_1" / "metrics.csv")
    assert sorted(before) == [0] and sorted(after) == list(range(1, STEPS)), (sorted(before), sorted(after))
    got = {**before, **after}
    for step in range(STEPS):
        keys = {k for k in want[step] if k.startswith(("train/", "lld/", "rollout/"))}
        assert keys == {k for k in got[step] if k.startswith(("train/", "lld/", "rollout/"))}, (step, keys ^ set(got[step]))
        for key in sorted(keys):
            a, b = want[step][key], got[step][key]
            assert a == b or (math.isnan(a) and math.isnan(b)), (step, key, a, b)


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


# --------------------------------------------------------------------------- settings that differ (issue 23)

RESUME_HEAD = TINY_RUN_HEAD + """        reward: {{class_path: run_helpers.ParityReward}}
        rollout: {{group_size: 2, max_turns: 1, max_new_tokens: 8, max_obs_tokens: 24, max_response_tokens: 60, topk: 1}}
{extra}    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{save_last: true, every_n_train_steps: 1}}
model:
  optim: {{lr: 1.0e-3, warmup_steps: 4}}
"""


def resume_fit(tmp: Path, name: str, save_dir: Path, steps: int, *args: str, extra: str = "") -> subprocess.CompletedProcess:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(RESUME_HEAD.format(steps=steps, save_dir=save_dir, extra=extra))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", "configs/tiny.yaml", "--config", str(cfg), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def resume_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[lldslight] resuming from")]


@pytest.mark.slow
def test_a_resume_names_every_setting_it_takes_from_the_checkpoint(tmp_path):
    """LightningCLI merges the checkpoint's hyper-parameters over the command line. A plain resume
    stays exact (the checkpoint's values win) and says, in one line, each value that differs from
    the command line; ``--resume_override`` uses yours, and the scheduler restarts from your lr.
    The first run's rate was halved in flight (HalveLR, at step 1): a plain resume keeps it."""
    run = tmp_path / "run"
    halve = "    - class_path: resume_helpers.HalveLR\n      init_args: {step: 1}\n"
    first = resume_fit(tmp_path, "first", run, 2, extra=halve)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["hyper_parameters"]["optim"]["lr"] == 1e-3 and saved["lr_schedulers"][0]["base_lrs"] == [5e-4]

    # warm-up factor at step 2 (0-based) with warmup_steps 4: min(1, 3/4); train/lr is logged in float32
    plain = resume_fit(tmp_path, "plain", run, 3, "--ckpt_path", "last", "--model.optim.lr", "3e-4", "--model.update.clip_eps", "0.1",
                       "--model.policy.lora.r", "8")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert resume_lines(plain) == [
        f"[lldslight] resuming from {ckpt}: 3 setting(s) taken from the checkpoint, not your config: "
        "model.optim.lr=0.001 (yours: 0.0003), model.policy.lora.r=4 (yours: 8), model.update.clip_eps=0.2 (yours: 0.1); "
        "--resume_override model.optim.lr,model.policy.lora.r,model.update.clip_eps (or all) uses yours"]
    step2 = metrics(run / "tiny" / "version_1" / "metrics.csv")[2]
    assert step2["train/lr"] == pytest.approx(5e-4 * 0.75, rel=1e-6), "a plain resume must keep the rate the run had (halved in flight)"

    override = resume_fit(tmp_path, "override", run, 3, "--ckpt_path", str(ckpt), "--model.optim.lr", "3e-4",
                          "--model.update.clip_eps", "0.1", "--resume_override", "model.optim.lr")
    assert override.returncode == 0, override.stderr[-3000:]
    assert resume_lines(override) == [
        f"[lldslight] resuming from {ckpt}: 1 setting(s) taken from the checkpoint, not your config: "
        "model.update.clip_eps=0.2 (yours: 0.1); yours by --resume_override: model.optim.lr=0.0003 (checkpoint: 0.001); "
        "--resume_override model.update.clip_eps (or all) uses yours"]
    step2 = metrics(run / "tiny" / "version_2" / "metrics.csv")[2]
    assert step2["train/lr"] == pytest.approx(3e-4 * 0.75, rel=1e-6), "the scheduler must restart from the new base rate"
    assert torch.load(run / "tiny" / "version_2" / "checkpoints" / "last.ckpt", weights_only=True)["lr_schedulers"][0]["base_lrs"] == [3e-4]

    # Your LoRA rank on purpose: the checkpoint's adapter cannot load into it; one line naming it, and
    # the failed start leaves no empty version directory behind.
    versions = sorted(p.name for p in (run / "tiny").iterdir())
    bad = resume_fit(tmp_path, "bad", run, 3, "--ckpt_path", str(ckpt), "--model.policy.lora.r", "8", "--resume_override", "all")
    assert bad.returncode == 2
    errors = [line for line in bad.stderr.splitlines() if line.startswith("lldslight fit: error:")]
    assert len(errors) == 1 and f"checkpoint {ckpt} does not fit the model" in errors[0], bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr
    assert sorted(p.name for p in (run / "tiny").iterdir()) == versions
