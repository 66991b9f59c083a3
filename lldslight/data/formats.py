"""Readers and writers for every question and corpus format lldslight accepts (DESIGN.md, Contracts).

Every question reader returns :class:`QAExample` with ``messages`` built from the Search-R1 template;
a file's own prompt, when it has one, is kept in ``meta["file_messages"]`` so the DataModule can
choose. Every malformed record raises :class:`DataFormatError` naming the file, the row (0-based)
and the field, because a bad row in a 5000-row parquet is otherwise a needle in a haystack.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lldslight.data.example import QAExample, make_prompt
from lldslight.errors import UserError

ANSWER_SPLIT = "<|answer_split|>"

# The schema of Search-R1's own parquet files (nq_search.py), plus the id/question/golden_answers
# columns their released files carry. Written explicitly so that an empty list never makes
# pyarrow infer `null` and so that the output reads back in verl unchanged.
SEARCHR1_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("question", pa.string()),
        ("golden_answers", pa.list_(pa.string())),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        (
            "reward_model",
            pa.struct(
                [
                    ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
                    ("style", pa.string()),
                ]
            ),
        ),
        ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
    ]
)


class DataFormatError(UserError, ValueError):
    """A data file is missing, unreadable or has a malformed record."""


def _err(path: str | os.PathLike, row: Optional[int], field: Optional[str], problem: str) -> DataFormatError:
    where = str(path)
    if row is not None:
        where += f", row {row}"
    if field is not None:
        where += f", field '{field}'"
    return DataFormatError(f"{where}: {problem}")


def format_passage(title: str, text: str) -> str:
    """wiki-18 passage contents: the quoted title on the first line, then the text."""
    return f'"{title}"\n{text}'


def template_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": make_prompt(question)}]


def _as_list(value: Any) -> Optional[list]:
    """Lists arrive as list, tuple or numpy array (pandas, HF datasets); None when not a list."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _answers(value: Any, path: str | os.PathLike, row: int, field: str) -> list[str]:
    """Gold answers from a list or a string; strings may hold aliases joined by ANSWER_SPLIT."""
    if isinstance(value, str):
        items: list = [value]
    else:
        items = _as_list(value)  # type: ignore[assignment]
        if items is None:
            raise _err(path, row, field, f"expected a list of strings or a string, got {type(value).__name__}")
    out: list[str] = []
    for a in items:
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            a = str(a)  # numeric answers (years) are sometimes stored as numbers
        if not isinstance(a, str):
            raise _err(path, row, field, f"answer {a!r} is not a string")
        out.extend(p.strip() for p in a.split(ANSWER_SPLIT) if p.strip())
    if not out:
        raise _err(path, row, field, "no gold answer")
    return out


def _question(value: Any, path: str | os.PathLike, row: int, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _err(path, row, field, f"expected a non-empty string, got {value!r}")
    return value.strip()


def _id(value: Any, path: str | os.PathLike, row: int, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, np.integer)):
        raise _err(path, row, field, f"expected a string or integer id, got {value!r}")
    return str(value)


# ----------------------------------------------------------------------------- Search-R1 parquet


def question_from_prompt(content: str) -> str:
    """The question inside a Search-R1 prompt: the text after the last 'Question:'."""
    _, sep, tail = content.rpartition("Question:")
    return (tail if sep else content).strip()


