"""HotpotQA (with contexts), 2WikiMultihopQA and MuSiQue: one reader, three field mappings.

The three sets share one shape: a question id, a question, gold answers, and evidence that names
the supporting passages. Their loaders share one too: read the questions, read (or, for HotpotQA,
build) the corpus, and point each question's meta["supporting_ids"] at the corpus rows that hold its
evidence, so recall@k can be measured. A :class:`MultihopFormat` says where each set keeps those
fields; the reading and linking are written once, here.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lldslight.data.example import QAExample
from lldslight.data.formats.common import (
    as_list,
    field_error,
    format_passage,
    jsonable,
    passage_title,
    read_answers,
    read_id,
    read_json_records,
    read_question,
    template_messages,
    truthy,
)
from lldslight.data.formats.corpus import read_title_text_corpus

PathLike = str | os.PathLike
Record = Mapping[str, Any]


@dataclass(frozen=True)
class MultihopFormat:
    """Where one multi-hop set keeps its fields.

    Args:
        data_source: the examples' data_source unless the caller names one.
        id_field: the question id. Missing, it becomes "{file stem}_{row}" unless ``id_required``.
        id_required: HotpotQA's passage ids are built from the question id, so it must be there.
        question_field: the question text.
        answers: (record, path, row) -> gold answers, from the set's own answer fields.
        evidence: (record, path, row, question id) -> the set's meta fields; holds
            "supporting_titles" and the ``link`` field.
        link: the meta field whose values find the supporting passages in a corpus:
            "supporting_titles" (matched with passage titles) or "supporting_contents" (whole contents).
        own_corpus: (records, examples) -> corpus built from the question file itself (HotpotQA's
            contexts); None: the corpus is a separate [{title, text}] file.
    """

    data_source: str
    id_field: str
    question_field: str
    answers: Callable[[Record, PathLike, int], list[str]]
    evidence: Callable[[Record, PathLike, int, str], dict]
    link: str
    id_required: bool = False
    own_corpus: Optional[Callable[[Sequence[Record], list[QAExample]], list[dict]]] = None

    def to_example(self, rec: Record, path: PathLike, row: int, data_source: Optional[str] = None) -> QAExample:
        """One record -> QAExample; every malformed field raises DataFormatError naming it."""
        raw_id = rec.get(self.id_field) if self.id_required else rec.get(self.id_field, f"{Path(path).stem}_{row}")
        qid = read_id(raw_id, path, row, self.id_field)
        question = read_question(rec.get(self.question_field), path, row, self.question_field)
        answers = self.answers(rec, path, row)
        return QAExample(
            id=qid,
            question=question,
            golden_answers=answers,
            data_source=data_source or self.data_source,
            messages=template_messages(question),
            meta={"source_file": str(path), "row": row, **self.evidence(rec, path, row, qid)},
        )

    def load(
        self, questions_path: PathLike, corpus_path: Optional[PathLike] = None, data_source: Optional[str] = None
    ) -> tuple[list[QAExample], list[dict]]:
        """(examples, corpus); with a corpus, meta["supporting_ids"] lists the supporting rows' ids."""
        records = read_json_records(questions_path)
        examples = [self.to_example(r, questions_path, i, data_source) for i, r in enumerate(records)]
        if self.own_corpus is not None:
            corpus = self.own_corpus(records, examples)
        else:
            corpus = read_title_text_corpus(corpus_path) if corpus_path is not None else []
        if corpus:
            key = passage_title if self.link == "supporting_titles" else (lambda contents: contents)
            ids_of: dict[str, list[str]] = {}
            for r in corpus:
                ids_of.setdefault(key(r["contents"]), []).append(r["id"])
            for ex in examples:
                ex.meta["supporting_ids"] = [i for k in ex.meta[self.link] for i in ids_of.get(k, [])]
        return examples, corpus


def _paragraphs(rec: Record, path: PathLike, row: int, field: str, required: Sequence[str]) -> list[Mapping]:
    """A list of {title, paragraph_text, is_supporting, ...} (HotpotQA contexts, MuSiQue paragraphs)."""
    paragraphs = as_list(rec.get(field)) or []
    for j, p in enumerate(paragraphs):
        for f in required:
            if not isinstance(p, Mapping) or p.get(f) is None:
                raise field_error(path, row, f"{field}[{j}].{f}", "missing")
        for f in ("title", "paragraph_text"):
            if not isinstance(p[f], str):
                raise field_error(path, row, f"{field}[{j}].{f}", f"expected a string, got {p[f]!r}")
    return paragraphs


def _supporting(paragraphs: Sequence[Mapping]) -> list[str]:
    return [format_passage(p["title"], p["paragraph_text"]) for p in paragraphs if truthy(p.get("is_supporting"))]


# ----------------------------------------------------------------------------- HotpotQA


def _hotpot_answers(rec: Record, path: PathLike, row: int) -> list[str]:
    objs = as_list(rec.get("answers_objects"))
    if not objs:
        raise field_error(path, row, "answers_objects", "missing or empty")
    spans: list[str] = []
    for j, o in enumerate(objs):
        if not isinstance(o, Mapping) or as_list(o.get("spans")) is None:
            raise field_error(path, row, f"answers_objects[{j}].spans", "missing")
        spans.extend(as_list(o["spans"]))  # type: ignore[arg-type]
    return read_answers(spans, path, row, "answers_objects.spans")


