"""benchmarks/harness.py: load accounting against real processes (a busy loop outside the
benchmark's tree is counted and flags the run; one inside it is the benchmark's own time), and
the alternation, repeat and median/spread logic on hand-made numbers."""
import os
import resource
import subprocess
import sys
import time

import pytest
from conftest import load_benchmark

BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


@pytest.fixture(scope="module")
def harness():
    return load_benchmark("harness")


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of one process from /proc/<pid>/stat (fields 14 and 15, after the comm)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _orphan_busy_loop() -> int:
    """A busy loop that is NOT in this process's tree: started through a shell that exits at once,
    so the loop is re-parented away from us (as another user's job would be)."""
    cmd = " ".join(BUSY_LOOP[:2]) + " '" + BUSY_LOOP[2] + "' >/dev/null 2>&1 & echo $!"
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_a_busy_loop_outside_the_tree_is_counted_and_flags_the_run(harness):
    pid = _orphan_busy_loop()
    try:
        time.sleep(0.2)
        assert pid not in {p.pid for p in __import__("psutil").Process().children(recursive=True)}
        # The loop's own clock is read inside the meter's window, so the window holds all of it
        # (read outside, the loop's time between the reads and the window's edges is counted too).
        with harness.LoadMeter() as m:
            before = _proc_cpu_s(pid)
            time.sleep(1.5)
            loop_s = _proc_cpu_s(pid) - before
    finally:
        os.kill(pid, 9)
    rec = m.record
    assert loop_s > 0.1  # it ran (even on a busy 2-core machine it gets a share of a core)
    # The loop is one of the "other" processes: the machine-wide count holds at least its time
    # (10 ms ticks on both sides, hence the margin).
    assert rec.other_cpu_s >= loop_s - 0.05
    assert rec.own_cpu_s < 0.3  # we slept
    assert rec.busy(0.05)
    assert any(name.startswith("python") for name, _ in rec.top_others)


def test_a_busy_loop_inside_the_tree_is_the_benchmarks_own_time(harness):
    with harness.LoadMeter() as m:
        child = subprocess.Popen(BUSY_LOOP)
        time.sleep(1.5)
        child.kill()
        _, _, usage = os.wait4(child.pid, 0)  # the kernel's own account of the child, reaped here
    child_s = usage.ru_utime + usage.ru_stime
    rec = m.record
    assert child_s > 0.1
    # Counted as ours, within the 10 ms tick resolution plus this process's own few ms.
    assert child_s - 0.05 <= rec.own_cpu_s <= child_s + 0.3


def test_nothing_running_is_not_flagged(harness):
    with harness.LoadMeter() as m:
        time.sleep(1.0)
    rec = m.record
    if rec.other_cores > harness.QUIET_THRESHOLD:
        pytest.skip(f"other processes use {rec.other_cores:.2f} cores right now (shared machine): "
                    "the not-flagged case is checked by the own-tree test and the logic test")
    assert not rec.busy()
    # And our own work, however heavy, does not make a run busy.
    with harness.LoadMeter() as m:
        child = subprocess.Popen(BUSY_LOOP)
        time.sleep(1.0)
        child.kill()
        child.wait()
    if m.record.other_cores <= harness.QUIET_THRESHOLD:
        assert not m.record.busy()


def _rec(harness, other_cores, load=0.5, wall=10.0):
    return harness.LoadRecord(wall_s=wall, other_cpu_s=other_cores * wall, own_cpu_s=wall, steal_s=0.0,
                              loadavg_start=(load, load, load), loadavg_end=(load, load, load))


def test_busy_threshold_and_load_limit(harness):
    assert not _rec(harness, 0.10).busy(0.10)  # at the threshold: quiet
    assert _rec(harness, 0.11).busy(0.10)
    assert not _rec(harness, 0.0, load=3.0).busy(0.10)  # load average alone: off by default
    assert _rec(harness, 0.0, load=3.0).busy(0.10, max_load=2.0)
    both = harness.combine([_rec(harness, 0.0, wall=9.0), _rec(harness, 1.0, wall=1.0)])
    assert both.wall_s == 10.0 and both.other_cores == pytest.approx(0.1)  # time-weighted, not averaged


def test_alternation_repeats_busy_runs_and_keeps_the_last(harness):
    # Each side's runs in call order, as (step_s, other cores): B's round-2 run is busy once (its
    # retry is kept); A's round-3 run is busy three times (2 retries, then kept, flagged).
    def scripted():
        queue = {"A": [(10.0, 0.0), (12.0, 0.0), (11.0, 0.8), (11.0, 0.7), (11.0, 0.6)],
                 "B": [(20.0, 0.0), (22.0, 0.9), (22.0, 0.0), (30.0, 0.0)]}
        calls = []

        def run(side):
            calls.append(side)
            value, other = queue[side].pop(0)
            return {"step_s": value}, _rec(harness, other)
        return run, calls

    run, calls = scripted()
    policy = harness.Policy(quiet_threshold=0.1, retries=2, settle_s=0)
    attempts = harness.alternate(["A", "B"], run, rounds=3, policy=policy, log=lambda s: None)
    assert calls == ["A", "B", "A", "B", "B", "A", "A", "A", "B"]
    kept = [a for a in attempts if a.kept]
    assert [(a.side, a.round, a.attempt, a.busy) for a in kept] == [
        ("A", 0, 0, False), ("B", 0, 0, False), ("A", 1, 0, False), ("B", 1, 1, False), ("A", 2, 2, True), ("B", 2, 0, False)]
    q = harness.quiet_summary(attempts, policy)
    assert q["quiet"] is False and q["kept_busy_runs"] == 1 and q["repeated_runs"] == 3

    run, calls = scripted()
    no_repeat = harness.Policy(quiet_threshold=0.1, repeat=False, settle_s=0)
    attempts = harness.alternate(["A", "B"], run, rounds=3, policy=no_repeat, log=lambda s: None)
    assert calls == ["A", "B"] * 3 and all(a.kept for a in attempts)
    assert [a.busy for a in attempts] == [False, False, False, True, True, False]


def test_medians_spread_and_ratios_by_hand(harness):
    attempts = []
    for r, (a, b) in enumerate([(10.0, 20.0), (12.0, 22.0), (11.0, 30.0)]):
        attempts.append(harness.Attempt("A", r, 0, {"step_s": a}, _rec(harness, 0.0), False, kept=True))
        attempts.append(harness.Attempt("B", r, 0, {"step_s": b}, _rec(harness, 0.0), False, kept=True))
    attempts.append(harness.Attempt("A", 1, 0, {"step_s": 99.0}, _rec(harness, 1.0), True, kept=False))  # a repeated run: ignored
    s = harness.side_summary(attempts, "A", ["step_s"])["step_s"]
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 11.0, 10.0, 12.0)
    assert (s["q1"], s["q3"]) == (10.5, 11.5)  # inclusive quartiles of 10, 11, 12
    ratio = harness.ratio_summary(attempts, "A", "B", "step_s")
    assert ratio["ratio_of_medians"] == pytest.approx(11.0 / 22.0)
    assert ratio["per_round"] == pytest.approx([0.5, 12 / 22, 11 / 30])  # each round's own A/B
    assert ratio["spread"]["median"] == pytest.approx(0.5)
    assert ratio["spread"]["min"] == pytest.approx(11 / 30) and ratio["spread"]["max"] == pytest.approx(12 / 22)
    four = harness.spread([4.0, 1.0, 3.0, 2.0])
    assert (four["median"], four["q1"], four["q3"]) == (2.5, 1.75, 3.25)
