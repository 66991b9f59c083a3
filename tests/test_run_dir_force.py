"""``--force`` and a run directory that already holds a run (docs/errors_and_resume.md, "Nothing is
overwritten without --force"): ``--force`` is a flag (``--force true`` still works); what it replaces
is listed in one line before anything is removed, and nothing of the earlier run is left beside the
new one (its ``last.ckpt`` would be resumed by ``--ckpt_path last``); a ``fit`` that resumes its own
run (a checkpoint inside the run directory) continues it, keeping every metrics row it logged.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch

from tests.test_bad_input import TINY, assert_one_line_error, run_cli, tiny_config, unloadable_model, work  # noqa: F401
from tests.test_bad_input_more import finished_run, fit_args


def force_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith("[lldslight] --force:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("flag", [["--force"], ["--force", "true"], ["--force=true"]], ids=["flag", "true", "equals"])
def test_force_is_a_flag_and_lists_what_it_replaces(work, unloadable_model, capsys, tmp_path, flag):
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model)
    files = finished_run(tmp_path)
    run = tmp_path / "tiny" / "version_0"
    (run / "notes.txt").write_text("mine")
    code, err = run_cli(fit_args(cfg, tmp_path, "--trainer.logger.init_args.version", "0", *flag), work, capsys)
    # past the run directory's check: the next to fail is the unloadable weights'
    assert_one_line_error(code, err, "fit", "model.safetensors")
    line = force_line(err)
    for name in ("metrics.csv", "config.yaml", "checkpoints/last.ckpt", "notes.txt"):
        assert name in line, line
    assert str(run) in line and "4 files" in line, line
    assert not any(p.exists() for p in files) and not (run / "notes.txt").exists()


def test_without_force_nothing_is_removed(work, unloadable_model, capsys, tmp_path):
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model)
    files = finished_run(tmp_path)
    code, err = run_cli(fit_args(cfg, tmp_path, "--trainer.logger.init_args.version", "0", "--force", "false"), work, capsys)
    assert_one_line_error(code, err, "fit", "already holds a run", "--force")
    assert "[lldslight] --force:" not in err
    assert all(p.read_bytes() == data for p, data in files.items())


def test_force_never_removes_the_checkpoint_it_evaluates(work, capsys, tmp_path):
    """validate --force into the run directory that holds its --ckpt_path: replacing the run would
    delete the checkpoint before it is read."""
    files = finished_run(tmp_path)
    ckpt = tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0"}, ckpt)
    files[ckpt] = ckpt.read_bytes()
    code, err = run_cli(["validate", "--config", str(TINY), "--trainer.logger.init_args.save_dir", str(tmp_path),
                         "--trainer.logger.init_args.version", "0", "--ckpt_path", str(ckpt), "--force"], work, capsys)
    assert_one_line_error(code, err, "validate", f"--ckpt_path {ckpt} is inside", "another trainer.logger.init_args.version")
    assert all(p.read_bytes() == data for p, data in files.items())


def rows(path: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def train_steps(path: Path) -> list[int]:
    return [int(r["step"]) for r in rows(path) if r.get("train/reward")]


@pytest.mark.slow
def test_force_over_a_finished_run_leaves_nothing_of_it(work, capsys, tmp_path):
    """Two real runs into one fixed version: the second (--force) leaves one last.ckpt, its own
    (no last-v1.ckpt beside the old one), and a metrics.csv of its own steps only."""
    args = ["fit", "--config", str(TINY), "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--trainer.logger.init_args.version", "0"]
    code, err = run_cli(args + ["--seed_everything", "1"], work, capsys)
    assert code == 0, err[-3000:]
    run = tmp_path / "tiny" / "version_0"
    first = (run / "checkpoints" / "last.ckpt").read_bytes()
    code, err = run_cli(args + ["--force"], work, capsys)
    assert code == 0, err[-3000:]
    line = force_line(err)
    assert "checkpoints/last.ckpt" in line and "metrics.csv" in line, line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert (run / "checkpoints" / "last.ckpt").read_bytes() != first
    assert train_steps(run / "metrics.csv") == [0, 1]
    assert "seed_everything: 0" in (run / "config.yaml").read_text()


@pytest.mark.slow
def test_a_resume_of_a_named_run_keeps_its_metrics(work, capsys, tmp_path):
    """A 2-step run resumed to 3 steps (no --force needed: it continues its own run), then to 4 with
    --force (the command that lost them): the rows of the earlier steps stay, byte for byte."""
    args = ["fit", "--config", str(TINY), "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--trainer.logger.init_args.version", "0"]
    code, err = run_cli(args, work, capsys)
    assert code == 0, err[-3000:]
    metrics = tmp_path / "tiny" / "version_0" / "metrics.csv"
    before = metrics.read_text().splitlines(keepends=True)
    assert train_steps(metrics) == [0, 1]
    for steps, extra in ((3, []), (4, ["--force"])):
        code, err = run_cli(args + ["--trainer.max_steps", str(steps), "--ckpt_path", "last", *extra], work, capsys)
        assert code == 0, err[-3000:]
        assert "[lldslight] --force:" not in err
        assert train_steps(metrics) == list(range(steps))
    after = metrics.read_text().splitlines(keepends=True)
    if after[0] == before[0]:  # the same columns: the earlier rows are the very same bytes
        assert after[: len(before)] == before
    else:  # a column was added later: the file was rewritten with it, the values kept
        old = list(csv.DictReader(before))
        assert [{k: v for k, v in r.items() if k in old[0]} for r in rows(metrics)[: len(old)]] == old


def test_a_resume_drops_the_rows_of_steps_it_trains_again(tmp_path):
    """A run killed after logging steps 0-4 whose last checkpoint holds 3 steps resumes at step 3
    and logs 3 and 4 again: the earlier rows of 3 and 4 go (one row a step), 0-2 and the rows
    without a step (an evaluation's) stay, byte for byte."""
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from lldslight.run.run_dir import checkpoint_step, keep_metrics

    logger = CSVLogger(save_dir=str(tmp_path), name="run", version=0)
    run = Path(logger.log_dir)
    run.mkdir(parents=True)
    lines = ["epoch,step,train/reward,val/em\n", ",,,0.25\n"] + [f"0,{s},0.{s},\n" for s in range(5)]
    (run / "metrics.csv").write_text("".join(lines))
    ckpt = run / "last.ckpt"
    torch.save({"global_step": 3, "state_dict": {"w": torch.zeros(2)}}, ckpt)
    assert checkpoint_step(ckpt) == 3 and checkpoint_step(run / "none.ckpt") is None
    keep_metrics(logger, checkpoint_step(ckpt))
    assert (run / "metrics.csv").read_text() == "".join(lines[:5])
