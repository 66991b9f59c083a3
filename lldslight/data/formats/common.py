"""What every format reader shares: the error type, field validators, JSON record files.

Every malformed record raises :class:`DataFormatError` naming the file, the row and the field,
because a bad row in a 5000-row parquet is otherwise a needle in a haystack. Rows count from 1, as
an editor, a spreadsheet or ``sed -n 4p`` counts them: in a .jsonl without blank lines, row N is
line N; callers pass 0-based indices and ``field_error`` says them 1-based.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lldslight.data.example import make_prompt
from lldslight.errors import UserError

ANSWER_SPLIT = "<|answer_split|>"


class DataFormatError(UserError, ValueError):
    """A data file is missing, unreadable or has a malformed record."""


def field_error(path: str | os.PathLike, row: Optional[int], field: Optional[str], problem: str) -> DataFormatError:
    """'{path}, row {row + 1}, field '{field}': {problem}' (row, 0-based here, and field when known)."""
    where = str(path)
    if row is not None:
        where += f", row {row + 1}"
    if field is not None:
        where += f", field '{field}'"
    return DataFormatError(f"{where}: {problem}")


def require_file(path: str | os.PathLike) -> None:
    if not Path(path).is_file():
        raise DataFormatError(f"{path}: no such file")


def format_passage(title: str, text: str) -> str:
    """wiki-18 passage contents: the quoted title on the first line, then the text."""
    return f'"{title}"\n{text}'


def passage_title(contents: str) -> str:
    """The title of wiki-18 contents (first line, quotes stripped)."""
    return contents.split("\n", 1)[0].strip('"')


def template_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": make_prompt(question)}]


def as_list(value: Any) -> Optional[list]:
    """Lists arrive as list, tuple or numpy array (pandas, HF datasets); None when not a list."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def read_answers(value: Any, path: str | os.PathLike, row: int, field: str) -> list[str]:
    """Gold answers from a list, a string or a bare number (a year stored as 1961); strings may hold
    aliases joined by ANSWER_SPLIT."""
    if isinstance(value, str) or (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))):
        items: list = [value]
    else:
        items = as_list(value)  # type: ignore[assignment]
        if items is None:
            raise field_error(path, row, field, f"expected a list of strings or a string, got {type(value).__name__}")
    out: list[str] = []
    for a in items:
        if isinstance(a, (int, float, np.integer, np.floating)) and not isinstance(a, (bool, np.bool_)):
            # Numeric answers (years) are sometimes stored as numbers, and a column holding one
            # float makes them all floats: 1961.0 is the year "1961", which the model writes.
            a = str(int(a)) if float(a).is_integer() else str(a)
        if not isinstance(a, str):
            raise field_error(path, row, field, f"answer {a!r} is not a string")
        out.extend(p.strip() for p in a.split(ANSWER_SPLIT) if p.strip())
    if not out:
        raise field_error(path, row, field, "no gold answer")
    return out


def read_question(value: Any, path: str | os.PathLike, row: int, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise field_error(path, row, field, f"expected a non-empty string, got {value!r}")
    return value.strip()


def read_id(value: Any, path: str | os.PathLike, row: int, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, np.integer)):
        raise field_error(path, row, field, f"expected a string or integer id, got {value!r}")
    return str(value)


def truthy(value: Any) -> bool:
    """True or "True"/"true" (HotpotQA stores booleans as strings)."""
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def not_utf8(path: str | os.PathLike, data: bytes, err: UnicodeDecodeError, line: Optional[int] = None) -> DataFormatError:
    """A file that is not UTF-8 text, named with the bad byte's line and column (a bare
    UnicodeDecodeError named no file). ``data``: the whole file, or line ``line`` of it."""
    if line is None:
        line = data.count(b"\n", 0, err.start) + 1
    column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return DataFormatError(f"{path}, line {line}: not UTF-8 text (byte {data[err.start:err.start + 1]!r} at column "
                           f"{column}); data files are read as UTF-8")


def iter_jsonl(path: Path) -> Iterator[tuple[int, int, Any]]:
    """(row, line number, value) per non-blank line of a .jsonl file, streamed (wiki-18 has 21M)."""
    with open(path, "rb") as f:  # bytes, decoded line by line: a bad byte is named with its line
        row = 0
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise not_utf8(path, raw, e, line=i + 1) from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise field_error(path, row, None, f"line {i + 1} is not valid JSON ({e.msg})") from e
            yield row, i + 1, value
            row += 1


def read_json_records(path: str | os.PathLike) -> list[dict]:
    """Records of a .jsonl (one object per line) or a .json (an array of objects) file."""
    require_file(path)
    p = Path(path)
    if p.suffix == ".jsonl":
        records: list[dict] = []
        for row, line_no, rec in iter_jsonl(p):
            if not isinstance(rec, dict):
                raise field_error(p, row, None, f"line {line_no} is not a JSON object")
            records.append(rec)
        return records
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(p, raw, e) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise field_error(p, None, None, f"not valid JSON ({e.msg} at line {e.lineno})") from e
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]  # some dumps wrap the array
    if not isinstance(data, list):
        raise field_error(p, None, None, "expected a JSON array of objects")
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise field_error(p, i, None, "not a JSON object")
    return data


def jsonable(value: Any) -> Any:
    """numpy arrays and scalars (pandas, HF datasets) as plain JSON values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_jsonl(records: Iterable[Mapping], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(jsonable(rec), ensure_ascii=False) + "\n")
    return out
