"""The run directory a ``fit`` / ``validate`` / ``test`` writes (the logger's ``version_N``):
never another run's, never two processes at once.

- A directory that already holds a run (a ``metrics.csv``, checkpoints, anything beyond the
  ``config.yaml`` / ``hparams.yaml`` Lightning writes at start) is refused without ``--force``:
  the CSV logger would replace its ``metrics.csv`` and Lightning its ``config.yaml`` while the old
  checkpoints stayed, a directory that no longer describes either run. A fixed
  ``trainer.logger.init_args.version`` is how that happens; a numbered one is always new.
- While a process writes it, the directory is locked (``flock`` on ``.version_N.lock`` beside it,
  which the kernel releases when the process ends, however it ends; beside, not inside, because
  Lightning warns about a run directory that is not empty): a second process given the same
  directory (the same fixed version, or two fits numbering their version at the same moment) is
  refused by name instead of mixing its files into the first one's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from lldslight.errors import UserError

# What a run leaves when it failed at start (Lightning writes the config first): not a run yet.
START_FILES = ("config.yaml", "hparams.yaml")

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks; the overwrite check still runs
    fcntl = None  # type: ignore[assignment]


def lock_path(run: Path) -> Path:
    return run.with_name(f".{run.name}.lock")


def is_rank_zero() -> bool:
    """This process is the one that writes the run directory (the others of a DDP run share it)."""
    if "RANK" in os.environ:
        return os.environ["RANK"] == "0"
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def log_dir(logger: Any) -> Optional[Path]:
    """The logger's run directory, for loggers that write one on this machine (CSV, TensorBoard)."""
    try:
        value = logger.log_dir
    except Exception:  # a logger without a local directory (e.g. a remote service)
        return None
    return Path(str(value)) if value and "://" not in str(value) else None


def previous_run(path: Path) -> list[str]:
    """What in ``path`` shows that a run wrote it (sorted names, relative); empty when nothing."""
    if not path.is_dir():
        return []
    found = [p for p in path.rglob("*") if not p.is_dir()]
    return sorted(str(p.relative_to(path)) for p in found if not (p.parent == path and p.name in START_FILES))


class RunLock:
    """The lock on one run directory, held until :meth:`release` or the process ends."""

    def __init__(self, path: Path, handle: Any):
        self.path, self._handle = path, handle

    def release(self) -> None:
        # The lock file stays (hidden, beside the run): removing it would let a process that opened
        # it before the removal and one that creates a new one both hold "the" lock.
        if self._handle is not None:
            self._handle.close()  # closing releases the flock
            self._handle = None


def claim(path: Path, force: bool, version_key: str) -> RunLock:
    """Lock ``path`` for this process, then check that it holds no earlier run (unless ``force``).
    ``version_key`` is the setting that chose the directory, for the message."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path(path), "a+")
    except OSError as err:
        raise UserError(f"cannot write the run directory {path}: {err.strerror or err} (choose a writable "
                        "trainer.logger.init_args.save_dir)") from None
    if fcntl is not None:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise UserError(f"run directory {path} is being written by another process (pid {holder}, per "
                            f"{lock_path(path)}); wait for it to end, or give this run another {version_key}") from None
    lock = RunLock(path, handle)
    earlier = previous_run(path)
    if earlier and not force:
        lock.release()
        shown = ", ".join(earlier[:4]) + (f", ... ({len(earlier)} files)" if len(earlier) > 4 else "")
        raise UserError(f"run directory {path} already holds a run ({shown}); this run would replace its metrics.csv "
                        f"and config.yaml: choose another {version_key} (or leave it unset for a new version_N), or "
                        "pass --force to write over it")
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return lock
