"""The run directory a ``fit`` / ``validate`` / ``test`` writes (the logger's ``version_N``):
never another run's, never two processes at once.

- A directory that already holds a run (a ``metrics.csv``, checkpoints, anything beyond the
  ``config.yaml`` / ``hparams.yaml`` Lightning writes at start) is refused without ``--force``:
  the CSV logger would replace its ``metrics.csv`` and Lightning its ``config.yaml`` while the old
  checkpoints stayed, a directory that no longer describes either run (and ``--ckpt_path last``
  would pick the old ``last.ckpt`` over the new ``last-v1.ckpt``). A fixed
  ``trainer.logger.init_args.version`` is how that happens; a numbered one is always new.
- ``--force`` replaces the earlier run: its files are listed in one line, then removed, before the
  run starts, so nothing of it is left to be mistaken for the new run's.
- A ``fit`` that resumes from a checkpoint inside the directory continues that run: nothing is
  refused or removed, and the CSV logger's earlier rows are kept (Lightning's CSV writer deletes
  ``metrics.csv`` when it opens a directory; :func:`keep_metrics` puts them back first).
- While a process writes it, the directory is locked (``flock`` on ``.version_N.lock`` beside it,
  which the kernel releases when the process ends, however it ends; beside, not inside, because
  Lightning warns about a run directory that is not empty): a second process given the same
  directory (the same fixed version, or two fits numbering their version at the same moment) is
  refused by name instead of mixing its files into the first one's.
"""
from __future__ import annotations

import csv
import io
import os
import shutil
import sys
import warnings
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

    def __init__(self, path: Path, handle: Any, continued: bool = False):
        self.path, self._handle = path, handle
        self.continued = continued  # a fit resuming the run this directory holds

    def release(self) -> None:
        # The lock file stays (hidden, beside the run): removing it would let a process that opened
        # it before the removal and one that creates a new one both hold "the" lock.
        if self._handle is not None:
            self._handle.close()  # closing releases the flock
            self._handle = None


def within(path: Optional[Path], directory: Path) -> bool:
    """``path`` is ``directory`` or inside it (symbolic links resolved)."""
    return path is not None and Path(path).resolve().is_relative_to(directory.resolve())


def claim(path: Path, force: bool, version_key: str, checkpoint: Optional[Path] = None, fit: bool = False) -> RunLock:
    """Lock ``path`` for this process, then check that it holds no earlier run (unless ``force``,
    which removes that run's files, listed first). A ``fit`` whose ``checkpoint`` lies inside
    ``path`` continues the run there (``RunLock.continued``). ``version_key`` is the setting that
    chose the directory, for the messages."""
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
    own = within(checkpoint, path)
    lock = RunLock(path, handle, continued=fit and own)
    earlier = previous_run(path)
    try:
        if earlier and not lock.continued:
            if not force:
                shown = ", ".join(earlier[:4]) + (f", ... ({len(earlier)} files)" if len(earlier) > 4 else "")
                resume = " or resume it (fit --ckpt_path last)," if fit else ""
                raise UserError(f"run directory {path} already holds a run ({shown}); this run would replace its "
                                f"metrics.csv and config.yaml: choose another {version_key} (or leave it unset for a new "
                                f"version_N),{resume} or pass --force to replace that run (its files are removed first)")
            if own:
                raise UserError(f"--ckpt_path {checkpoint} is inside the run directory {path}, which --force would "
                                f"replace (its files removed, the checkpoint too): give this run another {version_key}")
            replace_run(path)
    except BaseException:
        lock.release()
        raise
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return lock


def replace_run(path: Path) -> None:
    """``--force``: say which files of the earlier run in ``path`` go, then remove them all (the
    start files too: nothing of it may be taken for the new run's)."""
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if not p.is_dir())
    shown = ", ".join(files[:8]) + (", ..." if len(files) > 8 else "")
    print(f"[lldslight] --force: replacing the earlier run in {path}: removing its {len(files)} "
          f"file{'s' if len(files) != 1 else ''} ({shown})", file=sys.stderr, flush=True)
    try:
        for entry in path.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError as err:
        raise UserError(f"--force: cannot remove the earlier run's {err.filename or path}: {err.strerror or err}") from None


def keep_metrics(logger: Any, resume_step: Optional[int] = None) -> None:
    """Open a CSV logger's writer over the ``metrics.csv`` its directory holds without losing it:
    Lightning's writer deletes the file when it opens a non-empty directory (and warns that it
    will), then writes a new one; the earlier rows are put back and their columns made the
    writer's, so the resumed run's rows are appended (a new column rewrites the file with it,
    Lightning's own rule, the values kept). ``resume_step``: the checkpoint's global step; rows
    of later steps (logged before the run was stopped, after its checkpoint) are dropped, since the
    resumed run trains and logs those steps again: each step keeps one row. Loggers other than a
    CSV logger keep their files anyway."""
    from lightning.fabric.loggers.csv_logs import CSVLogger, _ExperimentWriter

    if not isinstance(logger, CSVLogger):  # Lightning's CSVLogger derives from Fabric's
        return
    metrics = Path(str(logger.log_dir)) / _ExperimentWriter.NAME_METRICS_FILE
    if not metrics.is_file():
        return
    data = metrics.read_bytes()
    if resume_step is not None:
        data = _rows_before(data, resume_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Previous log files in this directory will be deleted": not these
        writer = logger.experiment
    metrics.write_bytes(data)
    header = next(csv.reader(io.StringIO(data.decode("utf-8", errors="replace"))), [])
    writer.metrics_keys = [k for k in header if k]


def _rows_before(data: bytes, step: int) -> bytes:
    """metrics.csv's bytes without the rows whose ``step`` is >= ``step`` (rows without a step kept)."""
    lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
    if not lines:
        return data
    header = next(csv.reader([lines[0]]))
    if "step" not in header:
        return data
    col = header.index("step")
    kept = [lines[0]]
    for line in lines[1:]:
        fields = next(csv.reader([line]), [])
        try:
            if col < len(fields) and fields[col] != "" and int(float(fields[col])) >= step:
                continue
        except ValueError:
            pass
        kept.append(line)
    return "".join(kept).encode("utf-8")


def checkpoint_step(path: Optional[Path]) -> Optional[int]:
    """The global step a Lightning checkpoint was saved at (memory-mapped: no tensor is read), or None."""
    if path is None or not Path(path).is_file():
        return None
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # noqa: BLE001 - an unreadable checkpoint is reported by the resume itself
        return None
    step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    return int(step) if isinstance(step, int) else None

