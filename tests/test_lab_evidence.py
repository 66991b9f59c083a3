"""The committed lab evidence: every report under docs/collapse_lab/ is recomputed from its archived
per-step metrics (``benchmarks/collapse.py --report-only``) and must equal the committed one, so no
number of the reports can drift from the data it claims to summarise."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, load_benchmark

LAB = ROOT / "docs" / "collapse_lab"


def current_runner_sets() -> list[str]:
    """Sets written by today's runner: their collapse.json has a ``horizon`` (the earlier lab's
    reports, docs/collapse_lab/plateau/ and single_seed/, were judged by the runner of commit
    d613d79 under other criteria and are kept as they were)."""
    out = []
    for report in sorted(LAB.glob("*/collapse.json")):
        if "horizon" in json.loads(report.read_text()):
            out.append(report.parent.name)
    return out


SETS = current_runner_sets()


@pytest.fixture(scope="module")
def collapse():
    return load_benchmark("collapse")


@pytest.mark.parametrize("name", SETS)
def test_committed_report_is_recomputed_from_its_metrics(collapse, name: str, tmp_path: Path) -> None:
    src, dst = LAB / name, tmp_path / name
    # Only the evidence travels: per-run metrics and summaries, and collapse.json's meta (commands,
    # CPU time); the committed table and figure are what is checked, so they stay behind.
    for run in src.glob("*/seed*"):
        (dst / run.relative_to(src)).mkdir(parents=True)
        for f in ("metrics.csv.gz", "summary.json"):
            if (run / f).is_file():
                shutil.copy(run / f, dst / run.relative_to(src) / f)
    shutil.copy(src / "collapse.json", dst / "collapse.json")
    assert collapse.main(["--name", name, "--report-only", "--no-figure", "--archive", str(dst)]) == 0
    assert (dst / "collapse.md").read_text() == (src / "collapse.md").read_text(), (
        f"docs/collapse_lab/{name}/collapse.md differs from its recomputation: run "
        f"`python benchmarks/collapse.py --name {name} --report-only`")
