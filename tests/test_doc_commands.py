"""Every ``lldslight`` command in the README and docs/ runs as written, on the tiny config, so a page
cannot drift from the code (a plot of runs the page never made, an option that no longer exists).

Each page's commands run in order in one working directory of their own (``configs/`` linked in,
the demo's knowledge base made first as scripts/demo.sh does), with tiny settings in place of the
page's expensive ones: the page's base config (demo.yaml, searchr1_cpu.yaml, a recipe) becomes
configs/tiny.yaml with the base's logger name kept (so ``runs/demo/...`` paths hold), every fit
trains 1 step, ``sft`` trains a random-init 2-layer model on 4 examples. A page whose later commands
read earlier runs (``runs/...``: a plot, a validate, a warm-started fit) runs its fits for real;
on the other pages a fit is parsed and composed (``--print_config``), which is what a typo, a
removed key or a missing config file breaks. A command with placeholders (``FILE``, ``RUN_DIR``,
``[--out cmp.png]``) is a syntax line, not a command, and is not run. ``bash scripts/*.sh`` and
``python benchmarks/*`` are not lldslight commands: the demo and the lab have their own tests.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TINY_DIMS
from tests.test_bad_input import run_cli

COMMANDS = ("fit", "validate", "test", "data", "index", "serve", "plot", "sft", "export")
BASES = ("demo.yaml", "searchr1_cpu.yaml", "recipes/", "lab/base.yaml")
FIT_LIKE = ("fit", "validate", "test")


def pages() -> list[Path]:
    """The README and the user pages and lab pages of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "lab").glob("*.md"))]


def page_name(page: Path) -> str:
    """``page`` as the tests below name it: README.md, or its path under docs/."""
    return page.name if page.parent == ROOT else page.relative_to(ROOT / "docs").as_posix()


def fenced_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    """The bodies of a page's fenced blocks in one of ``languages``, fences paired in order."""
    blocks, language, body = [], None, []
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence and language is None:
            language, body = fence.group(1), []
        elif fence:
            if language in languages:
                blocks.append("\n".join(body) + "\n")
            language = None
        elif language is not None:
            body.append(line)
    return blocks


def shell_blocks(text: str) -> list[str]:
    """The bodies of a page's fenced blocks in a shell language (or none)."""
    return fenced_blocks(text, ("", "bash", "sh", "shell", "console"))


