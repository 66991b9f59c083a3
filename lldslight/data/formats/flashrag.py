"""FlashRAG QA jsonl {id, question, golden_answers[]}, and R1-Searcher's {idx, question, answer}."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

from lldslight.data.example import QAExample
from lldslight.data.formats.common import (
    field_error,
    read_answers,
    read_id,
    read_json_records,
    read_question,
    template_messages,
    write_jsonl,
)

# Where a QAExample came from: not written back (the written file is the new source).
_FILE_META = {"source_file", "row", "file_messages", "extra_info"}


def flashrag_record_to_example(
    rec: Mapping[str, Any], path: str | os.PathLike, row: int, data_source: Optional[str] = None
) -> QAExample:
    """{id, question, golden_answers[]} or {idx, question, answer} (R1-Searcher) -> QAExample."""
    question = read_question(rec.get("question"), path, row, "question")
    if rec.get("golden_answers") is not None:
        answers = read_answers(rec["golden_answers"], path, row, "golden_answers")
    elif rec.get("answer") is not None:
        answers = read_answers(rec["answer"], path, row, "answer")
    else:
        raise field_error(path, row, "golden_answers", "missing (and no 'answer' field either)")
    if rec.get("id") is not None:
        ex_id = read_id(rec["id"], path, row, "id")
    elif rec.get("idx") is not None:
        ex_id = read_id(rec["idx"], path, row, "idx")
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
    return [flashrag_record_to_example(r, path, i, data_source) for i, r in enumerate(read_json_records(path))]


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

    return write_jsonl((rec(ex) for ex in examples), path)
