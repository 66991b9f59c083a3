"""A tiny `lldslight fit` with the alarm and Heal composed in YAML (configs/heal.yaml's layout, at
tiny scale): a forced alarm heals the run, which carries on to max_steps; a `--ckpt_path last`
resume through the CLI keeps the healed rate and updates per rollout batch."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from run_helpers import TINY_RUN_HEAD

ROOT = Path(__file__).resolve().parents[1]

CONFIG = TINY_RUN_HEAD + """        reward: {{class_path: run_helpers.ParityReward}}
        rollout: {{group_size: 2, max_turns: 1, max_new_tokens: 8, max_obs_tokens: 32, max_response_tokens: 60, topk: 1, temperature: 1.0}}
    - class_path: lldslight.callbacks.LLDMonitor
      init_args: {{plot: false}}
    - class_path: heal_run_helpers.ForceMetric
      init_args: {{key: train/answered_rate, values: {{0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0}}}}
    - class_path: lldslight.callbacks.CollapseAlarm
      init_args:
        rule: {{signals: [answered_rate, tool_call_rate], baseline_start: 0, baseline_end: 3, baseline_min: 2, votes: 1, consecutive: 1, h: 1.0}}
    - class_path: lldslight.callbacks.Heal
      init_args: {{every: 1, depth: 5, margin: 1, max_heals: 1, lr_factor: 0.5, end_warmup: true, updates_factor: 0.5}}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{save_last: true, every_n_train_steps: 1}}
model:
  optim:
    warmup_steps: 20   # a rising rate: the held one differs from what the warm-up would give after the resume
"""
LR = 1e-3  # configs/tiny.yaml


def fit(tmp: Path, steps: int, *args: str) -> subprocess.CompletedProcess:
    cfg = tmp / f"run{steps}.yaml"
    cfg.write_text(CONFIG.format(steps=steps, save_dir=tmp / "runs"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", "configs/tiny.yaml", "--config", str(cfg), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def metrics(path: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            out.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    return out


def test_configs_heal_yaml_builds_its_callbacks():
    from lldslight.science.alarm import AlarmConfig
    from lldslight.callbacks import CollapseAlarm, Heal

    alarm, heal = yaml.safe_load((ROOT / "configs" / "heal.yaml").read_text())["trainer"]["callbacks+"]
    assert alarm["class_path"] == "lldslight.callbacks.CollapseAlarm" and heal["class_path"] == "lldslight.callbacks.Heal"
    rule = AlarmConfig(**alarm["init_args"]["rule"])
    assert rule == AlarmConfig()  # the YAML spells out the defaults, nothing else
    CollapseAlarm(rule=rule)
    Heal(**heal["init_args"])


@pytest.mark.slow
def test_a_healed_tiny_fit_carries_on_and_a_cli_resume_keeps_the_remedies(tmp_path):
    first = fit(tmp_path, 6)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert "COLLAPSE ALARM at step 3" in out, out[-3000:]
    assert "HEAL 1/1 at step 3: rolled back to the snapshot of step 2" in out, out[-3000:]
    run = tmp_path / "runs" / "tiny" / "version_0"
    m = metrics(run / "metrics.csv")
    assert sorted(s for s in m if "train/loss" in m[s]) == list(range(6))  # the run went on to max_steps
    assert m[3]["heal/count"] == 1 and m[3]["heal/rolled_back_to"] == 2 and m[3]["heal/updates_per_rollout"] == 1
    assert m[3]["train/lr"] == pytest.approx(LR * 4 / 20)
    healed = 0.5 * LR * 5 / 20  # half the rate step 3 ended with (the warm-up's next value), held
    assert m[3]["heal/lr"] == pytest.approx(healed) and [m[s]["train/lr"] for s in (4, 5)] == [pytest.approx(healed)] * 2

    resumed = fit(tmp_path, 8, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "remedies in force again" in resumed.stdout, resumed.stdout[-3000:]
    m2 = metrics(tmp_path / "runs" / "tiny" / "version_1" / "metrics.csv")
    assert sorted(s for s in m2 if "train/loss" in m2[s]) == [6, 7]
    # The restored warm-up lambda alone would give healed x 8/20 at step 7.
    assert [m2[s]["train/lr"] for s in (6, 7)] == [pytest.approx(healed)] * 2
