"""Faults during a run (docs/errors_and_resume.md, "Faults"): SIGTERM says at once that the step in
flight is being finished and the run exits 143 after it; Ctrl-C exits 130 after Lightning's graceful
shutdown; a run directory is locked while a fit writes it; temporary checkpoint files that a killed
writer left are removed. The signals are sent to a real tiny fit in a child process.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lldslight.checkpoint_io import AtomicCheckpointIO
from lldslight.cli import SIGTERM_LINE
from lldslight.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from tests.conftest import ROOT


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


def start_fit(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lldslight.cli", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "--trainer.max_steps", "40", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
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


@pytest.mark.slow
def test_sigterm_says_it_finishes_the_step_and_a_second_fit_is_locked_out(tmp_path):
    proc, err, run = signal_fit(tmp_path, "term", signal.SIGTERM, second_fit_is_refused)
    assert proc.returncode == EXIT_TERMINATED, err[-3000:]
    assert SIGTERM_LINE in err.splitlines(), err[-3000:]
    stopped = [l for l in err.splitlines() if l.startswith("lldslight fit: stopped by SIGTERM after step ")]
    assert len(stopped) == 1 and "Traceback" not in err, err[-3000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    # the step in flight was finished and checkpointed: last.ckpt is at the step the line names
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert saved["global_step"] == step > 0
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_ctrl_c_exits_130_after_the_graceful_shutdown(tmp_path):
    proc, err, run = signal_fit(tmp_path, "int", signal.SIGINT)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    stopped = [l for l in err.splitlines() if l.startswith("lldslight fit: stopped by Ctrl-C after step ")]
    assert len(stopped) == 1 and "Traceback" not in err, err[-3000:]
    assert f"the last checkpoint is {run / 'checkpoints' / 'last.ckpt'}" in stopped[0]
    assert (run / "metrics.csv").is_file()  # the logger was flushed by the shutdown
