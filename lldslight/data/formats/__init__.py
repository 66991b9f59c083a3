"""Readers and writers for every question and corpus format lldslight accepts (docs/data_and_retrieval.md, Formats).

One module per format: searchr1 (parquet), flashrag (jsonl), corpus (passages), multihop
(HotpotQA, 2Wiki, MuSiQue), hf (Hugging Face datasets); common holds the error type and field
validators they share. ``load_examples`` picks the reader from the extension and record fields.

Every question reader returns :class:`QAExample` with ``messages`` built from the Search-R1 template;
a file's own prompt, when it has one, is kept in ``meta["file_messages"]``. Every malformed record
raises :class:`DataFormatError` naming the file, the row (from 1) and the field.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from lldslight.data.example import QAExample
from lldslight.data.formats.common import (
    ANSWER_SPLIT,
    DataFormatError,
    format_passage,
    read_json_records,
    require_file,
    template_messages,
)
from lldslight.data.formats.corpus import (
    CorpusRecordError,
    corpus_record,
    iter_corpus,
    read_title_text_corpus,
    write_corpus_jsonl,
)
from lldslight.data.formats.flashrag import flashrag_record_to_example, read_flashrag_jsonl, write_flashrag_jsonl
from lldslight.data.formats.hf import is_saved_dataset, load_hf_dataset
from lldslight.data.formats.multihop import (
    hotpotqa_record_to_example,
    load_2wiki,
    load_hotpotqa_with_contexts,
    load_musique,
    musique_record_to_example,
    twowiki_record_to_example,
)
from lldslight.data.formats.searchr1 import (
    SEARCHR1_SCHEMA,
    question_from_prompt,
    read_searchr1_parquet,
    searchr1_record_to_example,
    write_searchr1_parquet,
)

__all__ = [
    "ANSWER_SPLIT",
    "SEARCHR1_SCHEMA",
    "CorpusRecordError",
    "DataFormatError",
    "corpus_record",
    "flashrag_record_to_example",
    "format_passage",
    "hotpotqa_record_to_example",
    "is_saved_dataset",
    "iter_corpus",
    "load_2wiki",
    "load_examples",
    "load_hf_dataset",
    "load_hotpotqa_with_contexts",
    "load_musique",
    "musique_record_to_example",
    "question_from_prompt",
    "read_flashrag_jsonl",
    "read_searchr1_parquet",
    "read_title_text_corpus",
    "searchr1_record_to_example",
    "template_messages",
    "twowiki_record_to_example",
    "write_corpus_jsonl",
    "write_flashrag_jsonl",
    "write_searchr1_parquet",
]


def _records_to_examples(records: Sequence[Mapping], path: Path, data_source: Optional[str]) -> list[QAExample]:
    """JSON records -> QAExamples, the format told apart by the first record's fields."""
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
        raise DataFormatError(f"{path}, row 1: unknown record format with fields {sorted(keys)}")
    return [convert(r, path, i, data_source) for i, r in enumerate(records)]


def load_examples(
    path: str | os.PathLike, data_source: Optional[str] = None, split: Optional[str] = None
) -> list[QAExample]:
    """Read questions from any supported file, picking the reader by extension and record fields.

    .parquet: Search-R1. .jsonl / .json: FlashRAG, R1-Searcher {idx, question, answer}, Search-R1
    rows, HotpotQA-with-contexts, 2Wiki, native MuSiQue. A directory: a HF dataset saved with
    ``save_to_disk`` (``split`` picks one split of a DatasetDict), and no other: ``datasets``
    reads any folder as a dataset of the data files it finds in it, at any depth, so a folder given
    by mistake would silently become the data.
    """
    p = Path(path)
    if p.is_dir():
        if not is_saved_dataset(p):
            raise DataFormatError(f"{p}: a directory, but neither a dataset saved with save_to_disk (no "
                                  "dataset_info.json or dataset_dict.json in it) nor a data file: give a .parquet, "
                                  ".jsonl or .json file, or such a dataset directory")
        return load_hf_dataset(p, split=split, data_source=data_source)
    require_file(p)
    if p.suffix == ".parquet":
        return read_searchr1_parquet(p, data_source)
    if p.suffix in (".jsonl", ".json"):
        return _records_to_examples(read_json_records(p), p, data_source)
    raise DataFormatError(f"{p}: unsupported extension {p.suffix!r} (expected .parquet, .jsonl, .json or a directory)")
