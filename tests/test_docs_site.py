"""The documentation site builds: ``mkdocs build --strict`` over mkdocs.yml (Material, the API
reference generated from the docstrings by mkdocstrings, scripts/docs_hooks.py for the links that
leave docs/). Under --strict every warning fails the build: a link to a missing page or file, an
anchor no heading has, a page left out of the nav, a docstring griffe cannot read. A second build,
of a copy with one of each broken in, shows the check bites.

tests/test_docs.py checks the same links as GitHub renders them (its slug rules, files outside
docs/); a link must pass both.
"""
from __future__ import annotations

import html
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

for _package in ("mkdocs", "material", "mkdocstrings_handlers.python"):
    pytest.importorskip(_package, reason=f"the docs site needs {_package}: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, not a finding
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    return out


def text_of(page: Path) -> str:
    """A built page's words: tags dropped (inline ones join their neighbours, as ``code`` does in
    its sentence), entities decoded, white space collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page.read_text())).split())


def first_line(obj) -> str:
    """The first sentence line of an object's docstring, markup dropped, as the page shows it."""
    return " ".join(inspect.getdoc(obj).split("\n\n")[0].replace("``", "").replace("`", "").split())[:60]


def test_the_site_builds_with_warnings_as_errors(site):
    assert (site / "index.html").is_file() and (site / "speed" / "index.html").is_file()


def test_api_reference_documents_the_public_classes(site):
    """Each public class named in the issue has its entry and its docstring on the API pages, read
    here from the imported class (inspect.getdoc), not from the page generator."""
    import lldslight.callbacks as callbacks
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.module import GRPOModule
    from lldslight.update.optim import OptimConfig
    from lldslight.policy import LoRAConfig, PolicyConfig
    from lldslight.retrieval.bm25 import BM25Retriever
    from lldslight.retrieval.dense import DenseRetriever
    from lldslight.retrieval.http import HttpRetriever
    from lldslight.rollout import GenerationBackend, HFGenerate, RolloutConfig, RolloutEngine
    from lldslight.update import UpdateConfig

    pages = {
        "training": [GRPOModule, SearchQADataModule],
        "callbacks": [getattr(callbacks, name) for name in callbacks.__all__],  # every exported callback
        "configs": [PolicyConfig, LoRAConfig, UpdateConfig, OptimConfig, RolloutConfig],
        "retrieval": [BM25Retriever, DenseRetriever, HttpRetriever],
        "backends": [GenerationBackend, RolloutEngine, HFGenerate],
    }
    missing = []
    for name, objects in pages.items():
        page = site / "api" / name / "index.html"
        source, words = page.read_text(), text_of(page)
        for obj in objects:
            if not re.search(rf'id="[\w.]*\.{obj.__name__}"', source):
                missing.append(f"api/{name}: no entry for {obj.__name__}")
            elif first_line(obj) not in words:
                missing.append(f"api/{name}: {obj.__name__}'s docstring ({first_line(obj)!r}) not shown")
    assert not missing, "\n".join(missing)


def test_links_out_of_docs_reach_a_copy_in_the_site(site):
    """A lab plot the collapse page shows, a record it links (served as text), a benchmark's JSON
    and a linked folder's listing are in the site, byte for byte the repository's."""
    repo = site / "repo"
    plot = "lab/archive/collapse/final/collapse.png"
    assert (repo / plot).read_bytes() == (ROOT / plot).read_bytes()
    assert 'src="../../repo/lab/archive/collapse/final/collapse.png"' in (site / "lab" / "collapse_lab" / "index.html").read_text()
    record = "lab/archive/collapse/PREREGISTRATION.md"
    assert (repo / (record + ".txt")).read_bytes() == (ROOT / record).read_bytes()
    data = "benchmarks/results/step_epyc_bf16.json"
    assert (repo / data).read_bytes() == (ROOT / data).read_bytes()
    folder = ROOT / "lab" / "archive" / "demo" / "shipped"
    listing = (repo / "lab" / "archive" / "demo" / "shipped" / "index.html").read_text()
    for f in (p for p in folder.rglob("*") if p.is_file()):
        name = f.relative_to(folder).as_posix()
        assert f'href="{name}"' in listing, name
        assert (repo / "lab" / "archive" / "demo" / "shipped" / name).read_bytes() == f.read_bytes()


def test_docs_holds_pages_only():
    """Result data lives beside the code that wrote it (benchmarks/results/, lab/archive/)."""
    tracked = subprocess.run(["git", "ls-files", "docs"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert tracked and not [f for f in tracked if not f.endswith(".md")]


def test_a_broken_link_anchor_file_or_nav_fails_the_build(tmp_path):
    """The strict build of a copy with a missing page, a missing anchor, a missing file outside
    docs/ and a page outside the nav: it fails, naming each."""
    for name in ("lldslight", "lab", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "docs_hooks.py", tmp_path / "scripts")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    index = tmp_path / "docs" / "index.md"
    text = index.read_text()
    for old, new in (("(llds.md)", "(no_such_page.md)"),
                     ("(getting_started.md#a-first-custom-run-llds-the-guard-the-monitor)", "(getting_started.md#no-such-heading)"),
                     ("(../lab/README.md)", "(../lab/NO_SUCH_FILE.md)")):
        assert old in text, old
        text = text.replace(old, new)
    index.write_text(text)
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    for expected in ("'no_such_page.md'", "anchor '#no-such-heading'", "'../lab/NO_SUCH_FILE.md'", "orphan.md"):
        assert expected in out, f"{expected} not reported:\n{out}"
