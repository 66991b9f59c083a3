"""Checkpoints that survive a crash and resume exactly.

- :class:`AtomicCheckpointIO` writes a checkpoint to a temporary file beside its target, fsyncs it
  and renames it over the target. Lightning's own writer stages the bytes through fsspec's temporary
  file in the system temp directory: when that is another filesystem than the checkpoint (a local
  /tmp and a network checkpoint directory, the usual cluster layout) the final move is a copy, and a
  kill during the copy leaves a truncated ``last.ckpt``; nothing is fsynced either.
- RNG streams (torch, CUDA, numpy, python) of every rank: Lightning does not save them. The
  module captures them at the end of each training step and puts them back at the start of the
  next one (after the data loader has made its iterator, which draws from torch's generator at
  every epoch start), so a resumed run draws the same random numbers as an uninterrupted one.
- The trainable-keys check behind GRPOModule's trainable-only checkpoints.
- ``--ckpt_path last`` for a logger that numbers its runs: pick the run that holds a last.ckpt.
- The checks before a checkpoint is read (:func:`check_checkpoint`, :func:`checkpoint_problem`): a
  missing, truncated or foreign file is named in one line with the newest valid checkpoint beside
  it; the CLI checks ``--ckpt_path`` before LightningCLI reads the checkpoint's hyper-parameters.
"""
from __future__ import annotations

import os
import random
import sys
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lldslight.errors import CheckpointError, MissingFileError
from lldslight.run.writes import write_failure