def page_commands(page: Path) -> list[list[str]]:
    """The ``lldslight`` command lines of a page's shell blocks, continuation lines joined,
    comments dropped, in order."""
    out = []
    for block in shell_blocks(page.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.split(r"\s#", line)[0]  # a comment (an apostrophe in it is not a quote)
            if re.match(rf"\s*lldslight ({'|'.join(COMMANDS)})\s", line + " "):  # not "lldslight fit: error: ..."
                out.append(shlex.split(line)[1:])
    return out


PLACEHOLDER = re.compile(r"\[.*|.*\b[A-Z_]*(FILE|DIR|NAME|PATH|RECIPE|FIT|CKPT)[A-Z_]*\b.*")


def is_template(args: list[str]) -> bool:
    """A syntax line: an argument is a placeholder (FILE, RUN_DIR, FIT.yaml, runs/NAME/...) or optional ([--out X])."""
    return any(PLACEHOLDER.fullmatch(a) for a in args)


def tiny(args: list[str], real: bool) -> list[str]:
    """``args`` with the tiny settings (see the module's docstring)."""
    args = list(args)
    if args[0] in FIT_LIKE:
        for i, a in enumerate(args[:-1]):
            if a in ("--config", "-c") and args[i + 1].startswith("configs/") and any(b in args[i + 1] for b in BASES):
                base = yaml.safe_load((ROOT / args[i + 1]).read_text())
                name = base["trainer"]["logger"]["init_args"]["name"]
                args[i + 1] = "configs/tiny.yaml"
                args += ["--trainer.logger.init_args.name", name]
                break
        if args[0] == "fit":
            args += ["--trainer.max_steps", "1"] + ([] if real else ["--print_config"])
        elif not real:
            args += ["--print_config"]
    elif args[0] == "sft":
        args += ["--random-init", json.dumps(TINY_DIMS), "--limit", "4", "--lora-r", "4"]
    return args


def runnable(page: Path) -> list[list[str]]:
    return [c for c in page_commands(page) if not is_template(c)]


def reads_runs(page: Path) -> bool:
    """Some command of the page reads or writes a run directory by name (``runs/...``)."""
    return any(any(a.startswith("runs/") for a in c) for c in runnable(page))


def run_page(page: Path, tmp_path: Path, capsys=None) -> list[str]:
    """Run the page's commands (in this process with ``capsys``, else each in a child process, as
    a user runs them: its warnings printed as they would be); the failures, one line each."""
    commands = runnable(page)
    real = reads_runs(page)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "lab").symlink_to(ROOT / "lab")  # the lab's configs (lab/configs/) that pages name
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def lldslight(args: list[str]) -> subprocess.CompletedProcess:
        if capsys is not None:  # in this process: one import of lldslight for the page's commands
            code, err = run_cli(args, tmp_path, capsys)
            return subprocess.CompletedProcess(args, code, "", err)
        return subprocess.run([sys.executable, "-m", "lldslight.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)

    setup = lldslight(["data", "synth", "--config", "configs/demo.yaml"])
    assert setup.returncode == 0, setup.stderr[-2000:]
    failures = []
    for command in commands:
        proc = lldslight(tiny(command, real))
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            failures.append(f"{page.relative_to(ROOT)}: lldslight {shlex.join(command)}: exit {proc.returncode}: {last}")
        for noise in ("Traceback", "FutureWarning", "DeprecationWarning", "Tip:") if capsys is None else ("Traceback",):
            if noise in proc.stderr:
                failures.append(f"{page.relative_to(ROOT)}: lldslight {shlex.join(command)}: prints {noise!r}")
    return failures


def test_the_extraction_finds_the_commands():
    """The parser sees a page's commands: the README's plot after its two fits."""
    readme = page_commands(ROOT / "README.md")
    assert [c[0] for c in readme][-3:] == ["fit", "fit", "plot"], readme
    assert is_template(["plot", "RUN_DIR", "[RUN_DIR", "...]"]) and is_template(["data", "synth", "--config", "FIT.yaml"])
    assert not is_template(readme[-1]) and reads_runs(ROOT / "README.md")


PAGES_WITH_RUNS = [page_name(p) for p in pages() if reads_runs(p)]


@pytest.mark.parametrize("page", [page_name(p) for p in pages() if not reads_runs(p) and runnable(p)])
def test_a_pages_commands_parse(page, tmp_path, capsys):
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    failures = run_page(path, tmp_path, capsys)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_RUNS)
def test_a_pages_commands_run(page, tmp_path):
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    failures = run_page(path, tmp_path)
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- config blocks


def overlay_blocks() -> list[tuple[str, int, str]]:
    """(page, index, text) of every YAML block of the pages that is a config overlay: a mapping of
    config sections that defines no SearchRollout of its own (a block that does is a base config's
    excerpt, e.g. generation_backends.md's, and replaces the callbacks on purpose)."""
    out = []
    for page in pages():
        for i, text in enumerate(fenced_blocks(page.read_text(), ("yaml",))):
            cfg = yaml.safe_load(text)
            if isinstance(cfg, dict) and set(cfg) <= {"model", "data", "trainer", "seed_everything"} \
                    and "lldslight.callbacks.SearchRollout" not in text:
                out.append((page_name(page), i, text))
    return out


def composed_callbacks(configs: list[Path], cwd: Path, capsys) -> list[str]:
    from tests.test_bad_input import _printed

    args = [a for c in configs for a in ("--config", str(c))]
    return [c["class_path"] for c in _printed(args, cwd, capsys)["trainer"].get("callbacks") or []]


@pytest.mark.parametrize("page, index, text", overlay_blocks(), ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else "")
def test_a_pages_config_block_keeps_the_base_configs_callbacks(page, index, text, tmp_path, capsys):
    """An overlay written on a page, composed on the demo config as the pages compose them: every
    callback of the base stays (a plain `callbacks:` list replaces the base's, SearchRollout too,
    and the fit fails once the model has loaded); `callbacks+:` appends."""
    block = tmp_path / "block.yaml"
    block.write_text(text)
    base = composed_callbacks([ROOT / "configs" / "demo.yaml"], tmp_path, capsys)
    both = composed_callbacks([ROOT / "configs" / "demo.yaml", block], tmp_path, capsys)
    missing = [c for c in base if c not in both]
    assert not missing, f"{page}'s YAML block {index} drops the base config's {missing} (write `callbacks+:`)"


@pytest.mark.slow
def test_the_drift_bound_block_trains_as_an_overlay(tmp_path):
    """stability.md's drift-bound block on the tiny stand-in for the demo config, one step; 4
    prompts x group 2 = 8 rows, one per each of its 8 updates."""
    (text,) = [t for page, _, t in overlay_blocks() if page == "stability.md" and "AdaptiveRate" in t]
    block = tmp_path / "drift.yaml"
    block.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "lldslight.cli", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
                           "--config", str(block), "--trainer.max_steps", "1", "--data.batch_size", "4",
                           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = (tmp_path / "runs" / "tiny" / "version_0" / "metrics.csv").read_text()
    assert "drift/lr_scale" in metrics and "drift/updates" in metrics