def _messages(value: Any, path: str | os.PathLike, row: int, field: str) -> list[dict]:
    items = _as_list(value)
    if not items:
        raise _err(path, row, field, "expected a non-empty list of {role, content} messages")
    out = []
    for j, m in enumerate(items):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _err(path, row, f"{field}[{j}]", f"expected {{role: str, content: str}}, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def searchr1_record_to_example(
    rec: Mapping[str, Any], path: str | os.PathLike, row: int, data_source: Optional[str] = None
) -> QAExample:
    """One Search-R1 row (as a dict, from pyarrow, pandas or HF datasets) -> QAExample."""
    rm = rec.get("reward_model")
    if not isinstance(rm, Mapping):
        raise _err(path, row, "reward_model", f"expected a struct with ground_truth, got {rm!r}")
    if "ground_truth" not in rm or rm["ground_truth"] is None:
        raise _err(path, row, "reward_model.ground_truth", "missing")
    gt = rm["ground_truth"]
    if isinstance(gt, Mapping):
        if gt.get("target") is None:
            raise _err(path, row, "reward_model.ground_truth.target", "missing")
        answers = _answers(gt["target"], path, row, "reward_model.ground_truth.target")
    else:
        answers = _answers(gt, path, row, "reward_model.ground_truth")

    file_messages = None
    if rec.get("prompt") is not None:
        file_messages = _messages(rec["prompt"], path, row, "prompt")
    if rec.get("question") is not None:
        question = _question(rec["question"], path, row, "question")
    elif file_messages is not None:
        user = [m["content"] for m in file_messages if m["role"] == "user"] or [file_messages[-1]["content"]]
        question = _question(question_from_prompt(user[-1]), path, row, "prompt")
    else:
        raise _err(path, row, "prompt", "missing (and no 'question' column either)")

    extra = rec.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise _err(path, row, "extra_info", f"expected a struct {{split, index}}, got {extra!r}")
    extra = dict(extra or {})
    source = data_source or rec.get("data_source") or Path(path).stem
    if not isinstance(source, str):
        raise _err(path, row, "data_source", f"expected a string, got {source!r}")
    split = extra.get("split") or ""
    if rec.get("id") is not None:
        ex_id = _id(rec["id"], path, row, "id")
    elif extra.get("index") is not None:
        ex_id = f"{source}_{split}_{extra['index']}" if split else f"{source}_{extra['index']}"
    else:
        ex_id = f"{Path(path).stem}_{row}"
    meta: dict[str, Any] = {"source_file": str(path), "row": row, "extra_info": extra}
    if file_messages is not None:
        meta["file_messages"] = file_messages
    if rec.get("ability") is not None:
        meta["ability"] = rec["ability"]
    if rm.get("style") is not None:
        meta["reward_style"] = rm["style"]
    return QAExample(
        id=ex_id,
        question=question,
        golden_answers=answers,
        data_source=source,
        messages=template_messages(question),
        split=str(split),
        meta=meta,
    )


def read_searchr1_parquet(path: str | os.PathLike, data_source: Optional[str] = None) -> list[QAExample]:
    """A Search-R1 parquet (verl RL dataset) -> QAExamples. ``data_source`` overrides the column."""
    _require_file(path)
    try:
        rows = pq.read_table(path).to_pylist()  # python lists/dicts, not numpy arrays
    except (pa.ArrowInvalid, OSError) as e:
        raise _err(path, None, None, f"not a readable parquet file ({e})") from e
    return [searchr1_record_to_example(r, path, i, data_source) for i, r in enumerate(rows)]


def write_searchr1_parquet(examples: Iterable[QAExample], path: str | os.PathLike) -> Path:
    """Write the exact Search-R1 schema (ground_truth {target: [...]}, extra_info {index, split})."""
    rows = []
    for i, ex in enumerate(examples):
        extra = ex.meta.get("extra_info") or {}
        index = extra.get("index", i)
        rows.append(
            {
                "id": ex.id,
                "question": ex.question,
                "golden_answers": list(ex.golden_answers),
                "data_source": ex.data_source,
                "prompt": [{"content": m["content"], "role": m["role"]} for m in ex.messages],
                "ability": ex.meta.get("ability", "fact-reasoning"),
                "reward_model": {"ground_truth": {"target": list(ex.golden_answers)}, "style": "rule"},
                "extra_info": {"index": int(index), "split": ex.split or str(extra.get("split", ""))},
            }
        )
    table = pa.Table.from_pylist(rows, schema=SEARCHR1_SCHEMA)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out


# ----------------------------------------------------------------------------- JSON records


