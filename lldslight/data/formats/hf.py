"""Hugging Face datasets: a ``save_to_disk`` directory or anything ``datasets.load_dataset`` reads."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lldslight.data.example import QAExample
from lldslight.data.formats.common import field_error, read_answers, read_id, read_question, template_messages
from lldslight.data.formats.searchr1 import searchr1_record_to_example


def is_saved_dataset(path: str | os.PathLike) -> bool:
    """``path`` is a directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    p = Path(path)
    return p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file())


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
    is_saved = is_saved_dataset(p)
    try:
        ds = datasets.load_from_disk(str(p)) if is_saved else datasets.load_dataset(str(path_or_name), split=split)
    except FileNotFoundError as e:
        raise field_error(path_or_name, None, None, f"no such dataset ({e})") from e
    except Exception as e:  # datasets' many error types, with many lines; a local directory is the user's input
        if not p.is_dir():
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise field_error(path_or_name, None, None, "a directory, but neither a dataset saved with save_to_disk (no "
                          "dataset_info.json or dataset_dict.json) nor data files datasets.load_dataset reads "
                          f"({type(e).__name__}: {first}); give a .parquet, .jsonl or .json file") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            raise field_error(path_or_name, None, None, f"split {split!r} not found; available: {sorted(ds)}")
        ds = ds[split]
    source = data_source or (p.name if p.exists() else str(path_or_name).replace("/", "_"))
    out = []
    for i, rec in enumerate(ds):
        if "reward_model" in rec:
            ex = searchr1_record_to_example(rec, path_or_name, i, data_source)
        else:
            if rec.get(answers_field) is None:
                raise field_error(path_or_name, i, answers_field, "missing")
            question = read_question(rec.get(question_field), path_or_name, i, question_field)
            ex = QAExample(
                id=read_id(rec[id_field], path_or_name, i, id_field) if rec.get(id_field) is not None else f"{source}_{i}",
                question=question,
                golden_answers=read_answers(rec[answers_field], path_or_name, i, answers_field),
                data_source=str(data_source or rec.get("data_source") or source),
                messages=template_messages(question),
                meta={"source_file": str(path_or_name), "row": i},
            )
        ex.split = ex.split or (split or "")
        out.append(ex)
    return out
