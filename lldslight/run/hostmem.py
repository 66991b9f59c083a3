"""Host memory on Linux/glibc: the allocator settings lldslight runs with, and handing freed memory back.

PyTorch allocates CPU tensors with posix_memalign (64-byte alignment). glibc carves each aligned
block out of a larger free chunk and keeps the few leftover bytes in its per-thread cache (tcache)
and fast bins, which never merge with their neighbours; freed tensors then cannot coalesce into
blocks the next ones fit in, and the heap keeps growing into fresh pages. During a GRPO update (a
few hundred MB-sized activations freed and allocated per layer) the process's resident memory
climbed to ~3-4x its live tensors (measured on SmolLM2-135M: ~750 MB above the idle process for
~200 MB of live tensors). With both caches off (``GLIBC_TUNABLES``, below) freed blocks merge again
and the update peak follows the live tensors, at no measurable cost in speed (Python's small
objects have their own allocator). glibc reads tunables only at process start, so the ``lldslight``
command re-executes itself once with them set (``LLDSLIGHT_MALLOC=default`` keeps glibc's
defaults); a program that drives lldslight from Python can export the variable itself.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

MALLOC_TUNABLES = ("glibc.malloc.tcache_count=0", "glibc.malloc.mxfast=0")
OPT_OUT_ENV = "LLDSLIGHT_MALLOC"  # "default": leave glibc's settings alone

try:
    _LIBC: Optional[ctypes.CDLL] = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 (present on glibc only)
    _LIBC.gnu_get_libc_version  # noqa: B018
except (OSError, AttributeError):
    _LIBC = None


def is_glibc() -> bool:
    return _LIBC is not None


def malloc_env(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) with lldslight's malloc tunables added to GLIBC_TUNABLES
    (tunables already there are kept; ours win for the keys they set)."""
    env = dict(os.environ if env is None else env)
    ours = {t.split("=")[0]: t for t in MALLOC_TUNABLES}
    kept = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t.split("=")[0] not in ours]
    env["GLIBC_TUNABLES"] = ":".join(kept + list(ours.values()))
    return env


def malloc_tuned(env: Optional[dict] = None) -> bool:
    """Whether ``env`` (default: this process's) carries lldslight's malloc tunables."""
    have = set((os.environ if env is None else env).get("GLIBC_TUNABLES", "").split(":"))
    return all(t in have for t in MALLOC_TUNABLES)


def reexec_with_malloc_tunables() -> None:
    """Re-execute this process once with the tunables set (glibc only, and only from the command
    line: call it first thing in ``main``). Returns without doing anything when they are already
    set, when ``LLDSLIGHT_MALLOC=default``, or off glibc."""
    if not is_glibc() or malloc_tuned() or os.environ.get(OPT_OUT_ENV, "").strip().lower() == "default":
        return
    argv = list(getattr(sys, "orig_argv", []))  # the interpreter's own options and "-m" kept
    if not argv or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], malloc_env())


def trim() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim: also the free pages inside the
    heap, not only its top). On CPU, the rollout and the update each free hundreds of MB of
    mid-sized tensors; trimmed between phases, the next phase's peak does not sit on the last
    one's leftovers. A few ms; a no-op elsewhere."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def available_memory() -> int:
    """Bytes of memory this machine can give a process now, without swapping: Linux's MemAvailable
    (free memory plus the caches it can drop), else the physical memory not in use; the bounds on
    sizes a user types (a config's size, rollout rows) are taken from it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30  # no way to ask (not Linux, no sysconf): assume a small machine
