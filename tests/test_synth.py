"""The synthetic knowledge base: deterministic, readable by the real loaders, answers findable."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lldslight.data import iter_corpus, load_examples, read_flashrag_jsonl, read_searchr1_parquet, synthesize
from lldslight.data.cli import main as data_main
from lldslight.data.synth import SPLITS

FILES = ["corpus.jsonl", "manifest.json"] + [f"{s}.{e}" for s in SPLITS for e in ("parquet", "jsonl")]


@pytest.fixture(scope="module")
def kb(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return synthesize(tmp_path_factory.mktemp("kb"), seed=0, entities=100, dev=30, test=30)


def _bytes(d: Path) -> dict[str, bytes]:
    return {f: (d / f).read_bytes() for f in FILES}


def test_same_seed_same_bytes_other_seed_differs(kb: dict[str, Path], tmp_path: Path) -> None:
    again = synthesize(tmp_path / "a", seed=0, entities=100, dev=30, test=30)
    assert _bytes(kb["manifest"].parent) == _bytes(again["manifest"].parent)
    other = synthesize(tmp_path / "b", seed=1, entities=100, dev=30, test=30)
    diff = _bytes(other["manifest"].parent)
    assert all(diff[f] != v for f, v in _bytes(kb["manifest"].parent).items())


def test_idempotent_and_repairs(tmp_path: Path) -> None:
    paths = synthesize(tmp_path, seed=3, entities=40, dev=6, test=6)
    mtime = paths["train"].stat().st_mtime_ns
    synthesize(tmp_path, seed=3, entities=40, dev=6, test=6)
    assert paths["train"].stat().st_mtime_ns == mtime  # matching manifest: nothing written
    paths["corpus"].write_text("tampered\n")
    synthesize(tmp_path, seed=3, entities=40, dev=6, test=6)
    assert next(iter_corpus(paths["corpus"]))["id"] == "0"
    synthesize(tmp_path, seed=3, entities=40, dev=8, test=6)
    assert json.loads(paths["manifest"].read_text())["args"]["dev"] == 8


def test_round_trips_through_the_real_loaders(kb: dict[str, Path]) -> None:
    manifest = json.loads(kb["manifest"].read_text())
    for s in SPLITS:
        pq_ex = read_searchr1_parquet(kb[s])
        js_ex = read_flashrag_jsonl(kb[f"{s}_jsonl"])
        assert [(e.id, e.question, e.golden_answers, e.data_source, e.split) for e in pq_ex] == [
            (e.id, e.question, e.golden_answers, e.data_source, e.split) for e in js_ex]
        counts = {t: sum(e.data_source == f"synth_{t}" for e in pq_ex) for t in ("1hop", "2hop", "comparison")}
        assert counts == manifest["counts"][s]
    assert len(load_examples(kb["dev"])) == 30 and len(load_examples(kb["test_jsonl"])) == 30
    # dev/test take the types in turn, so per-data_source EM is measured on every type.
    assert min(manifest["counts"]["dev"].values()) >= 9
    questions = [e.question for s in SPLITS for e in read_flashrag_jsonl(kb[f"{s}_jsonl"])]
    assert len(questions) == len(set(questions))


def test_answers_live_in_the_corpus(kb: dict[str, Path]) -> None:
    by_title = {r["contents"].split("\n", 1)[0].strip('"'): r["contents"] for r in iter_corpus(kb["corpus"])}
    words = [len(c.split("\n", 1)[1].split()) for c in by_title.values()]
    assert len(by_title) == 100 and 20 <= sum(words) / len(words) <= 60
    exs = [e for s in SPLITS for e in read_flashrag_jsonl(kb[f"{s}_jsonl"])]
    for e in exs:
        titles = e.meta["supporting_titles"]
        assert all(t in by_title for t in titles)
        if e.data_source == "synth_1hop":
            assert e.golden_answers[0] in by_title[titles[0]], (e.question, titles)
        elif e.data_source == "synth_2hop":
            assert e.golden_answers[0] in by_title[titles[1]] and titles[1] in by_title[titles[0]]
        else:
            assert e.golden_answers[0] in titles


def test_bm25_on_the_entity_name_finds_its_passage(kb: dict[str, Path]) -> None:
    bm25s = pytest.importorskip("bm25s")
    rows = list(iter_corpus(kb["corpus"]))
    titles = [r["contents"].split("\n", 1)[0].strip('"') for r in rows]
    index = bm25s.BM25()
    index.index(bm25s.tokenize([r["contents"] for r in rows], stopwords="en", show_progress=False), show_progress=False)
    exs = [e for e in read_flashrag_jsonl(kb["train_jsonl"]) if e.data_source == "synth_1hop"]
    queries = [e.meta["supporting_titles"][0] for e in exs]
    docs, _ = index.retrieve(bm25s.tokenize(queries, stopwords="en", show_progress=False), k=3, show_progress=False)
    hits = sum(q in {titles[i] for i in d} for q, d in zip(queries, docs))
    assert hits == len(queries)


def test_cli_synth_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert data_main(["synth", "--out", str(tmp_path), "--seed", "2", "--entities", "40", "--dev", "6", "--test", "6"]) == 0
    assert data_main(["inspect", str(tmp_path / "dev.parquet")]) == 0
    out = capsys.readouterr().out
    assert "6 questions" in out and "synth_1hop: 2" in out
    assert data_main(["inspect", str(tmp_path / "corpus.jsonl")]) == 0
    assert "corpus, 40 passages" in capsys.readouterr().out
    assert data_main(["inspect", str(tmp_path / "missing.parquet")]) == 2


def test_cli_synth_from_a_fit_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fit.yaml"
    config.write_text(f"data:\n  synthesize: {{out_dir: {tmp_path / 'kb'}, seed: 2, entities: 40, dev: 6, test: 6}}\n")
    assert data_main(["synth", "--config", str(config)]) == 0
    manifest = json.loads((tmp_path / "kb" / "manifest.json").read_text())
    assert manifest["args"] == {"seed": 2, "entities": 40, "comparisons": 40, "dev": 6, "test": 6}
    (tmp_path / "bad.yaml").write_text("data: {batch_size: 2}\n")
    assert data_main(["synth", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "bad.yaml: data.synthesize must be a mapping with an out_dir, got None" in capsys.readouterr().err


def test_two_processes_synthesising_the_same_directory_at_once(kb: dict[str, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab builds its two warm-start policies side by side, and both synthesise the same data.
    A second process runs the whole synthesis to completion while the first is between writing its
    temporary corpus and renaming it: with shared temporary names the first one's rename fails."""
    import subprocess
    import sys

    import lldslight.data.synth as synth

    out = tmp_path / "shared"
    write = synth.write_corpus_jsonl
    calls = []

    def write_then_let_another_process_finish(corpus, path):  # type: ignore[no-untyped-def]
        write(corpus, path)
        if not calls:
            calls.append(path)
            code = f"from lldslight.data import synthesize; synthesize({str(out)!r}, seed=0, entities=100, dev=30, test=30)"
            subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

    monkeypatch.setattr(synth, "write_corpus_jsonl", write_then_let_another_process_finish)
    synthesize(out, seed=0, entities=100, dev=30, test=30)
    assert calls, "the interleaving under test did not happen"
    assert _bytes(out) == _bytes(kb["manifest"].parent)  # both finished, and the files are whole
    assert not list(out.glob("*.tmp"))
