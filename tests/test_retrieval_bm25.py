"""BM25Retriever: search quality on a small corpus, laziness, on-disk caching, explicit indexes."""
import json
import os
import pickle

import pytest

from lldslight.retrieval import BM25Retriever, RetrievalError, Retriever, load_index
from lldslight.retrieval.cli import index_main
from lldslight.retrieval.index import CONFIG_NAME

FACTS = [
    ("Paris", "Paris is the capital and most populous city of France, on the Seine."),
    ("Berlin", "Berlin is the capital of Germany and its largest city."),
    ("Tokyo", "Tokyo is the capital of Japan; the Greater Tokyo Area is the most populous metropolitan area."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("Amazon River", "The Amazon River in South America is the largest river by discharge volume of water."),
    ("Marie Curie", "Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity."),
    ("Python (programming language)", "Python is a high-level programming language created by Guido van Rossum."),
    ("Great Wall of China", "The Great Wall of China is a series of fortifications built across northern China."),
    ("Photosynthesis", "Photosynthesis is the process by which plants convert light energy into chemical energy."),
    ("Jupiter", "Jupiter is the fifth planet from the Sun and the largest in the Solar System."),
]


def write_corpus(path, facts=FACTS):
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"{t}"\n{x}'}) + "\n"
                            for i, (t, x) in enumerate(facts)))
    return path


def test_finds_the_right_passage(tmp_path):
    r = BM25Retriever(str(write_corpus(tmp_path / "c.jsonl")), show_progress=False)
    assert isinstance(r, Retriever)
    res = r.search(["capital of Japan", "highest mountain on Earth", "who created Python programming language"], 2)
    assert [ps[0].title for ps in res] == ["Tokyo", "Mount Everest", "Python (programming language)"]
    assert all(len(ps) <= 2 for ps in res)
    assert res[0][0].id == "d2" and res[0][0].score > 0
    assert res[0][0].text.startswith("Tokyo is the capital")


def test_no_known_word_gives_no_passage_and_k_is_clamped(tmp_path):
    r = BM25Retriever(str(write_corpus(tmp_path / "c.jsonl")), show_progress=False)
    res = r.search(["qwxyzzy", "the of and", "river"], 50)
    assert res[0] == [] and res[1] == []
    assert [p.title for p in res[2]] == ["Amazon River"]  # only passages sharing a term, like Lucene
    assert r.search([], 3) == []


def test_construction_is_lazy_and_missing_corpus_names_path(tmp_path):
    missing = tmp_path / "later.jsonl"
    r = BM25Retriever(str(missing), show_progress=False)  # configs build retrievers before the data exists
    assert not r.loaded and not list(tmp_path.iterdir())
    with pytest.raises(RetrievalError, match=str(missing)):
        r.search(["x"], 1)
    write_corpus(missing)
    assert r.search(["Jupiter planet"], 1)[0][0].title == "Jupiter"


def test_cache_reused_then_rebuilt_when_corpus_changes(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl")
    r1 = BM25Retriever(str(corpus), show_progress=False).load()
    assert r1.build_count == 1 and r1.index_path.parent == tmp_path and r1.index_path.name.startswith(".c.jsonl.bm25-")
    mtime = os.stat(r1.index_path / CONFIG_NAME).st_mtime_ns

    r2 = BM25Retriever(str(corpus), show_progress=False).load()
    assert r2.build_count == 0 and r2.index_path == r1.index_path
    assert os.stat(r2.index_path / CONFIG_NAME).st_mtime_ns == mtime

    write_corpus(corpus, FACTS + [("Saturn", "Saturn is the sixth planet and has prominent rings.")])
    r3 = BM25Retriever(str(corpus), show_progress=False)
    assert r3.search(["planet with rings"], 1)[0][0].title == "Saturn"
    assert r3.build_count == 1 and r3.index_path != r1.index_path
    assert not r1.index_path.exists()  # the stale cache entry is removed
    # A different setting is a different index, not a reuse of the old one.
    r4 = BM25Retriever(str(corpus), k1=0.9, show_progress=False).load()
    assert r4.build_count == 1 and r4.index_path != r3.index_path


def test_index_dir_as_cache_root(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl")
    cache = tmp_path / "cache"
    r = BM25Retriever(str(corpus), index_dir=str(cache), show_progress=False).load()
    assert r.index_path.parent == cache
    assert BM25Retriever(str(corpus), index_dir=str(cache), show_progress=False).load().build_count == 0


def test_read_only_corpus_dir_falls_back_to_user_cache(tmp_path, monkeypatch):
    data = tmp_path / "ro"
    data.mkdir()
    corpus = write_corpus(data / "c.jsonl")
    data.chmod(0o555)
    monkeypatch.setenv("LLDSLIGHT_CACHE", str(tmp_path / "usercache"))
    try:
        r = BM25Retriever(str(corpus), show_progress=False).load()
        assert str(r.index_path).startswith(str(tmp_path / "usercache"))
        assert sorted(os.listdir(data)) == ["c.jsonl"]  # even root leaves a r-x directory alone
    finally:
        data.chmod(0o755)


def test_explicit_index_via_cli_and_load_index(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "idx"
    assert index_main(["--corpus", str(corpus), "--retriever", "bm25", "--out", str(out), "--quiet", "--k1", "1.2"]) == 0
    assert "10 passages" in capsys.readouterr().out
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["retriever"] == "bm25" and cfg["settings"]["k1"] == 1.2
    assert cfg["corpus"]["path"] == str(corpus.resolve()) and cfg["corpus"]["count"] == 10

    r = load_index(str(out))
    assert isinstance(r, BM25Retriever) and r.k1 == 1.2 and r.build_count == 0
    assert r.search(["largest planet Solar System"], 1)[0][0].title == "Jupiter"
    # The retriever constructor accepts the explicit index too, when the settings agree...
    assert BM25Retriever(index_dir=str(out), k1=1.2).search(["Seine"], 1)[0][0].title == "Paris"
    # ...and says which setting differs when they do not.
    with pytest.raises(RetrievalError, match="k1: index has 1.2, retriever has 1.5"):
        BM25Retriever(index_dir=str(out)).load()

    write_corpus(corpus, FACTS[:5])  # an explicit index is never silently rebuilt
    with pytest.raises(RetrievalError, match="changed since the index"):
        load_index(str(out))


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.tex").write_text("do not delete")
    assert index_main(["--corpus", str(corpus), "--out", str(out), "--quiet"]) == 2
    assert (out / "thesis.tex").exists()


def test_pickles_for_worker_processes(tmp_path):
    r = BM25Retriever(str(write_corpus(tmp_path / "c.jsonl")), show_progress=False)
    r.search(["Berlin"], 1)
    r2 = pickle.loads(pickle.dumps(r))
    assert r2.search(["capital of Germany"], 1)[0][0].title == "Berlin"
