"""One validation style: a setting or argument out of range is refused through
``lldslight.errors.require`` / ``require_choice`` (a ConfigError that names the key, the allowed
values and the value), not a hand-written ``raise ValueError(...)``. An AST scan of lldslight/
holds the line: a ValueError is allowed only where the list below says why."""
from __future__ import annotations

import ast
from collections import Counter
from typing import Literal

import pytest

from lldslight.errors import ConfigError, choices, one_of, require_choice
from tests.conftest import ROOT

PACKAGE = ROOT / "lldslight"

# (file, enclosing function) -> (how many, why a ValueError and not require()). Exact counts: a
# new site fails, and so does an entry whose sites are gone (keep the list tight).
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("lldslight/update/objectives.py", "policy_gradient_weight"): (1, "the caller's contract (update/train.py passes the mask), no setting"),
    ("lldslight/trajectory.py", "Trajectory.concat"): (2, "parts built by code, not by a user: a bug keeps its traceback"),
    ("lldslight/trajectory.py", "Trajectory.check"): (5, "the Trajectory contract's invariants: a bug in the code that built it"),
}


def value_error_sites(source: str) -> list[tuple[str, int]]:
    """(enclosing qualified name, line) of every ``raise ValueError`` / ``raise ValueError(...)``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id == "ValueError":
                    found.append((".".join(scope) or "<module>", child.lineno))
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def _scan() -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for scope, line in value_error_sites(path.read_text()):
            out.setdefault((rel, scope), []).append(line)
    return out


def test_no_hand_written_value_error_outside_the_allow_list():
    sites = _scan()
    bad = []
    for key, lines in sorted(sites.items()):
        allowed = ALLOWED[key][0] if key in ALLOWED else 0
        if len(lines) > allowed:
            bad.append(f"{key[0]}:{','.join(map(str, lines))} ({key[1]}): {len(lines)} raise ValueError, {allowed} allowed")
    assert not bad, ("use lldslight.errors.require()/require_choice() for a setting or argument check "
                     "(or add the site to ALLOWED in tests/test_style.py with the reason):\n" + "\n".join(bad))


def test_the_allow_list_has_no_stale_entries():
    sites = _scan()
    stale = [f"{k} ({n} listed, {len(sites.get(k, []))} found)" for k, (n, _) in ALLOWED.items() if len(sites.get(k, [])) != n]
    assert not stale, "update ALLOWED in tests/test_style.py: " + "; ".join(stale)


def test_the_scan_sees_every_form():
    source = (
        "def f(x):\n    if x:\n        raise ValueError('a')\n    raise ValueError\n"
        "class C:\n    def g(self):\n        raise ValueError(f'{self}') from None\n"
        "    def h(self):\n        raise TypeError('not this')\n"
        "raise ValueError('top')\n"
    )
    assert Counter(s for s, _ in value_error_sites(source)) == {"f": 2, "C.g": 1, "<module>": 1}


def test_require_choice_names_the_key_the_choices_and_the_value():
    Mode = Literal["token-mean", "seq-mean-token-mean"]
    assert choices(Mode) == ("token-mean", "seq-mean-token-mean") and choices(("a",)) == ("a",)
    assert one_of(("a",)) == "'a'" and one_of(("a", "b", "c")) == "'a', 'b' or 'c'"
    require_choice("token-mean", "model.update.aggregation", Mode)
    with pytest.raises(ConfigError, match=r"^model.update.aggregation must be 'token-mean' or 'seq-mean-token-mean', got 'mean'$"):
        require_choice("mean", "model.update.aggregation", Mode)
    assert issubclass(ConfigError, ValueError)  # callers that catch ValueError keep working
