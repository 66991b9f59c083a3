"""The house's layout holds: the library in lldslight/, the speed tools in benchmarks/, the
experiments in lab/ (docs/architecture.md, Where things are). Scripts beside the library reach
the library only through public names and never edit ``sys.path``; no tracked file holds the
absolute path of a machine it ran on; no product file cites a tracker's issue number (it means
nothing to a reader of a clone)."""
from __future__ import annotations

import ast
import re
import subprocess

import pytest
from conftest import ROOT

SCRIPT_DIRS = ("benchmarks", "lab")
# A machine's own folders. /opt/rh/gcc-toolset-13/root/usr/bin/c++ inside torch's build string is
# where PyTorch was compiled, not where a run ran; it is matched by none of these.
MACHINE_PATH = re.compile(r"(?<![\w./-])/(?:work|home|root|Users|mnt|scratch)/[\w.-]+")
ISSUE = re.compile(r"\b[Ii]ssues? ?#?\d+")
# Private attributes a script may reach, and why: not lldslight's (exact; a new one fails).
FOREIGN_PRIVATE = {
    ("benchmarks/step.py", "_generate_single_turn"): "TRL's GRPOTrainer phase, timed from outside (TRL offers no public hook)",
    ("benchmarks/step.py", "_generate_and_score_completions"): "TRL's GRPOTrainer phase, timed from outside",
}


def tracked(*patterns: str) -> list[str]:
    return subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def script_files() -> list[str]:
    return [f for f in tracked(*(f"{d}/*.py" for d in SCRIPT_DIRS))]


def private_reaches(source: str) -> list[str]:
    """``from lldslight... import _name`` and ``x._name`` on anything but ``self``/``cls`` (an
    attribute of a library object whose name says it is not promised)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lldslight"):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"._{node.attr[1:]} (line {node.lineno})")
    return found


def test_private_reach_detector():
    """The detector itself, on hand-written lines (so the real scan below can fail)."""
    assert private_reaches("from lldslight.rollout.cache import _Decoder") == ["from lldslight.rollout.cache import _Decoder"]
    assert private_reaches("engine._sample(x)") == ["._sample (line 1)"]
    assert private_reaches("self._t0 = 0\nfrom lldslight.rollout import RolloutEngine\nx.__class__") == []


@pytest.mark.parametrize("path", script_files())
def test_scripts_use_public_names_and_leave_sys_path_alone(path: str):
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    edits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
             and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert not edits, f"{path}: sys.path at line(s) {edits}: run it as a module (python -m) instead"
    reaches = [r for r in private_reaches(source) if (path, r.split()[0].lstrip(".")) not in FOREIGN_PRIVATE]
    assert not reaches, f"{path}: private names (make them public in lldslight): {reaches}"


def test_the_lab_is_beside_the_library():
    """lab/ holds the experiments, benchmarks/ only speed tools, docs/ no run archives."""
    assert not tracked("benchmarks/collapse*.py", "benchmarks/lab/*", "benchmarks/alarm_eval.py", "benchmarks/heal_eval.py",
                        "benchmarks/demo_*", "configs/lab/*")
    assert not [f for f in tracked("docs/*") if f.endswith((".csv.gz", ".json.gz"))], "run archives belong under lab/archive/"
    assert (ROOT / "lab" / "README.md").is_file() and (ROOT / "lab" / "archive" / "collapse" / "PREREGISTRATION.md").is_file()
    library = "\n".join((ROOT / f).read_text() for f in tracked("lldslight/*.py"))
    assert not re.search(r"^\s*(from|import) (lab|benchmarks)\b", library, flags=re.M), "the library imports nothing from lab/ or benchmarks/"


def test_no_machine_paths_in_tracked_files():
    # the sample path is split in two: this file is scanned too
    assert MACHINE_PATH.search('"save_dir /' + 'work/lab/runs/x"') and not MACHINE_PATH.search("CXX=/opt/rh/gcc-toolset-13/root/usr/bin/c++")
    bad = []
    for f in tracked():
        path = ROOT / f
        if path.suffix in (".gz", ".png", ".safetensors") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{f}: {m.group(0)}" for m in MACHINE_PATH.finditer(text)]
    assert not bad, "absolute machine paths (write them relative to the repository):\n" + "\n".join(bad[:20])


def test_no_issue_numbers_in_product_files():
    """Code, configs and pages say why in words; the tracker's numbers stay in the tracker."""
    files = tracked("lldslight/*", "benchmarks/*", "configs/*", "docs/*.md", "README.md", "scripts/*", "callbacks/*",
                    "lab/*.py", "lab/*.md", "lab/*.sh", "lab/configs/*")
    files = [f for f in files if not f.startswith("lab/archive/")]  # dated records, kept as written
    bad = [f"{f}:{i}" for f in files if (ROOT / f).suffix in (".py", ".md", ".yaml", ".sh", ".toml")
           for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not bad, "issue numbers in product files: " + ", ".join(bad)
