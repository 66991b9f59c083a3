"""The collapse science lives in lldslight/science/ (collapse, diagnostics, alarm, plots). Its old
module paths still import: every name read through one is the new module's own object, with a
DeprecationWarning naming the new path (a user's ``from lldslight.alarm import replay_alarm`` keeps
working); nothing in the repository imports the old paths, so no run of ours warns."""
from __future__ import annotations

import ast
import importlib
import subprocess

import pytest

from tests.conftest import ROOT

MOVED = {"collapse": "find_collapse", "alarm": "replay_alarm", "diagnostics": "PhaseConfig", "plots": "plot_runs"}
OLD = {f"lldslight.{m}" for m in MOVED}


@pytest.mark.parametrize("module, name", MOVED.items())
def test_the_old_path_gives_the_new_object_with_a_warning(module, name):
    old = importlib.import_module(f"lldslight.{module}")
    new = importlib.import_module(f"lldslight.science.{module}")
    with pytest.warns(DeprecationWarning, match=rf"^lldslight\.{module}\.{name} moved to lldslight\.science\.{module}\.{name} "):
        assert getattr(old, name) is getattr(new, name)
    assert name in dir(old)
    with pytest.raises(AttributeError):
        old.no_such_name


def test_from_import_of_an_old_path():
    from lldslight.science.alarm import AlarmConfig as new

    with pytest.warns(DeprecationWarning, match=r"lldslight\.science\.alarm\.AlarmConfig"):
        from lldslight.alarm import AlarmConfig as old
    assert old is new


def old_path_imports(source: str) -> list[str]:
    """The imports of a moved module's old path in ``source`` (``import lldslight.alarm``,
    ``from lldslight.alarm import X``, ``from lldslight import alarm``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in OLD]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in OLD:
            found.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "lldslight":
            found += [f"lldslight.{a.name}" for a in node.names if a.name in MOVED]
    return found


def test_old_path_detector():
    assert old_path_imports("from lldslight import collapse as C\nimport lldslight.plots\nfrom lldslight.alarm import X") == [
        "lldslight.collapse", "lldslight.plots", "lldslight.alarm"]
    assert old_path_imports("from lldslight.science import collapse\nfrom lldslight.callbacks.alarm import CollapseAlarm\n"
                            "from .collapse import x\nfrom collapse import y\nimport collapse") == []  # the lab's own collapse.py


def test_nothing_here_imports_the_old_paths():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    shims = {f"lldslight/{m}.py" for m in MOVED}
    this = "tests/test_science_paths.py"  # imports the old paths on purpose: the shims' own test
    found = {f: old_path_imports((ROOT / f).read_text()) for f in files if f not in shims | {this} and (ROOT / f).is_file()}
    assert not {f: i for f, i in found.items() if i}
