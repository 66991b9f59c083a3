"""The documentation holds up: every relative link of README.md and docs/ resolves, and every
metric key the code logs has a row in docs/metrics.md.

Metric keys are collected by two nets, because neither sees them all:
- a real tiny training run (tiny.yaml composed with LLDS, LLDMonitor, the gradient-spike guard,
  dynamic sampling and before/after evaluation): the columns of its metrics.csv. This catches the
  keys built at run time (``train/<update stat>``, ``time/<phase>``, ``lld/logp_<set>``,
  ``diag/p_<tag>``, ``val_before/em/<data_source>``) and proves the documented names are the
  logged ones;
- a regex over lldslight/'s source for ``"namespace/key"`` string literals used as dict keys,
  assigned by subscript (``metrics["k"] = ...``) or passed to a ``log``/``log_dict``/``_log`` call.
  This catches the keys that run does not reach (``guard/restored``, ``guard/stopped``,
  ``guard/clipped``, ``retrieval/unavailable``, ``sft/loss``, a key added to a rarely taken branch).
A documented key may hold a variable part in angle brackets (``val/em/<data_source>``): it matches
one path segment. The real run's keys must also each have a reduction rule in
lldslight/run/metric_rules.py (tests/test_metric_rules.py checks the rules themselves).
"""
from __future__ import annotations

import csv
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METRICS_PAGE = ROOT / "docs" / "metrics.md"


# -- links ---------------------------------------------------------------------------------------


def pages() -> list[Path]:
    """The pages a reader follows: the README, docs/, and lab/'s own pages (its archives' dated
    registrations are records, kept as written)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "lab").glob("*.md"))]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^(```|~~~).*?^\1", "", path.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(path.read_text()))


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{where}: outside the repository (a clone does not have it)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where}: no heading with anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def linked_from(page: Path) -> set[Path]:
    """The files ``page`` links to (relative links, anchors dropped)."""
    return {(page.parent / t.partition("#")[0]).resolve() for t in links(page) if not re.match(r"[a-z][a-z0-9+.-]*:", t)}


def test_every_docs_page_is_in_the_index():
    """docs/index.md links every page under docs/ and docs/lab/ (directly), so none is an orphan;
    the README links the index."""
    index = ROOT / "docs" / "index.md"
    docs = [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "lab").glob("*.md")]
    orphans = [p.relative_to(ROOT / "docs").as_posix() for p in sorted(docs)
               if p != index and p.resolve() not in linked_from(index)]
    assert not orphans, f"pages docs/index.md does not link: {orphans}"
    assert index.resolve() in linked_from(ROOT / "README.md")


def test_readme_is_a_front_door():
    """The two commands within the README's first 40 lines, the page short, its results a card:
    at most 8 rows of claim | verdict | the number | details, each row under ~160 characters and
    linking docs/results.md, where the long form lives."""
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    head = "\n".join(lines[:40])
    assert "bash scripts/demo.sh" in head and "bash scripts/test.sh" in head
    assert len(lines) <= 130, len(lines)
    (header,) = [l for l in lines if l.startswith("| claim |")]
    assert header == "| claim | verdict | the number | details |", header
    rows = [l for l in lines if l.startswith("| ") and l != header]
    assert 1 <= len(rows) <= 8 and all(l.count("|") == 5 for l in rows), rows
    long = [f"{len(l)}: {l}" for l in rows if len(l) > 165]
    assert not long, "card rows over ~160 characters (the detail belongs in docs/results.md):\n" + "\n".join(long)
    results = (ROOT / "docs" / "results.md").resolve()
    assert all(re.search(r"\]\(docs/results\.md(#[\w-]+)?\)", l) for l in rows), rows
    assert results in linked_from(readme)


def test_readme_commands_and_yaml(tmp_path, monkeypatch):
    """.ci/run calls the README's test command; the README's composition YAML builds on demo.yaml."""
    from lightning.pytorch.cli import LightningCLI

    from lldslight.callbacks import LLDS, GradientSpikeGuard, LLDMonitor, SearchRollout
    from lldslight.cli.lightning import TRAINER_DEFAULTS
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.module import GRPOModule

    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", readme, flags=re.S) if "lldslight.callbacks.LLDS" in b)
    (tmp_path / "my_run.yaml").write_text(block)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lldslight"])
    cli = LightningCLI(
        GRPOModule, SearchQADataModule, run=False, trainer_defaults=TRAINER_DEFAULTS, save_config_callback=None,
        auto_configure_optimizers=False, args=["--config", str(ROOT / "configs" / "demo.yaml"), "--config", "my_run.yaml"],
    )
    kinds = {type(c) for c in cli.trainer.callbacks}
    assert {SearchRollout, LLDS, LLDMonitor, GradientSpikeGuard} <= kinds
    assert cli.model.update_config.updates_per_rollout == 4


def test_slug_rules():
    assert slug("Speed and memory vs TRL (CPU)") == "speed-and-memory-vs-trl-cpu"
    assert slug("The runner and its criteria") == "the-runner-and-its-criteria"
    assert slug("`lldslight sft`: warm start") == "lldslight-sft-warm-start"
    assert slug("Gradient-spike guard") == "gradient-spike-guard"


# -- metric keys ---------------------------------------------------------------------------------

_KEY = r"[\"']([a-z][a-z0-9_]*/[a-z0-9_]+(?:/[a-z0-9_]+)*)[\"']"
_LOGGED_LITERALS = (
    re.compile(_KEY + r"\s*:"),  # {"train/reward": ...}
    re.compile(r"\[\s*" + _KEY + r"\s*\]\s*="),  # metrics["guard/vetoed"] = ...
    re.compile(r"\b_?log(?:_dict|_metrics)?\(\s*(?:[\w.]+\s*,\s*)?" + _KEY),  # self.log("sft/loss", ...)
)


def documented_keys(text: str) -> list[re.Pattern]:
    """The keys named in the first cell of docs/metrics.md's table rows, as patterns."""
    out = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        for key in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            out.append(re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">"))))
    return out


