"""configs/searchr1_cpu.yaml, walked through in docs/data_and_retrieval.md, builds as written and runs
end to end on ../shared/data against a real retrieval server (with a tiny random-init model in place of
SmolLM2, so it takes seconds)."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, TINY_DIMS, shared_data

CONFIG = ROOT / "configs" / "searchr1_cpu.yaml"


def test_searchr1_cpu_config_instantiates_with_an_http_retriever():
    from lldslight.callbacks import SearchRollout
    from lldslight.cli.lightning import TRAINER_DEFAULTS, _cli_class
    from lldslight.retrieval import HttpRetriever

    cli_cls, module_cls, datamodule_cls = _cli_class()
    cli = cli_cls(module_cls, datamodule_cls, args=["--config", str(CONFIG)], run=False,
                  trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=0, auto_configure_optimizers=False,
                  save_config_callback=None)
    rollout = next(cb for cb in cli.trainer.callbacks if isinstance(cb, SearchRollout))
    assert isinstance(rollout.retriever, HttpRetriever)
    assert rollout.retriever.url == "http://127.0.0.1:8000/retrieve"
    assert rollout.config.group_size >= 2 and cli.trainer.max_steps > 0
    assert cli.datamodule.synthesize is None
    # The data paths are the page's: ../shared/data relative to the repository root.
    files = cli.datamodule.files["train"] + cli.datamodule.files["val"]
    assert files and all(f.startswith("../shared/data/") for f in files)
    assert all((ROOT / f).resolve() == ROOT.parent / "shared" / "data" / f.removeprefix("../shared/data/") for f in files)


@pytest.mark.shared
def test_searchr1_cpu_config_fits_on_shared_data_through_a_real_server(tmp_path):
    from lldslight.retrieval import BM25Retriever, start_server

    corpus = shared_data("corpus", "wiki18_example10.jsonl")
    shared_data("searchr1", "nq_search_train5000.parquet")
    shared_data("searchr1", "nq_search_test100.parquet")
    work = tmp_path / "repo"  # the config's ../shared/data is relative to the repository root
    work.mkdir()
    (work / "configs").mkdir()
    cfg = yaml.safe_load(CONFIG.read_text())
    local_corpus = tmp_path / "corpus.jsonl"  # the shared folder is read-only: the index is cached beside a copy
    shutil.copy(corpus, local_corpus)
    with start_server(BM25Retriever(corpus=str(local_corpus), show_progress=False)) as server:
        search = cfg["trainer"]["callbacks"][0]["init_args"]
        search["retriever"]["init_args"]["url"] = server.url
        cfg["trainer"].update(max_steps=1, enable_progress_bar=False)
        cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
        cfg["model"]["policy"].update(random_init=dict(TINY_DIMS), lora={"r": 4, "alpha": 8})
        cfg["data"].update(limit_train=4, limit_val=2)
        run_cfg = work / "configs" / "run.yaml"
        run_cfg.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        # ../shared/data from `work` must be the real one: link it beside the copy of the repository.
        link = tmp_path / "shared"
        link.symlink_to(ROOT.parent / "shared")
        proc = subprocess.run([sys.executable, "-m", "lldslight.cli", "fit", "--config", str(run_cfg)], cwd=work,
                              env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "searchr1-cpu" / "version_0"
    with open(run / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/reward")]
    assert len(rows) == 1 and 0.0 <= float(rows[0]["train/reward"]) <= 1.0
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_index_and_export_outputs_are_git_ignored():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    for path in ("idx/wiki18_1k/lldslight_index.json", "exported/searchr1-cpu/model.safetensors"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
