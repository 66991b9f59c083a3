"""The Retriever contract every backend honours (docs/architecture.md, Contracts), and the registry of backends
by name ("bm25", "dense", "http") that the CLI and ``load_index`` use; and :func:`check_retriever`, the
retriever's proof that it answers, run before the policy loads (``SearchRollout.setup``)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lldslight.errors import UserError


@dataclass(frozen=True)
class Passage:
    """One retrieved passage. ``contents`` is wiki-18 style: ``"Title"\\ntext``."""

    id: str
    contents: str
    score: float = 0.0

    @property
    def title(self) -> str:
        head = self.contents.split("\n", 1)[0]
        return head.strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) == 2 else parts[0]


@runtime_checkable
class Retriever(Protocol):
    """``search`` takes a batch of queries and returns, for each, up to ``k`` passages, best first."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]: ...


class RetrievalError(UserError, RuntimeError):
    """A retriever could not answer (server down, malformed response, missing index)."""


# A retriever's short name -> its class, written as a path and imported only when asked for: the
# backends import this module, so this module must not import them (no cycle, and `import base`
# costs nothing). ``indexed``: the class builds an on-disk index (lldslight.retrieval.index).
_REGISTRY: dict[str, tuple[str, bool]] = {
    "bm25": ("lldslight.retrieval.bm25.BM25Retriever", True),
    "dense": ("lldslight.retrieval.dense.DenseRetriever", True),
    "http": ("lldslight.retrieval.http.HttpRetriever", False),
}


def register_retriever(name: str, class_path: str, indexed: bool = False) -> None:
    """Make ``name`` resolve to ``class_path`` ("package.module.Class"), e.g. for your own backend."""
    _REGISTRY[name] = (class_path, indexed)


def retriever_names(indexed: bool = False) -> list[str]:
    """Registered names (only those that build an index when ``indexed``)."""
    return [n for n, (_, ix) in _REGISTRY.items() if ix or not indexed]


def retriever_class(name: str, indexed: bool = False) -> type:
    """The class registered as ``name``, imported now; ``indexed`` asks for one that builds an index."""
    if name not in _REGISTRY:
        raise RetrievalError(f"unknown retriever {name!r} (registered: {', '.join(retriever_names())})")
    class_path, is_indexed = _REGISTRY[name]
    if indexed and not is_indexed:
        raise RetrievalError(f"retriever {name!r} builds no index (index kinds: {', '.join(retriever_names(indexed=True))})")
    module, _, cls = class_path.rpartition(".")
    return getattr(importlib.import_module(module), cls)


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
