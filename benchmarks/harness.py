"""Timing that a busy machine cannot fool: load records, busy flags, bounded repeats, alternating
rounds, medians and spread. Shared by step.py, generation.py, host_overhead.py and retrieval.py.

Every timed run is wrapped in a ``LoadMeter``. It records the 1/5/15-minute load average at start
and end, and the CPU seconds that processes OUTSIDE the benchmark's own process tree used during
the run: the machine's busy time (``/proc/stat``: user + nice + system + irq + softirq, summed
over cores) minus the benchmark tree's own CPU time (the root process, its live descendants, and
the children they reaped during the run). Taking the machine's total rather than summing
``/proc/*/stat`` also catches processes that started and ended inside the run and kernel work,
which a per-process sum misses. Hypervisor steal time is recorded beside it.

A run is flagged busy when the other processes used more than ``quiet_threshold`` of one core on
average during it (default 0.10: on a 2-core machine even a tenth of a core stalls the OpenMP
barriers of a 2-thread run), or, when ``max_load`` is set, when the 1-minute load average at the
start was above it (off by default: the benchmark's own previous run raises it). A flagged run is
repeated (``retries`` times at most, after waiting up to ``settle_s`` for the machine to go quiet);
the last attempt is kept, flagged or not, and every attempt is written to the JSON.

Sides are run in alternating rounds (A B A B ...), so a drift in load hits both alike. Reported
per side: the median over rounds and the spread (min, max, quartiles); for the A/B ratio, both the
ratio of the medians (the headline) and each round's own ratio with its spread.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import psutil

QUIET_THRESHOLD = 0.10  # cores of other processes' CPU, averaged over a run
MIN_ROUNDS = 3


@dataclass
class LoadRecord:
    """What else the machine did during one timed run."""

    wall_s: float
    other_cpu_s: float  # CPU seconds of processes outside the measured tree
    own_cpu_s: float  # CPU seconds of the measured tree (root, descendants, their reaped children)
    steal_s: float  # hypervisor steal, all cores
    loadavg_start: tuple[float, float, float]
    loadavg_end: tuple[float, float, float]
    top_others: list[tuple[str, float]] = field(default_factory=list)  # (name[pid], CPU s) of the busiest others

    @property
    def other_cores(self) -> float:
        """Other processes' CPU as a number of cores kept busy on average."""
        return self.other_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def busy(self, quiet_threshold: float = QUIET_THRESHOLD, max_load: Optional[float] = None) -> bool:
        return self.other_cores > quiet_threshold or (max_load is not None and self.loadavg_start[0] > max_load)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "other_cores": self.other_cores}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoadRecord":
        keys = cls.__dataclass_fields__
        return cls(**{k: (tuple(v) if k.startswith("loadavg") else v) for k, v in d.items() if k in keys})


def combine(records: list[LoadRecord]) -> LoadRecord:
    """Several consecutive timed pieces (e.g. the measured steps of one run) as one record."""
    if not records:
        raise ValueError("combine() needs at least one LoadRecord")
    tops: dict[str, float] = {}
    for r in records:
        for name, s in r.top_others:
            tops[name] = tops.get(name, 0.0) + s
    return LoadRecord(
        wall_s=sum(r.wall_s for r in records),
        other_cpu_s=sum(r.other_cpu_s for r in records),
        own_cpu_s=sum(r.own_cpu_s for r in records),
        steal_s=sum(r.steal_s for r in records),
        loadavg_start=records[0].loadavg_start,
        loadavg_end=records[-1].loadavg_end,
        top_others=sorted(tops.items(), key=lambda x: -x[1])[:3],
    )


def _machine_busy_s() -> tuple[float, float]:
    """(busy CPU seconds since boot over all cores, steal seconds)."""
    t = psutil.cpu_times()
    # On Linux guest time is already inside user; iowait and idle are not busy.
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, getattr(t, "steal", 0.0)


