"""End to end through the CLI: a two-step fit on tiny.yaml, a validate run from its checkpoint,
and a user's own callback plugged in from YAML."""
import csv
from pathlib import Path

import pytest
import torch

from lldslight.cli import main
from tests.conftest import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("fit")
    table = work / "table.yaml"
    table.write_text(
        "trainer:\n  callbacks+:\n    - class_path: callbacks.trajectory_table.TrajectoryTable\n"
        "      init_args: {every_n_steps: 1, num_samples: 3}\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.syspath_prepend(str(ROOT))
        assert main(["fit", "--config", TINY, "--config", str(table), "--trainer.max_steps", "2"]) == 0
    return work / "runs" / "tiny" / "version_0"


def test_two_step_fit_writes_metrics_and_adapter_checkpoint(tiny_run):
    rows = [r for r in _rows(tiny_run) if r.get("train/reward")]
    assert [int(r["step"]) for r in rows] == [0, 1]
    for r in rows:
        for key in ("train/reward", "train/em", "train/searches", "train/response_len", "train/valid_action_rate",
                    "train/clip_frac", "train/ratio_max", "train/kl", "train/entropy", "train/grad_norm", "train/lr",
                    "time/rollout_s", "time/logprob_s", "time/update_s"):
            assert r[key] != "", key
        assert 0.0 <= float(r["train/reward"]) <= 1.0
        assert float(r["train/entropy"]) > 0
    ckpt = torch.load(tiny_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert keys and all("lora_" in k for k in keys), "checkpoint must hold the adapter only"
    assert ckpt["global_step"] == 2


def test_user_callback_wrote_trajectory_tables(tiny_run):
    """Named by its old path (callbacks.trajectory_table), the library's per-turn table still loads
    from YAML; a file per step at the steps metrics.csv logs (0-based). tests/test_traces.py checks
    the rows themselves, in TensorBoard and W&B."""
    tables = sorted((tiny_run / "trajectories").glob("step_*.md"))
    assert [t.name for t in tables] == ["step_000000.md", "step_000001.md"]
    lines = tables[0].read_text().splitlines()
    assert lines[0] == "# Trajectories at step 0"
    assert lines[2].startswith("| step | rollout | group | turn | question | gold | action | kind | query | observation")
    rows = lines[4:]
    assert len(rows) >= 3 and all(r.startswith("| 0 | ") for r in rows)  # at least a turn for each of 3 rollouts
    assert len({r.split(" | ")[1] for r in rows}) == 3


def test_validate_from_checkpoint(tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_run.parents[2])
    ckpt = str(tiny_run / "checkpoints" / "last.ckpt")
    assert main(["validate", "--config", TINY, "--ckpt_path", ckpt, "--trainer.logger.init_args.name", "val"]) == 0
    run = tiny_run.parents[2] / "runs" / "val" / "version_0"
    rows = [r for r in _rows(run) if r.get("val/em")]
    assert len(rows) == 1
    assert 0.0 <= float(rows[0]["val/em"]) <= 1.0
    assert rows[0]["val/n"] and float(rows[0]["val/n"]) == 6  # every dev example exactly once
    per_source = [k for k in rows[0] if k.startswith("val/em/synth_")]
    assert per_source, "EM per data_source is logged"
    # the report is named after the checkpoint's step (2), not validate's own global_step (0)
    assert sorted(p.name for p in run.glob("val_step*")) == ["val_step2.json", "val_step2.md"]
