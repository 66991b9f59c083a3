"""The lldslight command runs under its malloc tunables (lldslight/run/hostmem.py): it re-executes
itself once with GLIBC_TUNABLES set, keeps tunables the user set, and can be told not to."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lldslight.run import hostmem

ROOT = Path(__file__).resolve().parents[1]
# Prints the environment it starts with, then runs the command line's entry point (usage: exit 2).
PROBE = "import os, sys; print('start', os.getpid(), os.environ.get('GLIBC_TUNABLES', '')); from lldslight.cli import main; sys.exit(main())"


def _starts(extra_env: dict) -> list[tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hostmem.OPT_OUT_ENV)}
    env.update(extra_env, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]  # main() without arguments prints its usage
    return [tuple((line.split(" ", 2) + [""])[1:3]) for line in proc.stdout.splitlines() if line.startswith("start ")]


@pytest.mark.skipif(not hostmem.is_glibc(), reason="glibc only")
def test_command_line_reexecutes_once_with_the_malloc_tunables():
    starts = _starts({})
    assert len(starts) == 2, starts  # the first start, then the re-executed one
    (pid1, first), (pid2, second) = starts
    assert pid1 == pid2  # exec replaces the process: same pid, nothing left behind
    assert first == "" and set(second.split(":")) == set(hostmem.MALLOC_TUNABLES)


@pytest.mark.skipif(not hostmem.is_glibc(), reason="glibc only")
def test_user_tunables_are_kept_and_the_opt_out_is_honoured():
    starts = _starts({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=7"})
    assert len(starts) == 2
    assert set(starts[1][1].split(":")) == {"glibc.malloc.arena_max=2", *hostmem.MALLOC_TUNABLES}  # ours win
    assert len(_starts({hostmem.OPT_OUT_ENV: "default"})) == 1  # no re-execution
    assert len(_starts({"GLIBC_TUNABLES": ":".join(hostmem.MALLOC_TUNABLES)})) == 1  # already set: runs on