def _tree(root: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(root)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tree_cpu_s(root: int) -> dict[int, float]:
    """CPU seconds per live process of the tree, each including the children it has reaped (so a
    child that ends during the run moves its time into its parent's count instead of vanishing)."""
    out = {}
    for p in _tree(root):
        try:
            c = p.cpu_times()
            out[p.pid] = c.user + c.system + c.children_user + c.children_system
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    return out


def _all_cpu_s(exclude: set[int]) -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        if p.pid in exclude or p.info["cpu_times"] is None:
            continue
        c = p.info["cpu_times"]
        out[p.pid] = (f"{p.info['name']}[{p.pid}]", c.user + c.system)
    return out


class LoadMeter:
    """Context manager around one timed run: ``with LoadMeter() as m: ...; m.record``.

    ``root``: pid of the benchmark's own process tree (default: this process). ``top``: also name
    the busiest other processes (costs a pass over /proc at start and end, ~10 ms).
    """

    def __init__(self, root: Optional[int] = None, top: bool = True) -> None:
        self.root = os.getpid() if root is None else root
        self.top = top
        self.record: Optional[LoadRecord] = None

    def start(self) -> "LoadMeter":
        self._load0 = os.getloadavg()
        self._own0 = _tree_cpu_s(self.root)
        self._procs0 = _all_cpu_s(set(self._own0)) if self.top else {}
        self._busy0, self._steal0 = _machine_busy_s()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> LoadRecord:
        wall = time.perf_counter() - self._t0
        busy1, steal1 = _machine_busy_s()
        own1 = _tree_cpu_s(self.root)
        # A member that ended during the run was reaped by its parent in the tree, whose children_*
        # time now holds its whole life: the difference of the sums is the tree's CPU in the run.
        own = sum(own1.values()) - sum(self._own0.values())
        tops = []
        if self.top:
            procs1 = _all_cpu_s(set(own1) | set(self._own0))
            deltas = [(name, s - self._procs0.get(pid, (name, 0.0))[1]) for pid, (name, s) in procs1.items()]
            tops = [(n, round(d, 3)) for n, d in sorted(deltas, key=lambda x: -x[1])[:3] if d > 0]
        total = busy1 - self._busy0
        self.record = LoadRecord(
            wall_s=wall,
            other_cpu_s=max(0.0, total - max(own, 0.0)),
            own_cpu_s=max(own, 0.0),
            steal_s=steal1 - self._steal0,
            loadavg_start=self._load0,
            loadavg_end=os.getloadavg(),
            top_others=tops,
        )
        return self.record

    def __enter__(self) -> "LoadMeter":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def other_cores_now(sample_s: float = 1.0, root: Optional[int] = None) -> float:
    """Other processes' CPU (cores) over the next ``sample_s`` seconds."""
    with LoadMeter(root, top=False) as m:
        time.sleep(sample_s)
    return m.record.other_cores  # type: ignore[union-attr]


def wait_for_quiet(quiet_threshold: float = QUIET_THRESHOLD, timeout_s: float = 60.0, sample_s: float = 1.0) -> bool:
    """Sleep in ``sample_s`` windows until one is quiet or ``timeout_s`` passes; True if quiet."""
    deadline = time.monotonic() + timeout_s
    while True:
        if other_cores_now(sample_s) <= quiet_threshold:
            return True
        if time.monotonic() >= deadline:
            return False


# -- alternating rounds ------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One timed run: the figures it produced and the load around it."""

    side: str
    round: int
    attempt: int
    metrics: dict[str, Any]
    load: LoadRecord
    busy: bool
    kept: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"side": self.side, "round": self.round, "attempt": self.attempt, "busy": self.busy, "kept": self.kept,
                "metrics": self.metrics, "load": self.load.to_dict()}


@dataclass
class Policy:
    """When a run counts as busy and what to do about it."""

    quiet_threshold: float = QUIET_THRESHOLD
    max_load: Optional[float] = None
    repeat: bool = True
    retries: int = 2
    settle_s: float = 30.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def metered(fn: Callable[[], Any]) -> tuple[Any, LoadRecord]:
    """``fn()`` under a LoadMeter: (its value, the load around it)."""
    with LoadMeter() as m:
        value = fn()
    return value, m.record  # type: ignore[return-value]


def until_quiet(run: Callable[[], tuple[Any, LoadRecord]], policy: Policy, log: Callable[[str], None], tag: str,
                describe: Callable[[Any], str] = lambda value: "") -> list[tuple[Any, LoadRecord, bool]]:
    """``run()`` once, then again while it was busy (``policy.retries`` times at most, waiting up to
    ``policy.settle_s`` for quiet first) when ``policy.repeat``. Every attempt, the last one kept."""
    out = []
    for k in range(1 + (policy.retries if policy.repeat else 0)):
        value, load = run()
        busy = load.busy(policy.quiet_threshold, policy.max_load)
        out.append((value, load, busy))
        note = describe(value)
        log(f"[harness] {tag}: {note}{' ' if note else ''}other processes {load.other_cores:.2f} cores, "
            f"load {load.loadavg_start[0]:.2f}" + (f" BUSY ({', '.join(f'{n} {s:.1f}s' for n, s in load.top_others)})" if busy else ""))
        if not busy or not policy.repeat or k == policy.retries:
            break
        if policy.settle_s > 0 and not wait_for_quiet(policy.quiet_threshold, policy.settle_s):
            log(f"[harness] still busy after {policy.settle_s:.0f} s; repeating anyway")
    return out