LIGHTNING_KEY = "pytorch-lightning_version"
# Values of --ckpt_path that Lightning resolves itself (not file paths).
CKPT_KEYWORDS = ("last", "best", "hpc", "registry")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO with a crash-safe write for local paths: a kill at any moment
    leaves either the previous complete file or the new complete file, never a partial one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        target = str(path)
        if "://" in target and not target.startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)  # object stores: their own semantics
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        atomic_torch_save(checkpoint, Path(target.removeprefix("file://")))

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except Exception as err:
            # A damaged file surfaces as OSError, RuntimeError("PytorchStreamReader ..."), EOFError, ...
            # Name it, and the newest valid checkpoint beside it, when our own reading finds it damaged.
            local = Path(str(path).removeprefix("file://"))
            problem = checkpoint_problem(local) if "://" not in str(path).removeprefix("file://") and local.is_file() else None
            if problem is None:
                raise
            raise checkpoint_error(local, problem) from err


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written (a full disk, a read-only directory); the previous one stays."""


TMP_INFIX = ".tmp"


def _temporary(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}{TMP_INFIX}{pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary files that writers killed mid-write (SIGKILL, a power cut) left in
    ``directory``: ``.NAME.tmpPID`` whose process no longer runs. A write in progress (its process
    alive) is left alone. The target each was meant to replace is the previous complete checkpoint,
    so nothing is lost that a resume could use. Returns what was removed."""
    removed = []
    for tmp in directory.glob(f".*{TMP_INFIX}*") if directory.is_dir() else []:
        pid = tmp.name.rpartition(TMP_INFIX)[2]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass  # another cleaner got it first, or no right to: it stays a hidden file
    return removed


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = _temporary(path, os.getpid())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX within one filesystem (same directory)
    except (OSError, RuntimeError) as err:  # torch's zip writer raises a RuntimeError over the OSError
        reason = write_failure(err)
        if reason is None:
            raise
        kept = _what_is_kept(path)
        failure = CheckpointWriteError(f"cannot write checkpoint {path}: {reason} ({kept}); free space or "
                                       "choose another directory, then resume")
        failure.errno = getattr(err, "errno", None)
        raise failure from None
    finally:
        if tmp.exists():
            tmp.unlink()
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # make the rename itself durable
        finally:
            os.close(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic


def _what_is_kept(path: Path) -> str:
    """What a resume can use after the write of ``path`` failed: the file it was to replace, else
    the newest readable checkpoint beside it (a new ``epoch=0-step=2.ckpt`` fails while step 1's
    ``last.ckpt`` is there)."""
    if path.is_file():
        return f"the previous {path.name} is intact"
    newest = newest_valid_checkpoint(path.parent, exclude=path)
    if newest is None:
        return "no earlier checkpoint was there"
    return f"the checkpoints written before are intact, the newest {newest}: resume with --ckpt_path {newest}"


# -- RNG --------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch (CPU), the current CUDA device, numpy, python."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # As tensors and plain numbers: checkpoints stay loadable with torch.load(weights_only=True).
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's state, in rank order (the checkpoint is written by rank 0 alone). Collective:
    all ranks call it, as they all run ``on_save_checkpoint``."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, state)
    return out


def pick_rng(saved: Any, rank: int, world_size: int) -> Optional[dict[str, Any]]:
    """This rank's state from a checkpoint's list (None when the checkpoint has none)."""
    if not saved:
        return None
    if len(saved) != world_size:
        rank_zero_warn(
            f"the checkpoint holds RNG states for {len(saved)} processes but this run has {world_size}: "
            "random streams restart from rank 0's state on every rank (the run continues, not bit-exactly)"
        )
        return saved[0]
    return saved[rank]


# -- state keys -------------------------------------------------------------------------------------


def check_state_keys(
    model_shapes: dict[str, torch.Size], trainable: set[str], saved_shapes: dict[str, Any], source: str
) -> None:
    """Raise a CheckpointError (a ValueError) naming the keys when a checkpoint does not fit the
    model: weights the model lacks, trainable weights the checkpoint lacks, or shapes that differ."""
    unexpected = sorted(set(saved_shapes) - set(model_shapes))
    missing = sorted(trainable - set(saved_shapes))
    mismatched = sorted(
        k for k, shape in saved_shapes.items()
        if k in model_shapes and shape is not None and tuple(shape) != tuple(model_shapes[k])
    )
    if not (unexpected or missing or mismatched):
        return

    def show(keys: list[str]) -> str:
        head = ", ".join(keys[:5])
        return head + (f", ... ({len(keys)} in all)" if len(keys) > 5 else "")

    parts = []
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {show(unexpected)}")
    if missing:
        parts.append(f"trainable in the model but not in the checkpoint: {show(missing)}")
    if mismatched:
        parts.append("shapes differ: " + show([f"{k} {tuple(saved_shapes[k])} vs model {tuple(model_shapes[k])}" for k in mismatched]))
    # One line, as every user error: the CLI prints it after "lldslight fit: error:".
    raise CheckpointError(f"checkpoint {source} does not fit the model (was it written with another model.policy / "
                          f"LoRA config?): {'; '.join(parts)}")


# -- `--ckpt_path last` -----------------------------------------------------------------------------


def newest_last_checkpoint(save_dir: str, name: Optional[str]) -> Optional[Path]:
    """The most recently written ``save_dir/name/*/checkpoints/last*.ckpt``, or None."""
    root = Path(save_dir) / (name or "")
    if not root.is_dir():
        return None
    found = [p for p in root.glob("*/checkpoints/last*.ckpt") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_last_checkpoint(config: Any, subcommand: str = "fit") -> None:
    """``ckpt_path: last`` with a CSV/TensorBoard logger that numbers its runs (``version`` unset):
    Lightning looks for last.ckpt only in the new run's own, empty ``version_N/checkpoints``, so
    it would silently start from scratch. Point ckpt_path at the newest last checkpoint of the
    logger's earlier runs instead; the resumed run logs to a new version directory (the CSV logger
    deletes an existing metrics.csv, so reusing the old directory would lose its history).
    Leaves "last" alone when ModelCheckpoint has a fixed dirpath (Lightning finds it there) or when
    nothing is found: ``fit`` then says so in one line and starts fresh (Lightning's own warning
    would advise save_last=True, which the config may well have), ``validate``/``test`` stop with
    an error (evaluating untrained weights is not what was asked). Edits the parsed config in place."""
    if config.get("ckpt_path") != "last":
        return
    trainer = config.get("trainer")
    for cb in (trainer.get("callbacks") or []) if trainer is not None else []:
        init = getattr(cb, "init_args", None)
        if str(getattr(cb, "class_path", "")).endswith("ModelCheckpoint") and init is not None and init.get("dirpath"):
            return
    logger = trainer.get("logger") if trainer is not None else None
    if isinstance(logger, list):  # several loggers: checkpoints go under the first one's directory (Lightning's rule)
        logger = logger[0] if logger else None
    init = getattr(logger, "init_args", None)
    if init is None or init.get("version") is not None or init.get("save_dir") is None:
        return
    name = init.get("name", "lightning_logs")
    found = newest_last_checkpoint(init.get("save_dir"), name)
    if found is not None:
        config["ckpt_path"] = str(found)
        rank_zero_info(f"--ckpt_path last: resuming from {found}")
        return
    where = Path(init.get("save_dir")) / (name or "") / "*" / "checkpoints" / "last.ckpt"
    if subcommand != "fit":
        raise CheckpointError(f"--ckpt_path last: no checkpoint matches {where} (no earlier run of this logger "
                              "save_dir/name saved one); give the checkpoint's path")
    config["ckpt_path"] = None
    rank_zero_only(lambda: print(f"[lldslight] --ckpt_path last: no earlier run has a checkpoint ({where} matches "
                                 "nothing); training from scratch", file=sys.stderr, flush=True))()


# --------------------------------------------------------------------------- checks before a checkpoint is read


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a readable torch checkpoint, or None. Cheap: torch.save writes a zip
    whose directory sits at the end (a truncated file has none), and the pickled object tree is
    read and CRC-checked; the tensor bytes are left to the real load."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
            if not pickles:
                return "no data.pkl inside: not a torch checkpoint"
            size = path.stat().st_size
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"{info.filename} runs past the end of the file"
            tree = z.read(pickles[0])
    except zipfile.BadZipFile as e:
        return f"truncated or not a torch checkpoint ({e})"
    except (OSError, EOFError, RuntimeError, ValueError) as e:  # CRC errors are BadZipFile, short reads EOFError
        return f"unreadable ({type(e).__name__}: {e})"
    # Lightning reads this key first (a KeyError otherwise); pickle stores a dict's string keys as
    # their UTF-8 bytes, so it is found without unpickling anything.
    if LIGHTNING_KEY.encode() not in tree:
        return (f"not a Lightning checkpoint (no {LIGHTNING_KEY!r}: a plain torch.save file?); lldslight fit writes "
                "them to runs/NAME/version_N/checkpoints/")
    return None


def newest_valid_checkpoint(directory: Path, exclude: Optional[Path] = None) -> Optional[Path]:
    """The most recently written readable ``*.ckpt`` in ``directory`` (not ``exclude``)."""
    if not directory.is_dir():
        return None
    found = [p for p in directory.glob("*.ckpt") if p.is_file() and (exclude is None or p.resolve() != exclude.resolve())]
    for p in sorted(found, key=lambda q: q.stat().st_mtime, reverse=True):
        if checkpoint_problem(p) is None:
            return p
    return None


def _alternative(path: Path) -> str:
    other = newest_valid_checkpoint(path.parent, exclude=path)
    if other is not None:
        return f"; the newest valid checkpoint beside it is {other} (pass --ckpt_path {other})"
    return f"; no other valid checkpoint in {path.parent}" if path.parent.is_dir() else ""


def checkpoint_error(path: Path, problem: str) -> CheckpointError:
    """The error for a bad checkpoint: its name, what is wrong, and the newest valid one beside it."""
    return CheckpointError(f"checkpoint {path} is {problem}{_alternative(path)}")


def check_checkpoint(ckpt_path: Any) -> None:
    """A ``--ckpt_path`` that names a file must exist and be readable. Lightning's keywords
    (last, best, ...) and remote URLs are left to Lightning."""
    if ckpt_path is None:
        return
    text = str(ckpt_path)
    if text in CKPT_KEYWORDS or "://" in text or text.startswith("registry:"):
        return
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / ".metadata").is_file():
            return  # a sharded (distributed) checkpoint directory: Lightning's strategy reads it
        inside = sorted(p.name for p in path.glob("*.ckpt"))
        example = "last.ckpt" if "last.ckpt" in inside else (inside or [""])[-1]
        holds = f"it holds {', '.join(inside[:4])}: pass one, e.g. --ckpt_path {path / example}" if inside else "it holds no *.ckpt file"
        raise CheckpointError(f"--ckpt_path {path} is a directory, not a checkpoint file (nor a sharded checkpoint: no "
                              f".metadata); {holds} (or --ckpt_path last for the newest run's last.ckpt)")
    if not path.exists():
        raise MissingFileError(f"checkpoint not found: {path}{_alternative(path)}")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise checkpoint_error(path, problem)