def undocumented(keys: set[str], text: str) -> list[str]:
    patterns = documented_keys(text)
    return sorted(k for k in keys if not any(p.fullmatch(k) for p in patterns))


def source_keys() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted((ROOT / "lldslight").rglob("*.py")):
        text = path.read_text()
        for pattern in _LOGGED_LITERALS:
            for m in pattern.finditer(text):
                found.setdefault(m.group(1), str(path.relative_to(ROOT)))
    return found


def test_source_keys_are_documented():
    found = source_keys()
    assert {"train/reward", "llds/beta", "guard/stopped", "sft/loss", "retrieval/unavailable"} <= set(found)
    missing = undocumented(set(found), METRICS_PAGE.read_text())
    assert not missing, "logged in the code but not in docs/metrics.md: " + ", ".join(f"{k} ({found[k]})" for k in missing)


def test_a_missing_row_fails():
    """The check bites: drop one row from the page and the key it named is reported."""
    text = METRICS_PAGE.read_text()
    without = "\n".join(line for line in text.splitlines() if not line.startswith("| `llds/beta`"))
    assert undocumented({"llds/beta", "train/reward"}, without) == ["llds/beta"]
    assert undocumented({"val_after/em/synth_1hop"}, text) == []
    assert undocumented({"val_after/em/a/b"}, text) == ["val_after/em/a/b"]  # a placeholder is one segment


RUN = """trainer:
  max_steps: 2
  enable_checkpointing: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {save_dir: runs, name: docs, flush_logs_every_n_steps: 1}
  callbacks:
    - class_path: lldslight.callbacks.SearchRollout
      init_args:
        retriever:
          class_path: lldslight.retrieval.BM25Retriever
          init_args: {corpus: .lldslight/tiny_data/corpus.jsonl}
        reward: {class_path: run_helpers.ParityReward}
        rollout: {group_size: 2, max_turns: 1, max_new_tokens: 8, max_obs_tokens: 32, max_response_tokens: 64, topk: 1, temperature: 1.0}
        eval_max_turns: 1
        eval_before_fit: true
        eval_after_fit: true
        dynamic_sampling: {enabled: true, max_rounds: 1}
    - class_path: lldslight.callbacks.LLDS
      init_args: {coef: 0.2, answer_masking: paper}
    - class_path: lldslight.callbacks.LLDMonitor
      init_args: {plot: false}
    - class_path: lldslight.callbacks.GradientSpikeGuard
      init_args: {warmup: 0}
"""


@pytest.mark.slow
def test_logged_keys_of_a_real_run_are_documented(tmp_path, monkeypatch):
    from lldslight.cli import main

    (tmp_path / "run.yaml").write_text(RUN)
    monkeypatch.chdir(tmp_path)
    # tiny.yaml: the random-init 2-layer model, kl_coef > 0 (so train/kl and lld/ref_logp_* appear).
    assert main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--config", "run.yaml"]) == 0
    with open(tmp_path / "runs" / "docs" / "version_0" / "metrics.csv") as f:
        keys = set(next(csv.reader(f)))
    for expected in ("train/kl", "llds/loss", "lld/delta_correct", "guard/vetoed", "rollout/filled", "val_after/em"):
        assert expected in keys, f"the run did not log {expected}: the net is not composed as intended"
    missing = undocumented(keys, METRICS_PAGE.read_text())
    assert not missing, "logged by a real run but not in docs/metrics.md: " + ", ".join(missing)
    from lldslight.run.metric_rules import rule_for

    no_rule = sorted(k for k in keys - {"step", "epoch"} if rule_for(k) is None)  # Lightning's own columns aside
    assert not no_rule, "logged by a real run but no reduction rule in lldslight/run/metric_rules.py: " + ", ".join(no_rule)