def _hotpot_evidence(rec: Record, path: PathLike, row: int, qid: str) -> dict:
    # Context ids restart at 0 per question: "{question_id}-{context id}" is unique in the file.
    if as_list(rec.get("contexts")) is None:
        raise field_error(path, row, "contexts", "missing")
    contexts = _paragraphs(rec, path, row, "contexts", ("id", "title", "paragraph_text"))
    ctx_meta = [
        {"id": f"{qid}-{c['id']}", "title": c["title"], "is_supporting": truthy(c.get("is_supporting"))}
        for c in contexts
    ]
    return {
        "contexts": ctx_meta,
        "supporting_ids": [c["id"] for c in ctx_meta if c["is_supporting"]],
        "supporting_titles": [c["title"] for c in ctx_meta if c["is_supporting"]],
        "supporting_contents": _supporting(contexts),
    }


def _hotpot_corpus(records: Sequence[Record], examples: list[QAExample]) -> list[dict]:
    """Every question's paragraphs; one shared by several questions is stored once, under its
    first id, and meta["contexts"] points at that stored id, so recall@k counts it once."""
    corpus: list[dict] = []
    id_of: dict[str, str] = {}
    for ex, rec in zip(examples, records):
        for ctx, c in zip(ex.meta["contexts"], rec["contexts"]):
            contents = format_passage(c["title"], c["paragraph_text"])
            if contents not in id_of:
                id_of[contents] = ctx["id"]
                corpus.append({"id": ctx["id"], "contents": contents})
            ctx["id"] = id_of[contents]
    return corpus


HOTPOTQA = MultihopFormat(
    data_source="hotpotqa",
    id_field="question_id",
    id_required=True,
    question_field="question_text",
    answers=_hotpot_answers,
    evidence=_hotpot_evidence,
    link="supporting_contents",
    own_corpus=_hotpot_corpus,
)

# ----------------------------------------------------------------------------- 2WikiMultihopQA


def _twowiki_evidence(rec: Record, path: PathLike, row: int, qid: str) -> dict:
    evidence = [list(t) for t in (as_list(rec.get("evidence")) or [])]
    titles: list[str] = []
    for t in evidence:
        if t and isinstance(t[0], str) and t[0] not in titles:
            titles.append(t[0])  # the subject of each evidence triple names its supporting page
    return {"question_type": rec.get("question_type", ""), "evidence": evidence, "supporting_titles": titles}


TWOWIKI = MultihopFormat(
    data_source="2wikimultihopqa",
    id_field="id",
    question_field="question",
    answers=lambda rec, path, row: read_answers(rec.get("answer"), path, row, "answer"),
    evidence=_twowiki_evidence,
    link="supporting_titles",
)

# ----------------------------------------------------------------------------- MuSiQue


def _musique_answers(rec: Record, path: PathLike, row: int) -> list[str]:
    answers = read_answers(rec.get("answer"), path, row, "answer")
    for a in as_list(rec.get("answer_aliases")) or []:
        if isinstance(a, str) and a.strip() and a.strip() not in answers:
            answers.append(a.strip())
    return answers


def _musique_evidence(rec: Record, path: PathLike, row: int, qid: str) -> dict:
    supporting = _supporting(_paragraphs(rec, path, row, "paragraphs", ("title", "paragraph_text")))
    return {
        "answerable": bool(rec.get("answerable", True)),
        "question_decomposition": jsonable(rec.get("question_decomposition") or []),
        "supporting_titles": [passage_title(c) for c in supporting],
        "supporting_contents": supporting,
    }


MUSIQUE = MultihopFormat(
    data_source="musique",
    id_field="id",
    question_field="question",
    answers=_musique_answers,
    evidence=_musique_evidence,
    link="supporting_contents",
)

# ----------------------------------------------------------------------------- public names

hotpotqa_record_to_example = HOTPOTQA.to_example
twowiki_record_to_example = TWOWIKI.to_example
musique_record_to_example = MUSIQUE.to_example


def load_hotpotqa_with_contexts(path: PathLike, data_source: str = "hotpotqa") -> tuple[list[QAExample], list[dict]]:
    """HotpotQA {question_id, question_text, answers_objects[{spans}], contexts[...]} and the corpus
    made of their paragraphs (every answer is findable). Passage ids are "{question_id}-{context id}";
    a paragraph shared by several questions is stored once."""
    return HOTPOTQA.load(path, None, data_source)


def load_2wiki(
    questions_path: PathLike, corpus_path: Optional[PathLike] = None, data_source: str = "2wikimultihopqa"
) -> tuple[list[QAExample], list[dict]]:
    """2Wiki {id, question_type, question, answer, evidence[[s, r, o]]} (+ the [{title, text}] corpus;
    meta["supporting_ids"]: the passages titled by the evidence triples' subjects)."""
    return TWOWIKI.load(questions_path, corpus_path, data_source)


def load_musique(
    questions_path: PathLike, corpus_path: Optional[PathLike] = None, data_source: str = "musique"
) -> tuple[list[QAExample], list[dict]]:
    """Native MuSiQue {id, paragraphs, question, question_decomposition, answer, answer_aliases}
    (+ the [{title, text}] corpus; supporting paragraphs matched by contents)."""
    return MUSIQUE.load(questions_path, corpus_path, data_source)
