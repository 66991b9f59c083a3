"""Readers and writers of lldslight.data.formats: round trips, real public files, error messages."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from lldslight.data import (
    ANSWER_SPLIT,
    DataFormatError,
    QAExample,
    iter_corpus,
    load_2wiki,
    load_examples,
    load_hf_dataset,
    load_hotpotqa_with_contexts,
    load_musique,
    make_prompt,
    read_flashrag_jsonl,
    read_searchr1_parquet,
    write_corpus_jsonl,
    write_flashrag_jsonl,
    write_searchr1_parquet,
)
from lldslight.data.formats import SEARCHR1_SCHEMA, template_messages

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def shared(rel: str) -> Path:
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"{p} not present")
    return p


def _examples() -> list[QAExample]:
    qs = [("Who painted The Garden of Vexari", ["Dvuten Azox", "Azox"], "synth_1hop"),
          ("In what year was Korvath Labs founded?", ["1961"], "synth_1hop"),
          ("Which city is older, Telvara or Sekve?", ["Sekve"], "synth_comparison")]
    return [
        QAExample(id=f"q{i}", question=q, golden_answers=a, data_source=s, messages=template_messages(q), split="dev")
        for i, (q, a, s) in enumerate(qs)
    ]


# ----------------------------------------------------------------------------- round trips


def test_searchr1_parquet_round_trip(tmp_path: Path) -> None:
    path = write_searchr1_parquet(_examples(), tmp_path / "x.parquet")
    assert pq.read_schema(path).remove_metadata().equals(SEARCHR1_SCHEMA)
    back = read_searchr1_parquet(path)
    for a, b in zip(_examples(), back):
        assert (b.id, b.question, b.golden_answers, b.data_source, b.split) == (
            a.id, a.question, a.golden_answers, a.data_source, a.split)
        assert b.messages == [{"role": "user", "content": make_prompt(a.question)}]
        assert b.meta["file_messages"] == a.messages
    row = pq.read_table(path).to_pylist()[0]
    assert row["reward_model"] == {"ground_truth": {"target": ["Dvuten Azox", "Azox"]}, "style": "rule"}
    assert row["extra_info"] == {"index": 0, "split": "dev"}


def test_flashrag_round_trip(tmp_path: Path) -> None:
    path = write_flashrag_jsonl(_examples(), tmp_path / "x.jsonl")
    back = read_flashrag_jsonl(path)
    assert [(b.id, b.question, b.golden_answers, b.data_source, b.split) for b in back] == [
        (a.id, a.question, a.golden_answers, a.data_source, a.split) for a in _examples()]
    assert read_flashrag_jsonl(path, data_source="mine")[0].data_source == "mine"


def test_corpus_round_trip(tmp_path: Path) -> None:
    rows = [{"id": "0", "contents": '"Telvara"\nTelvara is a city.'}, {"id": 7, "contents": '"B"\nb'}]
    path = write_corpus_jsonl(rows, tmp_path / "c.jsonl")
    assert list(iter_corpus(path)) == [{"id": "0", "contents": '"Telvara"\nTelvara is a city.'},
                                       {"id": "7", "contents": '"B"\nb'}]
    with pytest.raises(DataFormatError, match=r"row 1, field 'contents': missing field"):
        write_corpus_jsonl([{"id": "0"}], tmp_path / "bad.jsonl")


def test_hf_dataset_from_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"id": "a", "question": "q one", "golden_answers": ["x"]},
                                     {"id": "b", "question": "q two", "golden_answers": ["y", "z"]}])
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "hf"))
    exs = load_hf_dataset(tmp_path / "hf", split="test")
    assert [(e.id, e.golden_answers, e.data_source, e.split) for e in exs] == [
        ("a", ["x"], "hf", "test"), ("b", ["y", "z"], "hf", "test")]
    assert [e.id for e in load_examples(tmp_path / "hf")] == ["a", "b"]  # one split: picked
    with pytest.raises(DataFormatError, match="split 'train' not found"):
        load_hf_dataset(tmp_path / "hf", split="train")


# ----------------------------------------------------------------------------- variants


def _write_rows(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "v.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_searchr1_variants(tmp_path: Path) -> None:
    prompt = [{"role": "user", "content": make_prompt("who wrote hamlet")}]
    rows = [
        {"data_source": "nq", "prompt": prompt, "ability": "fact-reasoning",
         "reward_model": {"style": "rule", "ground_truth": f"Shakespeare{ANSWER_SPLIT}William Shakespeare"},
         "extra_info": {"split": "test", "index": 5}},
        {"data_source": "nq", "prompt": prompt, "ability": "fact-reasoning",
         "reward_model": {"style": "rule", "ground_truth": {"target": "Shakespeare"}},
         "extra_info": {"split": "test", "index": 6}},
    ]
    # A string ground truth and a struct one cannot share a parquet column: one file each.
    a = read_searchr1_parquet(_write_rows(tmp_path, rows[:1]))[0]
    assert a.golden_answers == ["Shakespeare", "William Shakespeare"]
    assert a.question == "who wrote hamlet?"  # from the prompt, text after the last "Question:"
    assert (a.id, a.split, a.data_source) == ("nq_test_5", "test", "nq")
    b = read_searchr1_parquet(_write_rows(tmp_path, rows[1:]))[0]
    assert b.golden_answers == ["Shakespeare"]


def test_flashrag_r1searcher_variant(tmp_path: Path) -> None:
    p = tmp_path / "bamboo.jsonl"
    p.write_text(json.dumps({"idx": 3, "question": " Who? ", "answer": "me"}) + "\n\n")
    (ex,) = read_flashrag_jsonl(p)
    assert (ex.id, ex.question, ex.golden_answers, ex.data_source) == ("3", "Who?", ["me"], "bamboo")


def test_bare_number_answers_are_read_as_strings(tmp_path: Path) -> None:
    # FlashRAG-style files store some years as bare numbers, alone or in a list
    p = tmp_path / "years.jsonl"
    p.write_text(json.dumps({"id": 1, "question": "When?", "answer": 1961}) + "\n"
                 + json.dumps({"id": 2, "question": "When?", "golden_answers": [1962, "62"]}) + "\n")
    a, b = read_flashrag_jsonl(p)
    assert (a.golden_answers, b.golden_answers) == (["1961"], ["1962", "62"])
    p.write_text(json.dumps({"id": 1, "question": "When?", "answer": True}) + "\n")
    with pytest.raises(DataFormatError, match=r"years\.jsonl, row 1"):
        read_flashrag_jsonl(p)


# ----------------------------------------------------------------------------- errors


def test_malformed_parquet_row_names_file_row_field(tmp_path: Path) -> None:
    rows = [{"data_source": "nq", "question": f"q{i}",
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"a{i}"]}}} for i in range(5)]
    rows[3]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = _write_rows(tmp_path, rows)
    with pytest.raises(DataFormatError) as e:
        read_searchr1_parquet(path)
    msg = str(e.value)
    assert str(path) in msg and "row 4," in msg and "reward_model.ground_truth" in msg  # rows[3]: the 4th, from 1


def test_malformed_jsonl_row_names_file_row_field(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": 1, "question": "q", "golden_answers": ["a"]}\n{"id": 2, "question": "q"}\n')
    with pytest.raises(DataFormatError, match=r"x\.jsonl, row 2, field 'golden_answers'"):  # line 2
        load_examples(p)
    p.write_text('{"id": 1, "question": "q", "golden_answers": ["a"]}\n{not json\n')
    with pytest.raises(DataFormatError, match=r"row 2.*line 2 is not valid JSON"):
        load_examples(p)


def test_missing_file_and_corpus_given_as_questions(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="nope.parquet: no such file"):
        load_examples(tmp_path / "nope.parquet")
    with pytest.raises(DataFormatError, match="no such file"):
        next(iter_corpus(tmp_path / "nope.jsonl"))
    c = write_corpus_jsonl([{"id": "0", "contents": '"T"\nx'}], tmp_path / "c.jsonl")
    with pytest.raises(DataFormatError, match="is a corpus"):
        load_examples(c)


# ----------------------------------------------------------------------------- real public data


@pytest.mark.shared
@pytest.mark.parametrize(
    "rel, n, source",
    [
        ("searchr1/nq_search_test100.parquet", 100, "nq"),
        ("searchr1/nq_search_train5000.parquet", 5000, "nq"),
        ("flashrag/nq_test17.jsonl", 17, "nq_test17"),
        ("flashrag/bamboogle_r1searcher.jsonl", 125, "bamboogle_r1searcher"),
        ("flashrag/hotpotqa500_r1searcher.jsonl", 500, "hotpotqa500_r1searcher"),
        ("multihop/hotpotqa_dev500_with_contexts.jsonl", 500, "hotpotqa"),
        ("multihop/2wiki_questions1000.json", 1000, "2wikimultihopqa"),
        ("multihop/musique_train100.json", 100, "musique"),
    ],
)
def test_shared_question_files_load(rel: str, n: int, source: str) -> None:
    exs = load_examples(shared(rel))
    assert len(exs) == n and {e.data_source for e in exs} == {source}
    assert all(e.question and e.golden_answers and e.messages[0]["content"] == make_prompt(e.question) for e in exs)
    assert len({e.id for e in exs}) == n


@pytest.mark.shared
def test_shared_searchr1_prompt_is_the_template() -> None:
    exs = read_searchr1_parquet(shared("searchr1/nq_search_test100.parquet"))
    assert all(e.meta["file_messages"] == e.messages for e in exs)
    assert exs[0].golden_answers == ["Wilhelm Conrad Röntgen"] and exs[0].split == "test"


@pytest.mark.shared
@pytest.mark.parametrize("rel, n", [("corpus/wiki18_first1000.jsonl", 1000), ("corpus/wiki18_example10.jsonl", 10),
                                    ("multihop/2wiki_corpus.json", 6119), ("multihop/musique_train100_corpus.json", 1890)])
def test_shared_corpora_load(rel: str, n: int) -> None:
    rows = list(iter_corpus(shared(rel)))
    assert len(rows) == n and len({r["id"] for r in rows}) == n
    assert all("\n" in r["contents"] for r in rows)  # wiki-18 does not always quote the title


@pytest.mark.shared
def test_shared_multihop_corpora_hold_the_supporting_passages() -> None:
    exs, corpus = load_hotpotqa_with_contexts(shared("multihop/hotpotqa_dev500_with_contexts.jsonl"))
    ids = {r["id"] for r in corpus}
    assert len(ids) == len(corpus) == 4858  # 4931 paragraphs, shared ones stored once
    assert all(len(e.meta["supporting_ids"]) == 2 and set(e.meta["supporting_ids"]) <= ids for e in exs)

    exs, corpus = load_2wiki(shared("multihop/2wiki_questions1000.json"), shared("multihop/2wiki_corpus.json"))
    assert len(corpus) == 6119 and sum(bool(e.meta["supporting_ids"]) for e in exs) > 950

    exs, corpus = load_musique(shared("multihop/musique_train100.json"), shared("multihop/musique_train100_corpus.json"))
    assert all(e.meta["supporting_ids"] for e in exs)
    assert exs[0].golden_answers == ["G. Stanley Hall", "Stanley Hall"]


# ----------------------------------------------------------------------------- multi-hop sets, by hand


def test_multihop_loaders_link_supporting_passages_by_hand(tmp_path: Path) -> None:
    ctx = lambda i, t, s: {"id": i, "title": t, "paragraph_text": f"{t} text.", "is_supporting": s}  # noqa: E731
    hot = tmp_path / "hot.jsonl"
    hot.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": "a", "question_text": "Qa?", "answers_objects": [{"spans": ["x"]}],
         "contexts": [ctx(0, "P", "True"), ctx(1, "Shared", "False"), ctx(2, "R", "True")]},
        {"question_id": "b", "question_text": "Qb?", "answers_objects": [{"spans": ["y", "z"]}],
         "contexts": [ctx(0, "Shared", "True"), ctx(1, "S", "False")]},
    ]))
    exs, corpus = load_hotpotqa_with_contexts(hot)
    # "Shared" is stored once, under its first id a-1; question b points at it.
    assert [r["id"] for r in corpus] == ["a-0", "a-1", "a-2", "b-1"]
    assert corpus[1]["contents"] == '"Shared"\nShared text.'
    assert [e.meta["supporting_ids"] for e in exs] == [["a-0", "a-2"], ["a-1"]]
    assert [c["id"] for c in exs[1].meta["contexts"]] == ["a-1", "b-1"]
    assert exs[1].golden_answers == ["y", "z"] and exs[0].data_source == "hotpotqa"

    two_q, two_c = tmp_path / "2w.json", tmp_path / "2w_corpus.json"
    two_q.write_text(json.dumps([{"question": "Q?", "answer": "1961", "question_type": "compose",
                                  "evidence": [["Azox", "born", "Telvara"], ["Telvara", "in", "Vex"], ["Azox", "x", "y"]]}]))
    two_c.write_text(json.dumps([{"title": "Telvara", "text": "t"}, {"title": "Azox", "text": "a"},
                                 {"title": "Other", "text": "o"}, {"title": "Azox", "text": "a2"}]))
    (ex,), corpus = load_2wiki(two_q, two_c)
    assert (ex.id, ex.golden_answers, ex.meta["supporting_titles"]) == ("2w_0", ["1961"], ["Azox", "Telvara"])
    assert ex.meta["supporting_ids"] == ["1", "3", "0"] and len(corpus) == 4

    mu_q, mu_c = tmp_path / "mu.json", tmp_path / "mu_corpus.json"
    mu_q.write_text(json.dumps([{"id": "m1", "question": "Q?", "answer": "A", "answer_aliases": ["A", "Aa"],
                                 "question_decomposition": [], "paragraphs": [
                                     {"idx": 0, "title": "T", "paragraph_text": "one", "is_supporting": True},
                                     {"idx": 1, "title": "T", "paragraph_text": "two", "is_supporting": False}]}]))
    mu_c.write_text(json.dumps([{"title": "T", "text": "two"}, {"title": "T", "text": "one"}]))
    (ex,), _ = load_musique(mu_q, mu_c)
    assert ex.golden_answers == ["A", "Aa"] and ex.meta["supporting_ids"] == ["1"]  # by contents, not title


def test_multihop_malformed_records_name_the_field(tmp_path: Path) -> None:
    p = tmp_path / "hot.jsonl"
    p.write_text(json.dumps({"question_text": "Q?", "answers_objects": [{"spans": ["x"]}], "contexts": []}))
    with pytest.raises(DataFormatError, match=r"hot\.jsonl, row 1, field 'question_id'"):
        load_examples(p)
    p = tmp_path / "mu.json"
    p.write_text(json.dumps([{"id": "m", "question": "Q?", "answer": "A", "question_decomposition": [],
                              "paragraphs": [{"title": "T", "paragraph_text": "x"}, {"title": "T"}]}]))
    with pytest.raises(DataFormatError, match=r"mu\.json, row 1, field 'paragraphs\[1\]\.paragraph_text'"):
        load_examples(p)
