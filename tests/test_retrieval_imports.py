"""The retrieval registry and the import graph: no cycles, and the base imports nothing heavy."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "pyarrow", "faiss", "bm25s", "transformers", "lightning", "fastapi", "uvicorn", "httpx")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the lldslight package: dotted name -> (file, is a package)."""
    out = {}
    for f in (ROOT / "lldslight").rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> lldslight modules it imports anywhere in its source, deferred imports included
    (a function-level import is a cycle waiting for the call that closes it); imports under
    ``if TYPE_CHECKING:`` never run, so they are left out."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (f, is_pkg) in mods.items():
        package = m if is_pkg else m.rpartition(".")[0]
        tree = ast.parse(f.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = node.module or ""
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    src = f"{base}.{src}" if src else base
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            else:
                continue
            graph[m] |= {r for n in names if n.startswith("lldslight") and (r := resolve(n)) not in (None, m)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_find_cycle_on_hand_made_graphs() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_package_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert {"lldslight.retrieval.base", "lldslight.retrieval.index", "lldslight.data.formats.multihop"} <= set(graph)
    assert "lldslight.retrieval.base" in graph["lldslight.retrieval.bm25"]  # the parser sees relative imports
    assert find_cycle(graph) is None


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_importing_the_base_loads_nothing_heavy() -> None:
    loaded = json.loads(_fresh(
        "import json, sys; import lldslight.retrieval.base; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"))
    assert not set(HEAVY) & set(loaded), set(HEAVY) & set(loaded)


@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.startswith(("lldslight.retrieval", "lldslight.data"))))
def test_each_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    # A cycle between module-level imports fails only when the cycle is entered from a particular
    # module first, so each one goes first once.
    _fresh(f"import {module}")


def test_registry_resolves_names_to_the_classes() -> None:
    from lldslight.retrieval.base import RetrievalError, register_retriever, retriever_class, retriever_names
    from lldslight.retrieval.bm25 import BM25Retriever
    from lldslight.retrieval.dense import DenseRetriever
    from lldslight.retrieval.http import HttpRetriever

    assert (retriever_class("bm25"), retriever_class("dense"), retriever_class("http")) == (
        BM25Retriever, DenseRetriever, HttpRetriever)
    assert retriever_names(indexed=True) == ["bm25", "dense"]
    with pytest.raises(RetrievalError, match=r"unknown retriever 'splade' \(registered: bm25, dense, http\)"):
        retriever_class("splade")
    with pytest.raises(RetrievalError, match="'http' builds no index"):
        retriever_class("http", indexed=True)
    register_retriever("bm25-again", "lldslight.retrieval.bm25.BM25Retriever", indexed=True)
    try:
        assert retriever_class("bm25-again", indexed=True) is BM25Retriever
    finally:
        from lldslight.retrieval import base

        del base._REGISTRY["bm25-again"]


def test_index_cli_offers_only_index_kinds(capsys) -> None:
    from lldslight.retrieval.cli import index_main

    with pytest.raises(SystemExit):
        index_main(["--corpus", "c.jsonl", "--retriever", "http", "--out", "x"])
    assert "invalid choice: 'http' (choose from" in capsys.readouterr().err
