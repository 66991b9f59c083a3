"""Corpus reading and fingerprints (lldslight/retrieval/index.py)."""
import json
import os

import pytest

from lldslight.retrieval import RetrievalError
from lldslight.retrieval.index import corpus_fingerprint, iter_corpus_spans


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_and_byte_spans(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "a", "contents": "\\"A\\"\\nalpha"}\n\n{"id": 7, "title": "B", "text": "beta"}\n')
    rows = list(iter_corpus_spans(p))
    assert [(r[2], r[3]) for r in rows] == [("a", '"A"\nalpha'), ("7", '"B"\nbeta')]
    raw = p.read_bytes()
    for start, end, _, _ in rows:  # spans address exactly one line each, blank lines skipped
        assert json.loads(raw[start:end])


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "malformed JSON"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"contents": "x"}', "missing field 'id'"),
        ('{"id": "x"}', "missing field 'contents'"),
        ('{"id": "x", "contents": 3}', "'contents' must be a string"),
        ('{"id": [1], "contents": "x"}', "'id' must be a string or an integer"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "1", "contents": "ok"}\n' + line + "\n")
    with pytest.raises(RetrievalError) as e:
        list(iter_corpus_spans(p))
    assert f"{p}:2" in str(e.value) and message in str(e.value)


def test_missing_corpus_names_path(tmp_path):
    p = tmp_path / "nope.jsonl"
    with pytest.raises(RetrievalError, match=str(p)):
        list(iter_corpus_spans(p))
    with pytest.raises(RetrievalError, match=str(p)):
        corpus_fingerprint(p)


def test_fingerprint_tracks_changes(tmp_path):
    p = _write(tmp_path / "c.jsonl", [{"id": "1", "contents": "x"}])
    fp = corpus_fingerprint(p)
    assert fp == corpus_fingerprint(p)
    st = os.stat(p)
    p.write_text(p.read_text().replace("x", "y"))  # same size
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # and same mtime: the content hash catches it
    assert corpus_fingerprint(p) != fp


def test_fingerprint_of_large_file_reads_head_and_tail_only(tmp_path):
    p = tmp_path / "big.jsonl"
    line = json.dumps({"id": "1", "contents": "z" * 1000}) + "\n"
    p.write_text(line * 3000)  # ~3 MB: the middle MiB is not hashed, size/mtime guard it
    fp = corpus_fingerprint(p)
    with open(p, "ab") as f:
        f.write(line.encode())
    assert corpus_fingerprint(p) != fp
