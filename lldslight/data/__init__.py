"""Question and corpus data: formats, the synthetic knowledge base, the LightningDataModule.

Names are imported on first use (PEP 562): reading a file with ``lldslight.data.formats`` (the
retrieval index, ``lldslight data inspect``, preflight checks) does not import Lightning.
"""
from __future__ import annotations

from lldslight.lazy import lazy_exports

_LAZY = {
    **dict.fromkeys(
        ["SearchQADataModule", "ShardedEvalSampler", "SynthConfig", "TrainPosition", "TrainSampler", "collate_examples"],
        "datamodule",
    ),
    **dict.fromkeys(["SEARCH_R1_TEMPLATE", "QAExample", "make_prompt"], "example"),
    **dict.fromkeys(
        [
            "ANSWER_SPLIT",
            "DataFormatError",
            "format_passage",
            "iter_corpus",
            "load_2wiki",
            "load_examples",
            "load_hf_dataset",
            "load_hotpotqa_with_contexts",
            "load_musique",
            "question_from_prompt",
            "read_flashrag_jsonl",
            "read_searchr1_parquet",
            "read_title_text_corpus",
            "write_corpus_jsonl",
            "write_flashrag_jsonl",
            "write_searchr1_parquet",
        ],
        "formats",
    ),
    "synthesize": "synth",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