def _read_json_records(path: str | os.PathLike) -> list[dict]:
    """Records of a .jsonl (one object per line) or a .json (an array of objects) file."""
    _require_file(path)
    p = Path(path)
    records: list[dict] = []
    with open(p, encoding="utf-8") as f:
        if p.suffix == ".jsonl":
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _err(p, len(records), None, f"line {i + 1} is not valid JSON ({e.msg})") from e
                if not isinstance(rec, dict):
                    raise _err(p, len(records), None, f"line {i + 1} is not a JSON object")
                records.append(rec)
        else:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise _err(p, None, None, f"not valid JSON ({e.msg} at line {e.lineno})") from e
            if isinstance(data, dict) and isinstance(data.get("data"), list):
                data = data["data"]  # some dumps wrap the array
            if not isinstance(data, list):
                raise _err(p, None, None, "expected a JSON array of objects")
            for i, rec in enumerate(data):
                if not isinstance(rec, dict):
                    raise _err(p, i, None, "not a JSON object")
            records = data
    return records


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _write_jsonl(records: Iterable[Mapping], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(_jsonable(rec), ensure_ascii=False) + "\n")
    return out


# ----------------------------------------------------------------------------- FlashRAG jsonl


def flashrag_record_to_example(
    rec: Mapping[str, Any], path: str | os.PathLike, row: int, data_source: Optional[str] = None
) -> QAExample:
    """{id, question, golden_answers[]} or {idx, question, answer} (R1-Searcher) -> QAExample."""
    question = _question(rec.get("question"), path, row, "question")
    if rec.get("golden_answers") is not None:
        answers = _answers(rec["golden_answers"], path, row, "golden_answers")
    elif rec.get("answer") is not None:
        answers = _answers(rec["answer"], path, row, "answer")
    else:
        raise _err(path, row, "golden_answers", "missing (and no 'answer' field either)")
    if rec.get("id") is not None:
        ex_id = _id(rec["id"], path, row, "id")
    elif rec.get("idx") is not None:
        ex_id = _id(rec["idx"], path, row, "idx")
    else:
        ex_id = f"{Path(path).stem}_{row}"
    meta_in = rec.get("metadata") if isinstance(rec.get("metadata"), Mapping) else {}
    source = data_source or rec.get("data_source") or meta_in.get("data_source") or Path(path).stem
    meta = {"source_file": str(path), "row": row, **{k: v for k, v in meta_in.items() if k not in ("data_source", "split")}}
    return QAExample(
        id=ex_id,
        question=question,
        golden_answers=answers,
        data_source=str(source),
        messages=template_messages(question),
        split=str(meta_in.get("split", "")),
        meta=meta,
    )


def read_flashrag_jsonl(path: str | os.PathLike, data_source: Optional[str] = None) -> list[QAExample]:
    """FlashRAG QA jsonl -> QAExamples; data_source defaults to the record's, else the file stem."""
    return [flashrag_record_to_example(r, path, i, data_source) for i, r in enumerate(_read_json_records(path))]


_FILE_META = {"source_file", "row", "file_messages", "extra_info"}


def write_flashrag_jsonl(examples: Iterable[QAExample], path: str | os.PathLike) -> Path:
    """{id, question, golden_answers, metadata}; data_source and split ride in FlashRAG's metadata."""
    def rec(ex: QAExample) -> dict:
        meta = {k: v for k, v in ex.meta.items() if k not in _FILE_META}
        return {
            "id": ex.id,
            "question": ex.question,
            "golden_answers": list(ex.golden_answers),
            "metadata": {"data_source": ex.data_source, "split": ex.split, **meta},
        }

    return _write_jsonl((rec(ex) for ex in examples), path)


# ----------------------------------------------------------------------------- corpus


class CorpusRecordError(ValueError):
    """One corpus record is malformed; ``field`` names the offending field (None: the record)."""

    def __init__(self, field: Optional[str], problem: str):
        super().__init__(problem)
        self.field = field


