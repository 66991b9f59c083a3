"""Faults during a run (docs/errors_and_resume.md, "Faults"): SIGTERM during an update says at once
how long the update in flight may take and the run exits 143 after its checkpoint; SIGTERM during an
evaluation (before or after training, a validation pass, `validate`) or a step's rollout stops within
seconds, exit 143; Ctrl-C exits 130 after Lightning's graceful shutdown; a run directory is locked
while a fit writes it; temporary checkpoint files that a killed writer left are removed. The signals
are sent to a real tiny fit in a child process; a reward (or a callback) that sleeps makes the
evaluation (or the update) last minutes, so that a run that waited for it would miss the deadline.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lldslight.run import stopping
from lldslight.run.checkpoint_io import AtomicCheckpointIO
from lldslight.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from lldslight.rewards import exact_match, final_answer
from tests.conftest import ROOT

STOP_WITHIN_S = 30  # from the signal to the exit: the teardown and the interpreter's exit on a loaded machine


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_writers_temporary_file_is_removed_at_the_next_save(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    stale = directory / f".last.ckpt.tmp{dead_pid()}"
    stale.write_bytes(b"half a checkpoint")  # what a SIGKILL during torch.save leaves
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        in_progress = directory / f".last.ckpt.tmp{live.pid}"  # another process still writing
        in_progress.write_bytes(b"being written")
        AtomicCheckpointIO().save_checkpoint({"step": 3}, directory / "last.ckpt")
        assert not stale.exists() and in_progress.exists()
        assert sorted(p.name for p in directory.iterdir()) == sorted(["last.ckpt", in_progress.name])
        assert torch.load(directory / "last.ckpt", weights_only=True) == {"step": 3}
    finally:
        live.kill()
        live.wait()


def _default_sigint() -> None:
    # A suite started in the background (`bash scripts/test.sh &` from a script) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: the fit would never see the
    # Ctrl-C this file sends. The child gets the default disposition, as from a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_fit(tmp_path: Path, name: str, *args: str, config: Path = ROOT / "configs" / "tiny.yaml",
              command: str = "fit", steps: int = 40) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lldslight.cli", command, "--config", str(config),
         *(["--trainer.max_steps", str(steps)] if command == "fit" else []),
         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
         "--trainer.logger.init_args.version", name, *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[1][-3000:])
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def signal_fit(tmp_path: Path, name: str, signum: int, meanwhile=lambda proc, run: None) -> tuple[subprocess.Popen, str, Path]:
    """Start a tiny fit, wait for its first checkpoint, call ``meanwhile``, send ``signum``; the
    process (ended), its stderr and its run directory."""
    proc = start_fit(tmp_path, name)
    run = tmp_path / "runs" / "tiny" / name
    try:
        wait_for(run / "checkpoints" / "last.ckpt", proc)
        meanwhile(proc, run)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, err, run


def second_fit_is_refused(proc: subprocess.Popen, run: Path) -> None:
    """While ``proc`` writes ``run``, a second fit on it is refused in one line, before its model loads."""
    second = subprocess.run(
        [sys.executable, "-m", "lldslight.cli", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "--trainer.logger.init_args.save_dir", str(run.parents[1]), "--trainer.logger.init_args.version", run.name],
        cwd=run.parents[2], capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    errors = [l for l in second.stderr.splitlines() if l.startswith("lldslight fit: error:")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert f"run directory {run} is being written by another process (pid {proc.pid}" in errors[0]


class SlowReward:
    """Exact match, slowed from call ``after`` + 1 on: such a call touches ``marker`` (the test's cue
    that the slow part began) and sleeps ``seconds``: the evaluation or rollout it is part of lasts
    minutes, as one evaluation batch does on a loaded CPU."""

    def __init__(self, after: int = 0, marker: str = "slow.flag", seconds: float = 300.0) -> None:
        self.after, self.marker, self.seconds, self.calls = after, marker, seconds, 0

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        self.calls += 1
        if self.calls > self.after:
            Path(self.marker).touch()
            time.sleep(self.seconds)
        return exact_match(final_answer(response), golden_answers)


class HeldUpdate(pl.Callback):
    """Holds training step ``step``'s update (it runs after SearchRollout's rollout) until ``release``
    exists, having touched ``marker``: a signal sent then lands in an update."""

    def __init__(self, step: int = 2, marker: str = "update.flag", release: str = "release.flag") -> None:
        self.step, self.marker, self.release = step, marker, release

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 != self.step:
            return
        Path(self.marker).touch()
        deadline = time.monotonic() + 300
        while not Path(self.release).exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def slowed_config(tmp_path: Path, after: int, **rollout_args) -> Path:
    """configs/tiny.yaml with SlowReward from call ``after`` + 1 on (4 calls a training step: 2 prompts x
    group of 2) and the given SearchRollout arguments."""
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    args = config["trainer"]["callbacks"][0]["init_args"]
    args["reward"] = {"class_path": "tests.test_faults.SlowReward", "init_args": {"after": after}}
    args.update(rollout_args)
    path = tmp_path / "slowed.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def stop_when_slowed(tmp_path: Path, proc: subprocess.Popen, signum: int, marker: str = "slow.flag") -> tuple[str, float]:
    """Wait until the slowed part began, send ``signum``; stderr and the seconds from the signal to the exit."""
    try:
        wait_for(tmp_path / marker, proc)
        time.sleep(1.0)  # well inside the sleeping call
        sent = time.monotonic()
        proc.send_signal(signum)
        try:
            _, err = proc.communicate(timeout=2 * STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1]
            raise AssertionError(f"still running {2 * STOP_WITHIN_S} s after the signal: {err[-3000:]}") from None
        return err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()


def stopped_line(err: str, command: str, what: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith(f"lldslight {command}: stopped by {what}")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
def test_sigterm_during_the_evaluation_before_or_after_training_stops_within_seconds(tmp_path, when):
    steps = 1
    config = slowed_config(tmp_path, after=0 if when == "before" else 4 * steps, **{f"eval_{when}_fit": True})
    proc = start_fit(tmp_path, when, config=config, steps=steps)
    err, took = stop_when_slowed(tmp_path, proc, signal.SIGTERM)
    assert proc.returncode == EXIT_TERMINATED, err[-3000:]
    assert stopping.NOW.format(what=f"the evaluation {when} training") in err.splitlines(), err[-3000:]
    assert took < STOP_WITHIN_S, f"{took:.0f} s from SIGTERM to exit (the slowed evaluation would take 300 s a call)"
    line = stopped_line(err, "fit", "SIGTERM")
    run = tmp_path / "runs" / "tiny" / when
    if when == "before":
        assert line == "lldslight fit: stopped by SIGTERM after step 0; no checkpoint was written"
    else:
        ckpt = run / "checkpoints" / "last.ckpt"
        assert line.startswith(f"lldslight fit: stopped by SIGTERM after step 1; the last checkpoint is {ckpt} ")
        assert torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"] == 1


@pytest.mark.slow
def test_sigterm_during_a_validation_pass_stops_within_seconds(tmp_path):
    config = slowed_config(tmp_path, after=4)  # the first validation pass, after step 1
    proc = start_fit(tmp_path, "val", "--trainer.val_check_interval", "1", "--trainer.check_val_every_n_epoch", "null",
                     config=config, steps=3)
    err, took = stop_when_slowed(tmp_path, proc, signal.SIGTERM)
    assert proc.returncode == EXIT_TERMINATED, err[-3000:]
    assert stopping.NOW.format(what="a validation pass") in err.splitlines(), err[-3000:]
    assert took < STOP_WITHIN_S, f"{took:.0f} s from SIGTERM to exit"
    assert stopped_line(err, "fit", "SIGTERM").startswith("lldslight fit: stopped by SIGTERM after step 1; the last checkpoint is ")


@pytest.mark.slow
def test_sigterm_during_validate_stops_within_seconds(tmp_path):
    proc = start_fit(tmp_path, "validate", config=slowed_config(tmp_path, after=0), command="validate")
    err, took = stop_when_slowed(tmp_path, proc, signal.SIGTERM)
    assert proc.returncode == EXIT_TERMINATED, err[-3000:]
    assert stopping.NOW.format(what="a validation pass") in err.splitlines(), err[-3000:]
    assert took < STOP_WITHIN_S, f"{took:.0f} s from SIGTERM to exit"
    assert stopped_line(err, "validate", "SIGTERM") == (
        "lldslight validate: stopped by SIGTERM during the evaluation; its report was not written")


@pytest.mark.slow
def test_ctrl_c_during_the_evaluation_after_training_stops_within_seconds(tmp_path):
    proc = start_fit(tmp_path, "int_eval", config=slowed_config(tmp_path, after=4, eval_after_fit=True), steps=1)
    err, took = stop_when_slowed(tmp_path, proc, signal.SIGINT)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert took < STOP_WITHIN_S, f"{took:.0f} s from Ctrl-C to exit"
    assert stopped_line(err, "fit", "Ctrl-C").startswith("lldslight fit: stopped by Ctrl-C after step 1; the last checkpoint is ")


@pytest.mark.slow
def test_sigterm_after_a_steps_checkpoint_trains_no_further_step(tmp_path):
    """The signal comes once step 1 is checkpointed, while step 2 samples its rollout: the run stops
    there, after step 1 (it trained all of step 2 before)."""
    proc = start_fit(tmp_path, "next", config=slowed_config(tmp_path, after=4), steps=3)
    run = tmp_path / "runs" / "tiny" / "next"
    err, took = stop_when_slowed(tmp_path, proc, signal.SIGTERM)
    assert proc.returncode == EXIT_TERMINATED, err[-3000:]
    assert stopping.NOW.format(what="the rollout of training step 2") in err.splitlines(), err[-3000:]
    assert took < STOP_WITHIN_S, f"{took:.0f} s from SIGTERM to exit"
    line = stopped_line(err, "fit", "SIGTERM")
    assert line.startswith(f"lldslight fit: stopped by SIGTERM after step 1; the last checkpoint is {run / 'checkpoints' / 'last.ckpt'} ")
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")["global_step"] == 1


@pytest.mark.slow
def test_sigterm_during_an_update_says_how_long_it_may_take_and_a_second_fit_is_locked_out(tmp_path):
    held = ("trainer:\n  callbacks+:\n    - class_path: tests.test_faults.HeldUpdate\n      init_args: {step: 2}\n")
    proc = start_fit(tmp_path, "term", "--config", held)
    run = tmp_path / "runs" / "tiny" / "term"
    try:
        wait_for(tmp_path / "update.flag", proc)  # step 1 is checkpointed; step 2's update is held
        second_fit_is_refused(proc, run)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        (tmp_path / "release.flag").touch()
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_TERMINATED, err[-3000:]
    said = [l for l in err.splitlines() if l.startswith("[lldslight] SIGTERM: ")]
    assert len(said) == 1, err[-3000:]
    prefix, suffix = stopping.AFTER_UPDATE.split("{timing}")
    assert said[0].startswith(prefix.format(step=2)) and said[0].endswith(suffix), said
    assert re.search(r"\(it began \d+ s ago; the previous step's update and checkpoint took \d+ s\)", said[0]), said
    line = stopped_line(err, "fit", "SIGTERM")
    # the update in flight was finished and checkpointed: last.ckpt is at the step the line names
    assert line.startswith("lldslight fit: stopped by SIGTERM after step 2; ")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert saved["global_step"] == 2
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_ctrl_c_exits_130_after_the_graceful_shutdown(tmp_path):
    proc, err, run = signal_fit(tmp_path, "int", signal.SIGINT)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    stopped = [l for l in err.splitlines() if l.startswith("lldslight fit: stopped by Ctrl-C after step ")]
    assert len(stopped) == 1 and "Traceback" not in err, err[-3000:]
    assert f"the last checkpoint is {run / 'checkpoints' / 'last.ckpt'}" in stopped[0]
    assert (run / "metrics.csv").is_file()  # the logger was flushed by the shutdown
