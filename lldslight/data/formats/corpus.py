"""Passage corpora: wiki-18 {id, contents} jsonl, {id, title, text}, and [{title, text}] JSON arrays."""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lldslight.data.formats.common import (
    field_error,
    format_passage,
    iter_jsonl,
    read_json_records,
    require_file,
    write_jsonl,
)


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
        raise field_error(path, row, e.field, str(e)) from None
    return {"id": str(row) if pid is None else pid, "contents": contents}


def iter_corpus(path: str | os.PathLike) -> Iterator[dict]:
    """Yield {"id", "contents"} per passage of a corpus.

    .jsonl: {id, contents} per line (wiki-18), or {id, title, text}. .json: an array of {title, text}
    (HippoRAG dumps; ids are the array positions) or of {id, contents}. Streams .jsonl line by line
    because wiki-18 is 21M passages.
    """
    require_file(path)
    p = Path(path)
    if p.suffix == ".jsonl":
        for row, _, rec in iter_jsonl(p):
            yield _corpus_row(rec, p, row)
    else:
        for i, rec in enumerate(read_json_records(p)):
            yield _corpus_row(rec, p, i)


def write_corpus_jsonl(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write {id, contents} lines, validating each row the way iter_corpus reads it."""
    return write_jsonl((_corpus_row(r, path, i) for i, r in enumerate(rows)), path)


def read_title_text_corpus(path: str | os.PathLike, id_prefix: str = "") -> list[dict]:
    """A [{title, text}] JSON array (2Wiki, MuSiQue dumps) -> corpus rows with positional ids."""
    recs = read_json_records(path)
    out = []
    for i, r in enumerate(recs):
        for f in ("title", "text"):
            if not isinstance(r.get(f), str):
                raise field_error(path, i, f, f"expected a string, got {r.get(f)!r}")
        out.append({"id": f"{id_prefix}{i}", "contents": format_passage(r["title"], r["text"])})
    return out
