"""Checks that run before the policy's weights load, so a bad path, corpus, URL or checkpoint fails
in a second with one line instead of minutes later under a traceback.

Lightning calls the setup hooks after ``prepare_data`` (which writes the synthetic knowledge base)
and before ``configure_model`` (which loads the policy): the datamodule's ``setup`` reads and
validates every question file, ``SearchRollout.setup`` calls :func:`check_retriever` and
``GRPOModule.setup`` calls :func:`check_policy` and :func:`check_checkpoint`. The CLI checks
``--ckpt_path`` even earlier, before LightningCLI reads the checkpoint's hyper-parameters.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Optional

from lldslight.errors import CheckpointError, MissingFileError

LIGHTNING_KEY = "pytorch-lightning_version"
# Values of --ckpt_path that Lightning resolves itself (not file paths).
CKPT_KEYWORDS = ("last", "best", "hpc", "registry")


# --------------------------------------------------------------------------- retriever


def check_retriever(retriever: Any, topk: int) -> None:
    """Make the retriever prove it can answer, without searching for anything real.

    - an index-backed retriever (BM25, dense) opens its index now, building it on first use:
      that reads and validates every corpus row (missing, empty or malformed corpus -> error
      naming the file and line), work its first search would do anyway;
    - an HTTP retriever sends one request with ``topk`` (Search-R1's API, so any compatible server
      answers it): an unreachable URL or a server that refuses ``topk`` fails here;
    - any other object with ``search`` is trusted as is.
    """
    probe = getattr(retriever, "probe", None)
    if callable(probe):
        probe(topk)
        return
    load = getattr(retriever, "load", None)
    if callable(load):
        load()


# --------------------------------------------------------------------------- model


def check_policy(cfg: Any) -> None:
    """Find the policy's weights and tokenizer (demo package, GGUF, directory or hub id) without
    loading them. A demo GGUF is de-quantised into its cache here (once), as loading would."""
    from lldslight.policy import DEMO_MODELS, PolicyLoadError, check_hub_model, check_layers, model_config, resolve_model_dir

    model_dir = resolve_model_dir(cfg, weights=False)
    if Path(model_dir).is_dir():  # a local directory (a hub id's config is read when it loads)
        check_layers(cfg, model_config(cfg, model_dir))
    resolve_model_dir(cfg)  # now the weight files
    tok = getattr(cfg, "tokenizer", None)
    if tok and tok not in DEMO_MODELS and not Path(tok).expanduser().exists():
        if "/" not in tok or tok.startswith((".", "/", "~")):
            raise PolicyLoadError(f"policy.tokenizer {tok!r} is neither a demo model, nor an existing path, nor a hub id")
        check_hub_model(tok, what="tokenizer")


# --------------------------------------------------------------------------- checkpoints


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
