"""lldslight's import graph has no cycle: no module imports, directly or through others, a module
that imports it (docs/architecture.md, Layers). Collapsed to the top of the package (a folder such
as lldslight/run/ is one node, a module such as lldslight/module.py another) it has no cycle either,
and no arrow runs up the layers that LAYERS lists: a folder imports only the layers below it.

The graph is read from the source with ``ast``, so it sees every import statement: at the top of a
file, inside a function (a lazy import only postpones a cycle to the first call) and under
``if TYPE_CHECKING:`` (a type checker follows those, and they say the lower layer knows about the
upper one). ``from lldslight.a import b`` is an edge to ``lldslight.a.b`` when that is a module,
else to ``lldslight.a``. The implicit import of a module's parent packages is not an edge: a
package ``__init__`` re-exporting its submodules is the usual layout, and a submodule importing its
own package explicitly (``from lldslight.callbacks import X``) is.

    python tests/test_import_graph.py [ROOT]   # prints the cycles and arrows up (exit 1), or nothing
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_names(root: Path, package: str = "lldslight") -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path, package: str = "lldslight") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (any statement, anywhere in the file)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package, up level - 1 more
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                # `import lldslight.a.b` names lldslight.a.b; a name inside a module is that module
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.split(".")[0] == package:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle
    through it (a path that starts and ends at the same module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        start = min(component)
        out.append(_path_back(graph, component, start))
    return sorted(out)


def _path_back(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside ``component`` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def test_the_graph_is_read():
    graph = import_graph(ROOT)
    # a few edges that exist, so an empty graph cannot pass
    assert "lldslight.update.objectives" in graph["lldslight.update.train"]
    assert "lldslight.update.train" in graph["lldslight.module"]
    assert "lldslight.callbacks.rollout" in graph["lldslight.callbacks"]


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles in lldslight:\n" + "\n".join(" -> ".join(c) for c in found)


# The top of lldslight, bottom layer first (docs/architecture.md, Layers). A node may import those of
# a lower layer only; a new folder or top-level module must be placed here.
LAYERS: list[set[str]] = [
    {"lldslight", "lldslight.errors", "lldslight.lazy", "lldslight.trajectory", "lldslight.rewards"},
    {"lldslight.run"},
    {"lldslight.policy"},
    {"lldslight.update"},
    {"lldslight.data"},
    {"lldslight.retrieval"},
    {"lldslight.rollout"},
    {"lldslight.science"},
    {"lldslight.callbacks"},
    {"lldslight.module", "lldslight.sft"},
    {"lldslight.cli"},
]


def top_level(module: str) -> str:
    """``lldslight.run.writes`` -> ``lldslight.run``: the folder or top-level module it is in."""
    return ".".join(module.split(".")[:2])


def collapsed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with each module replaced by its top-level folder or module (arrows inside one dropped)."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(top_level(a), set())
        for b in targets:
            out.setdefault(top_level(b), set())
            if top_level(a) != top_level(b):
                out[top_level(a)].add(top_level(b))
    return out


def arrows_up(graph: dict[str, set[str]], layers: list[set[str]]) -> list[tuple[str, str]]:
    """The arrows a -> b of a collapsed graph whose b sits on a higher layer than a, or on none."""
    floor = {node: i for i, layer in enumerate(layers) for node in layer}
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if a not in floor or b not in floor or floor[b] > floor[a])


def test_folders_form_cycles_that_no_pair_of_modules_shows():
    """A folder-level cycle is found where the module graph has none, and so is an arrow up."""
    graph = {"lldslight.a.x": {"lldslight.b.y"}, "lldslight.b.y": set(), "lldslight.b.z": {"lldslight.a.w"}, "lldslight.a.w": set()}
    assert cycles(graph) == []
    assert collapsed(graph) == {"lldslight.a": {"lldslight.b"}, "lldslight.b": {"lldslight.a"}}
    assert cycles(collapsed(graph)) == [["lldslight.a", "lldslight.b", "lldslight.a"]]
    assert arrows_up(collapsed(graph), [{"lldslight.a"}, {"lldslight.b"}]) == [("lldslight.a", "lldslight.b")]
    assert arrows_up({"lldslight.a": {"lldslight.c"}}, [{"lldslight.a"}]) == [("lldslight.a", "lldslight.c")]  # c on no layer


def test_the_top_of_the_package_has_no_cycle_and_no_arrow_up():
    graph = collapsed(import_graph(ROOT))
    assert {"lldslight.run", "lldslight.policy", "lldslight.update", "lldslight.cli"} <= set(graph)
    assert "lldslight.run" in graph["lldslight.policy"] and "lldslight.policy" in graph["lldslight.update"]  # read, not empty
    unplaced = sorted(set(graph) - set().union(*LAYERS))
    assert not unplaced, f"place these in LAYERS (tests/test_import_graph.py) and docs/architecture.md: {unplaced}"
    found = cycles(graph)
    assert not found, "import cycles between lldslight's folders:\n" + "\n".join(" -> ".join(c) for c in found)
    up = arrows_up(graph, LAYERS)
    assert not up, "imports up the layers:\n" + "\n".join(f"{a} -> {b}" for a, b in up)


if __name__ == "__main__":
    graph = import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    found = cycles(graph) + cycles(collapsed(graph))
    for c in found:
        print(" -> ".join(c))
    for a, b in arrows_up(collapsed(graph), LAYERS):
        print(f"{a} -> {b} (up the layers)")
    sys.exit(1 if found or arrows_up(collapsed(graph), LAYERS) else 0)