def corpus_record(rec: Any, id_required: bool = True, np_ints: tuple = ()) -> tuple[Optional[str], str]:
    """(id, contents) of one corpus record: {id, contents} (wiki-18) or {id, title, text} (DPR,
    HippoRAG). The one validator behind every corpus reader: ``iter_corpus`` here and the index
    builder's byte-span reader (lldslight.retrieval.index), which wrap its error in their own type.
    The id may be absent when not ``id_required`` (then None: the caller numbers rows)."""
    if not isinstance(rec, Mapping):
        raise CorpusRecordError(None, f"expected a JSON object, got {type(rec).__name__}")
    pid = rec.get("id")
    if pid is None:
        if id_required:
            raise CorpusRecordError("id", "missing field 'id'")
    elif isinstance(pid, bool) or not isinstance(pid, (str, int, *np_ints)):
        raise CorpusRecordError("id", f"field 'id' must be a string or an integer, got {type(pid).__name__}")
    contents = rec.get("contents")
    if contents is None:
        if not (isinstance(rec.get("title"), str) and isinstance(rec.get("text"), str)):
            raise CorpusRecordError("contents", "missing field 'contents' (or 'title' and 'text')")
        contents = format_passage(rec["title"], rec["text"])
    if not isinstance(contents, str):
        raise CorpusRecordError("contents", f"field 'contents' must be a string, got {type(contents).__name__}")
    if not contents.strip():
        raise CorpusRecordError("contents", "field 'contents' is empty")
    return (None if pid is None else str(pid)), contents


def _corpus_row(rec: Any, path: str | os.PathLike, row: int) -> dict:
    try:
        pid, contents = corpus_record(rec, id_required=False, np_ints=(np.integer,))
    except CorpusRecordError as e:
        raise _err(path, row, e.field, str(e)) from None
    return {"id": str(row) if pid is None else pid, "contents": contents}


def iter_corpus(path: str | os.PathLike) -> Iterator[dict]:
    """Yield {"id", "contents"} per passage of a corpus.

    .jsonl: {id, contents} per line (wiki-18), or {id, title, text}. .json: an array of {title, text}
    (HippoRAG dumps; ids are the array positions) or of {id, contents}. Streams .jsonl line by line
    because wiki-18 is 21M passages.
    """
    _require_file(path)
    p = Path(path)
    if p.suffix == ".jsonl":
        with open(p, encoding="utf-8") as f:
            row = 0
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _err(p, row, None, f"line {i + 1} is not valid JSON ({e.msg})") from e
                yield _corpus_row(rec, p, row)
                row += 1
    else:
        for i, rec in enumerate(_read_json_records(p)):
            yield _corpus_row(rec, p, i)