def _stderr(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def alternate(
    sides: list[str],
    run: Callable[[str], tuple[dict[str, Any], LoadRecord]],
    rounds: int,
    policy: Policy = Policy(),
    log: Callable[[str], None] = _stderr,
    describe: Callable[[str, dict[str, Any]], str] = lambda side, m: "",
) -> list[Attempt]:
    """Run every side once per round, in the same order each round (A B A B ...). ``run(side)``
    returns (figures, LoadRecord of the timed part). A busy run is repeated at once (after waiting
    for quiet) up to ``policy.retries`` times when ``policy.repeat``; the last attempt is kept."""
    if rounds < MIN_ROUNDS:
        log(f"[harness] {rounds} round(s): fewer than {MIN_ROUNDS}, so these figures are a smoke test, not a result")
    attempts: list[Attempt] = []
    for r in range(rounds):
        for side in sides:
            tries = until_quiet(lambda: run(side), policy, log, f"round {r + 1}/{rounds} {side}", lambda m: describe(side, m))
            for k, (metrics, load, busy) in enumerate(tries):
                attempts.append(Attempt(side, r, k, metrics, load, busy, kept=k == len(tries) - 1))
    return attempts


def kept(attempts: list[Attempt], side: str) -> list[Attempt]:
    return sorted((a for a in attempts if a.kept and a.side == side), key=lambda a: a.round)


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (inclusive method: the quartiles of n=3 are the midpoints)."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0, "median": float("nan"), "min": float("nan"), "max": float("nan"), "q1": float("nan"), "q3": float("nan")}
    q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else (vals[0], vals[0], vals[0])
    return {"n": len(vals), "median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1, "q3": q3}


def side_summary(attempts: list[Attempt], side: str, keys: list[str]) -> dict[str, dict[str, float]]:
    runs = kept(attempts, side)
    return {k: spread([a.metrics[k] for a in runs if k in a.metrics]) for k in keys}


def ratio_summary(attempts: list[Attempt], a: str, b: str, key: str) -> dict[str, Any]:
    """``a``/``b`` for ``key``: the ratio of the medians, and each round's own ratio (a and b of
    the same round) with its spread."""
    ra, rb = kept(attempts, a), kept(attempts, b)
    med_a = statistics.median(x.metrics[key] for x in ra)
    med_b = statistics.median(x.metrics[key] for x in rb)
    per_round = [x.metrics[key] / y.metrics[key] for x, y in zip(ra, rb) if y.metrics[key]]
    return {"ratio_of_medians": med_a / med_b if med_b else float("nan"), "per_round": per_round, "spread": spread(per_round)}


def quiet_summary(attempts: list[Attempt], policy: Policy) -> dict[str, Any]:
    k = [a for a in attempts if a.kept]
    busy = [a for a in k if a.busy]
    return {
        "quiet": not busy,
        "kept_runs": len(k),
        "kept_busy_runs": len(busy),
        "repeated_runs": sum(1 for a in attempts if not a.kept),
        "max_other_cores": max((a.load.other_cores for a in k), default=0.0),
        "loadavg_start_max": max((a.load.loadavg_start[0] for a in k), default=0.0),
        "policy": policy.to_dict(),
    }


def fmt_spread(s: dict[str, float], fmt: str = "{:.2f}") -> str:
    """``median [min-max]``: what every table prints for a side."""
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def quiet_line(q: dict[str, Any]) -> str:
    if q["quiet"]:
        return (f"quiet: all {q['kept_runs']} kept runs clean (other processes <= {q['policy']['quiet_threshold']:.2f} cores; "
                f"{q['repeated_runs']} busy run(s) repeated; max load average at start {q['loadavg_start_max']:.2f})")
    return (f"NOT QUIET: {q['kept_busy_runs']} of {q['kept_runs']} kept runs were taken on a busy machine (other processes up to "
            f"{q['max_other_cores']:.2f} cores, threshold {q['policy']['quiet_threshold']:.2f}): do not quote these figures")


def add_arguments(p: Any) -> None:
    """The harness's command-line knobs, the same in every benchmark."""
    p.add_argument("--quiet-threshold", type=float, default=QUIET_THRESHOLD,
                   help="a run is busy when other processes used more than this many cores on average during it")
    p.add_argument("--max-load", type=float, default=None,
                   help="also flag a run whose 1-minute load average at start exceeds this (off by default: the "
                        "benchmark's own previous run raises it)")
    p.add_argument("--no-repeat", action="store_true", help="keep busy runs (flagged) instead of repeating them")
    p.add_argument("--retries", type=int, default=2, help="repeats of a busy run at most")
    p.add_argument("--settle", type=float, default=30.0, help="seconds to wait for quiet before repeating a busy run")


def policy_from_args(args: Any) -> Policy:
    return Policy(quiet_threshold=args.quiet_threshold, max_load=args.max_load, repeat=not args.no_repeat,
                  retries=args.retries, settle_s=args.settle)
