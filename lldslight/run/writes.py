"""Writing a directory of the user's: checked before the work that fills it, written whole or not
at all.

A read-only or missing parent surfaces as a traceback at the end of minutes of work (training a
warm start, merging an export) unless it is tried first; a full disk half-way through leaves a
directory that looks like a model (``config.json``) and is not one (no weights). Files are
therefore written into a hidden temporary sibling and moved into place only once all are there.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from lldslight.errors import UserError


def _reason(err: OSError) -> str:
    return err.strerror or str(err).splitlines()[0]


def write_failure(err: BaseException) -> Optional[str]:
    """Why a write failed, when ``err`` is the filesystem's refusal (a full disk, a quota, a
    read-only place): an OSError in its chain (torch's zip writer raises a RuntimeError over it),
    or safetensors' own I/O error (it writes from Rust and raises no OSError). None otherwise."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError):
            return _reason(seen)
        if type(seen).__name__ == "SafetensorError" and "I/O error" in str(seen):
            return str(seen).rpartition("I/O error: ")[2]
        seen = seen.__cause__ or seen.__context__
    return None


def check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` (and its parents) and a file in it, now: a read-only or full location
    fails here, in one line naming ``what`` and the directory, not after the work."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".lldslight-write-test{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UserError(f"{what}: cannot write to {directory}: {_reason(err)}") from None


def check_out_file(path: Path, flag: str) -> None:
    """``path`` is a file a tool will write at the end of its work (``--json``): a directory, a
    missing folder or a read-only one fails now, in one line naming ``flag``, not after the work."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give the file to write (e.g. {path / 'out.json'})")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: no such directory {path.parent}")
    check_writable(path.parent, f"{flag} {path}")


def check_out_dir(out: Path, force: bool, flag: str, what: str) -> None:
    """``out`` must be a new or empty directory, unless ``force`` (files of the same name are then
    replaced), and its parent writable: ``what`` (e.g. "the export") writes a model directory
    (config.json, weights, tokenizer files) that would replace a user's files of the same name."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a directory; give a directory for {what}")
    if out.is_dir() and not force:
        present = sorted(p.name for p in out.iterdir())
        if present:
            shown = ", ".join(present[:6]) + (f", ... ({len(present)} in all)" if len(present) > 6 else "")
            raise UserError(f"{flag} {out} is not empty (it holds {shown}); {what} would replace files of the same "
                            "name: pass --force to write into it anyway, or choose a new directory")
    check_writable(out.parent, flag)  # written beside it first, then moved in


@contextmanager
def directory_written_whole(out: Path, what: str) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; on success its files are moved into ``out``
    (created if needed; files of the same name replaced), on any error it is removed and ``out``
    is as it was. An OSError (a full disk) becomes one UserError naming ``out``."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        if not out.exists():
            os.rename(tmp, out)
        else:
            for item in tmp.iterdir():
                os.replace(item, out / item.name)
    except Exception as err:
        reason = write_failure(err)
        if reason is None:
            raise
        raise UserError(f"{what}: cannot write {out}: {reason} (nothing was written there)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
