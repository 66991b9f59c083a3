"""The Retriever contract every backend honours (DESIGN.md, Contracts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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