def write_corpus_jsonl(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write {id, contents} lines, validating each row the way iter_corpus reads it."""
    return _write_jsonl((_corpus_row(r, path, i) for i, r in enumerate(rows)), path)


def read_title_text_corpus(path: str | os.PathLike, id_prefix: str = "") -> list[dict]:
    """A [{title, text}] JSON array (2Wiki, MuSiQue dumps) -> corpus rows with positional ids."""
    recs = _read_json_records(path)
    out = []
    for i, r in enumerate(recs):
        for f in ("title", "text"):
            if not isinstance(r.get(f), str):
                raise _err(path, i, f, f"expected a string, got {r.get(f)!r}")
        out.append({"id": f"{id_prefix}{i}", "contents": format_passage(r["title"], r["text"])})
    return out


# ----------------------------------------------------------------------------- multi-hop sets


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def hotpotqa_record_to_example(
    rec: Mapping[str, Any], path: str | os.PathLike, row: int, data_source: Optional[str] = None
) -> QAExample:
    """{question_id, question_text, answers_objects[{spans}], contexts[...]} -> QAExample.

    meta["contexts"] keeps (passage id, title, is_supporting) of the question's paragraphs and
    meta["supporting_ids"] the corpus ids of the supporting ones, as load_hotpotqa_with_contexts
    numbers them ("{question_id}-{context id}", since context ids restart at 0 per question;
    load_hotpotqa_with_contexts then points shared paragraphs at their one stored copy).
    """
    qid = _id(rec.get("question_id"), path, row, "question_id")
    question = _question(rec.get("question_text"), path, row, "question_text")
    objs = _as_list(rec.get("answers_objects"))
    if not objs:
        raise _err(path, row, "answers_objects", "missing or empty")
    spans: list[str] = []
    for j, o in enumerate(objs):
        if not isinstance(o, Mapping) or _as_list(o.get("spans")) is None:
            raise _err(path, row, f"answers_objects[{j}].spans", "missing")
        spans.extend(_as_list(o["spans"]))  # type: ignore[arg-type]
    answers = _answers(spans, path, row, "answers_objects.spans")
    contexts = _as_list(rec.get("contexts"))
    if contexts is None:
        raise _err(path, row, "contexts", "missing")
    ctx_meta = []
    for j, c in enumerate(contexts):
        for f in ("id", "title", "paragraph_text"):
            if not isinstance(c, Mapping) or c.get(f) is None:
                raise _err(path, row, f"contexts[{j}].{f}", "missing")
        ctx_meta.append(
            {"id": f"{qid}-{c['id']}", "title": c["title"], "is_supporting": _truthy(c.get("is_supporting"))}
        )
    return QAExample(
        id=qid,
        question=question,
        golden_answers=answers,
        data_source=data_source or "hotpotqa",
        messages=template_messages(question),
        meta={
            "source_file": str(path),
            "row": row,
            "contexts": ctx_meta,
            "supporting_ids": [c["id"] for c in ctx_meta if c["is_supporting"]],
            "supporting_titles": [c["title"] for c in ctx_meta if c["is_supporting"]],
        },
    )


def load_hotpotqa_with_contexts(
    path: str | os.PathLike, data_source: str = "hotpotqa"
) -> tuple[list[QAExample], list[dict]]:
    """HotpotQA questions and the corpus made of their paragraphs (every answer is findable).

    Passage ids are "{question_id}-{context id}" (context ids restart at 0 per question). A
    paragraph shared by several questions is stored once, under its first id, and every question's
    meta["contexts"] / meta["supporting_ids"] point at that stored id, so recall@k counts it once.
    """
    records = _read_json_records(path)
    examples = [hotpotqa_record_to_example(r, path, i, data_source) for i, r in enumerate(records)]
    corpus: list[dict] = []
    id_of: dict[str, str] = {}
    for ex, rec in zip(examples, records):
        for ctx, c in zip(ex.meta["contexts"], rec["contexts"]):
            contents = format_passage(c["title"], c["paragraph_text"])
            if contents not in id_of:
                id_of[contents] = ctx["id"]
                corpus.append({"id": ctx["id"], "contents": contents})
            ctx["id"] = id_of[contents]
        ex.meta["supporting_ids"] = [c["id"] for c in ex.meta["contexts"] if c["is_supporting"]]
    return examples, corpus


def twowiki_record_to_example(
    rec: Mapping[str, Any], path: str | os.PathLike, row: int, data_source: Optional[str] = None
) -> QAExample:
    """2WikiMultihopQA {id, question_type, question, answer, evidence[[s, r, o]]} -> QAExample."""
    question = _question(rec.get("question"), path, row, "question")
    answers = _answers(rec.get("answer"), path, row, "answer")
    evidence = [list(t) for t in (_as_list(rec.get("evidence")) or [])]
    titles: list[str] = []
    for t in evidence:
        if t and isinstance(t[0], str) and t[0] not in titles:
            titles.append(t[0])  # the subject of each evidence triple names its supporting page
    return QAExample(
        id=_id(rec.get("id", f"{Path(path).stem}_{row}"), path, row, "id"),
        question=question,
        golden_answers=answers,
        data_source=data_source or "2wikimultihopqa",
        messages=template_messages(question),
        meta={
            "source_file": str(path),
            "row": row,
            "question_type": rec.get("question_type", ""),
            "evidence": evidence,
            "supporting_titles": titles,
        },
    )


def _title_index(corpus: list[dict]) -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for r in corpus:
        index.setdefault(r["contents"].split("\n", 1)[0].strip('"'), []).append(r["id"])
    return index


def load_2wiki(
    questions_path: str | os.PathLike,
    corpus_path: Optional[str | os.PathLike] = None,
    data_source: str = "2wikimultihopqa",
) -> tuple[list[QAExample], list[dict]]:
    """2Wiki questions (+ the [{title, text}] corpus; meta["supporting_ids"] maps evidence titles)."""
    examples = [
        twowiki_record_to_example(r, questions_path, i, data_source)
        for i, r in enumerate(_read_json_records(questions_path))
    ]
    corpus = read_title_text_corpus(corpus_path) if corpus_path is not None else []
    if corpus:
        by_title = _title_index(corpus)
        for ex in examples:
            ex.meta["supporting_ids"] = [i for t in ex.meta["supporting_titles"] for i in by_title.get(t, [])]
    return examples, corpus


def musique_record_to_example(
    rec: Mapping[str, Any], path: str | os.PathLike, row: int, data_source: Optional[str] = None
) -> QAExample:
    """Native MuSiQue {id, paragraphs, question, question_decomposition, answer, answer_aliases}."""
    question = _question(rec.get("question"), path, row, "question")
    answers = _answers(rec.get("answer"), path, row, "answer")
    for a in _as_list(rec.get("answer_aliases")) or []:
        if isinstance(a, str) and a.strip() and a.strip() not in answers:
            answers.append(a.strip())
    paragraphs = _as_list(rec.get("paragraphs")) or []
    supporting = []
    for j, p in enumerate(paragraphs):
        if not isinstance(p, Mapping) or not isinstance(p.get("title"), str) or not isinstance(p.get("paragraph_text"), str):
            raise _err(path, row, f"paragraphs[{j}]", "expected {title, paragraph_text, is_supporting}")
        if _truthy(p.get("is_supporting")):
            supporting.append(format_passage(p["title"], p["paragraph_text"]))
    return QAExample(
        id=_id(rec.get("id", f"{Path(path).stem}_{row}"), path, row, "id"),
        question=question,
        golden_answers=answers,
        data_source=data_source or "musique",
        messages=template_messages(question),
        meta={
            "source_file": str(path),
            "row": row,
            "answerable": bool(rec.get("answerable", True)),
            "question_decomposition": _jsonable(rec.get("question_decomposition") or []),
            "supporting_titles": [c.split("\n", 1)[0].strip('"') for c in supporting],
            "supporting_contents": supporting,
        },
    )


def load_musique(
    questions_path: str | os.PathLike,
    corpus_path: Optional[str | os.PathLike] = None,
    data_source: str = "musique",
) -> tuple[list[QAExample], list[dict]]:
    """MuSiQue questions (+ [{title, text}] corpus; supporting paragraphs matched by contents)."""
    examples = [
        musique_record_to_example(r, questions_path, i, data_source)
        for i, r in enumerate(_read_json_records(questions_path))
    ]
    corpus = read_title_text_corpus(corpus_path) if corpus_path is not None else []
    if corpus:
        by_contents: dict[str, list[str]] = {}
        for r in corpus:
            by_contents.setdefault(r["contents"], []).append(r["id"])
        for ex in examples:
            ex.meta["supporting_ids"] = [i for c in ex.meta["supporting_contents"] for i in by_contents.get(c, [])]
    return examples, corpus


# ----------------------------------------------------------------------------- HF datasets


def load_hf_dataset(
    path_or_name: str | os.PathLike,
    split: Optional[str] = "train",
    question_field: str = "question",
    answers_field: str = "golden_answers",
    data_source: Optional[str] = None,
    id_field: str = "id",
) -> list[QAExample]:
    """A Hugging Face dataset -> QAExamples.

    A local directory written by ``save_to_disk`` is read with ``load_from_disk``; anything else
    goes to ``datasets.load_dataset`` (a hub id, or a local script/data dir). ``split`` picks one
    split of a DatasetDict (None allowed when it has exactly one). Records that look like Search-R1
    rows (a reward_model column) are read as such.
    """
    import datasets  # deferred: importing datasets costs ~1 s and most callers never need it

    p = Path(path_or_name)
    is_saved = p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists())
    try:
        ds = datasets.load_from_disk(str(p)) if is_saved else datasets.load_dataset(str(path_or_name), split=split)
    except FileNotFoundError as e:
        raise _err(path_or_name, None, None, f"no such dataset ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            raise _err(path_or_name, None, None, f"split {split!r} not found; available: {sorted(ds)}")
        ds = ds[split]
    source = data_source or (p.name if p.exists() else str(path_or_name).replace("/", "_"))
    out = []
    for i, rec in enumerate(ds):
        if "reward_model" in rec:
            ex = searchr1_record_to_example(rec, path_or_name, i, data_source)
        else:
            if rec.get(answers_field) is None:
                raise _err(path_or_name, i, answers_field, "missing")
            question = _question(rec.get(question_field), path_or_name, i, question_field)
            ex = QAExample(
                id=_id(rec[id_field], path_or_name, i, id_field) if rec.get(id_field) is not None else f"{source}_{i}",
                question=question,
                golden_answers=_answers(rec[answers_field], path_or_name, i, answers_field),
                data_source=str(data_source or rec.get("data_source") or source),
                messages=template_messages(question),
                meta={"source_file": str(path_or_name), "row": i},
            )
        ex.split = ex.split or (split or "")
        out.append(ex)
    return out


# ----------------------------------------------------------------------------- dispatch


def _require_file(path: str | os.PathLike) -> None:
    if not Path(path).is_file():
        raise DataFormatError(f"{path}: no such file")


def _records_to_examples(records: Sequence[Mapping], path: Path, data_source: Optional[str]) -> list[QAExample]:
    if not records:
        return []
    keys = set(records[0])
    if "reward_model" in keys:
        convert = searchr1_record_to_example
    elif {"question_text", "contexts"} <= keys:
        convert = hotpotqa_record_to_example
    elif {"paragraphs", "question_decomposition"} & keys:
        convert = musique_record_to_example
    elif "evidence" in keys or "question_type" in keys:
        convert = twowiki_record_to_example
    elif "question" in keys:
        convert = flashrag_record_to_example
    elif "contents" in keys or {"title", "text"} <= keys:
        raise DataFormatError(f"{path}: this is a corpus (passages), not questions; read it with iter_corpus")
    else:
        raise DataFormatError(f"{path}, row 0: unknown record format with fields {sorted(keys)}")
    return [convert(r, path, i, data_source) for i, r in enumerate(records)]


def load_examples(
    path: str | os.PathLike, data_source: Optional[str] = None, split: Optional[str] = None
) -> list[QAExample]:
    """Read questions from any supported file, picking the reader by extension and record fields.

    .parquet: Search-R1. .jsonl / .json: FlashRAG, R1-Searcher {idx, question, answer}, Search-R1
    rows, HotpotQA-with-contexts, 2Wiki, native MuSiQue. A directory: a HF dataset saved with
    ``save_to_disk`` (``split`` picks one split of a DatasetDict).
    """
    p = Path(path)
    if p.is_dir():
        return load_hf_dataset(p, split=split, data_source=data_source)
    _require_file(p)
    if p.suffix == ".parquet":
        return read_searchr1_parquet(p, data_source)
    if p.suffix in (".jsonl", ".json"):
        return _records_to_examples(_read_json_records(p), p, data_source)
    raise DataFormatError(f"{p}: unsupported extension {p.suffix!r} (expected .parquet, .jsonl, .json or a directory)")
