"""Search-R1 parquet (verl RL dataset): data_source, prompt, ability, reward_model, extra_info."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from lldslight.data.example import QAExample
from lldslight.data.formats.common import (
    as_list,
    field_error,
    read_answers,
    read_id,
    read_question,
    require_file,
    template_messages,
)

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


def question_from_prompt(content: str) -> str:
    """The question inside a Search-R1 prompt: the text after the last 'Question:'."""
    _, sep, tail = content.rpartition("Question:")
    return (tail if sep else content).strip()


def _messages(value: Any, path: str | os.PathLike, row: int, field: str) -> list[dict]:
    items = as_list(value)
    if not items:
        raise field_error(path, row, field, "expected a non-empty list of {role, content} messages")
    out = []
    for j, m in enumerate(items):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise field_error(path, row, f"{field}[{j}]", f"expected {{role: str, content: str}}, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def searchr1_record_to_example(
    rec: Mapping[str, Any], path: str | os.PathLike, row: int, data_source: Optional[str] = None
) -> QAExample:
    """One Search-R1 row (as a dict, from pyarrow, pandas or HF datasets) -> QAExample.

    ``messages`` is built from the Search-R1 template; the file's own prompt is kept in
    ``meta["file_messages"]`` so the DataModule can choose.
    """
    rm = rec.get("reward_model")
    if not isinstance(rm, Mapping):
        raise field_error(path, row, "reward_model", f"expected a struct with ground_truth, got {rm!r}")
    if "ground_truth" not in rm or rm["ground_truth"] is None:
        raise field_error(path, row, "reward_model.ground_truth", "missing")
    gt = rm["ground_truth"]
    if isinstance(gt, Mapping):
        if gt.get("target") is None:
            raise field_error(path, row, "reward_model.ground_truth.target", "missing")
        answers = read_answers(gt["target"], path, row, "reward_model.ground_truth.target")
    else:
        answers = read_answers(gt, path, row, "reward_model.ground_truth")

    file_messages = None
    if rec.get("prompt") is not None:
        file_messages = _messages(rec["prompt"], path, row, "prompt")
    if rec.get("question") is not None:
        question = read_question(rec["question"], path, row, "question")
    elif file_messages is not None:
        user = [m["content"] for m in file_messages if m["role"] == "user"] or [file_messages[-1]["content"]]
        question = read_question(question_from_prompt(user[-1]), path, row, "prompt")
    else:
        raise field_error(path, row, "prompt", "missing (and no 'question' column either)")

    extra = rec.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise field_error(path, row, "extra_info", f"expected a struct {{split, index}}, got {extra!r}")
    extra = dict(extra or {})
    source = data_source or rec.get("data_source") or Path(path).stem
    if not isinstance(source, str):
        raise field_error(path, row, "data_source", f"expected a string, got {source!r}")
    split = extra.get("split") or ""
    if rec.get("id") is not None:
        ex_id = read_id(rec["id"], path, row, "id")
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
    require_file(path)
    try:
        rows = pq.read_table(path).to_pylist()  # python lists/dicts, not numpy arrays
    except (pa.ArrowInvalid, OSError) as e:
        raise field_error(path, None, None, f"not a readable parquet file ({e})") from e
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
