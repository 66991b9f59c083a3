"""The run's directories: each logger's claimed (an earlier run in it is kept unless ``--force``;
a resume continues it) and locked, removed again when a run fails before it logged anything; and
the one line a run stopped by Ctrl-C or SIGTERM ends with.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


def _remove_empty_run_dirs(trainer: Any) -> None:
    """A run that failed before it logged anything leaves no ``version_N`` behind: the directory
    (and its lock file beside it) goes if it holds nothing but the config Lightning saved at start
    (config.yaml, hparams.yaml) and empty folders. Anything else in it (metrics, checkpoints, files
    of yours) keeps it."""
    import shutil

    from lldslight.run.run_dir import lock_path, log_dir, previous_run

    for logger in getattr(trainer, "loggers", None) or []:
        path = log_dir(logger)
        if path is not None and not previous_run(path):
            shutil.rmtree(path, ignore_errors=True)
            lock_path(path).unlink(missing_ok=True)  # this process's; the run it locked never was


def _claim_run_dirs(trainer: Any, force: bool, ckpt_path: Any, subcommand: str) -> list:
    """Each logger's run directory checked (no earlier run in it without --force, which replaces
    it; a fit resuming from a checkpoint inside it continues that run, its metrics kept) and locked."""
    from lldslight.run.run_dir import checkpoint_step, claim, keep_metrics, log_dir

    locks: list = []
    try:
        for logger in getattr(trainer, "loggers", None) or []:
            path = log_dir(logger)
            if path is not None:
                ckpt = _checkpoint_file(trainer, ckpt_path)
                lock = claim(path, force, "trainer.logger.init_args.version", ckpt, fit=subcommand == "fit")
                locks.append(lock)
                if lock.continued:
                    keep_metrics(logger, checkpoint_step(ckpt))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def _checkpoint_file(trainer: Any, ckpt_path: Any) -> Optional[Path]:
    """The file ``--ckpt_path`` names, ``last`` resolved as Lightning resolves it (the newest
    ``last*.ckpt`` of the checkpoint callbacks' directories); None for none or a remote one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lldslight.run.checkpoint_io import CKPT_KEYWORDS

    text = str(ckpt_path)
    if ckpt_path is None or "://" in text or (text in CKPT_KEYWORDS and text != "last") or text.startswith("registry:"):
        return None
    if text == "last":
        found = set()
        for callback in getattr(trainer, "checkpoint_callbacks", None) or []:
            if isinstance(callback, ModelCheckpoint):
                found |= callback._find_last_checkpoints(trainer)
        files = [Path(f) for f in found if Path(f).is_file()]
        return max(files, key=lambda f: f.stat().st_mtime) if files else None
    return Path(text).expanduser()


def _stopped(trainer: Any, subcommand: str) -> Optional[Exception]:
    """The Stopped error (its message and exit status) of a run Lightning stopped on Ctrl-C or SIGTERM."""
    from lldslight.run import stopping
    from lldslight.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Stopped

    # Lightning's flag is reset when it installs its handlers: one that came while the model loaded
    # is known to lldslight.run.stopping only.
    sigterm = bool(getattr(trainer, "received_sigterm", False)) or stopping.received()
    if trainer is None or not (sigterm or getattr(trainer, "interrupted", False)):
        return None
    what = "SIGTERM" if sigterm else "Ctrl-C"
    code = EXIT_TERMINATED if sigterm else EXIT_INTERRUPTED
    if subcommand != "fit":
        return Stopped(f"stopped by {what} during the evaluation; its report was not written", code)
    ckpt = getattr(getattr(trainer, "checkpoint_callback", None), "last_model_path", "") or ""
    resumed = getattr(trainer, "ckpt_path", None)
    if not ckpt and resumed:  # a resumed run stopped before its first checkpoint: the one it started from stays
        ckpt = str(resumed)
    saved = (f"the last checkpoint is {ckpt} (resume: --ckpt_path last, or --ckpt_path {ckpt})" if ckpt
             else "no checkpoint was written")
    return Stopped(f"stopped by {what} after step {trainer.global_step}; {saved}", code)
