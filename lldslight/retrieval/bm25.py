"""BM25 retrieval with bm25s: sparse, instant to build, no model. The demo's default retriever."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional

import numpy as np

from .base import Passage, RetrievalError
from .index import IndexedRetriever

# Chunked tokenisation keeps peak memory at one chunk of raw text plus the token ids.
_TOKENIZE_CHUNK = 20_000
_SUBDIR = "bm25s"


def _stemmer_fn(stemmer: Optional[str]) -> Optional[Callable[[str], str]]:
    if stemmer is None:
        return None
    try:
        import Stemmer  # PyStemmer
    except ImportError:
        raise RetrievalError(f"stemmer={stemmer!r} needs PyStemmer (pip install PyStemmer), or use stemmer=None") from None
    try:
        return Stemmer.Stemmer(stemmer).stemWord
    except KeyError:
        raise RetrievalError(f"unknown stemmer language {stemmer!r}; PyStemmer knows {Stemmer.algorithms()}") from None


class BM25Retriever(IndexedRetriever):
    """Okapi BM25 over a jsonl corpus, index cached on disk.

    Args:
        corpus: jsonl file of ``{"id", "contents"}`` rows. Required unless ``index_dir`` holds an
            index made by ``lldslight index`` (then its recorded corpus is used).
        index_dir: an explicit index directory (from ``lldslight index``), or a cache root under
            which the index is built. Default: a ``.<corpus>.bm25-<key>`` directory next to the
            corpus (user cache if that directory is read-only).
        k1: term-frequency saturation.
        b: document-length normalisation.
        method: bm25s scoring variant ("lucene" matches Pyserini, which Search-R1 used).
        stemmer: PyStemmer language (e.g. "english"); None disables stemming. Needs PyStemmer.
        stopwords: bm25s stop-word list ("en") or None to keep every word.
        show_progress: progress bars while building.

    Nothing is read at construction; the index is built or loaded on the first ``search`` or
    ``load()``.
    """

    kind = "bm25"
    _transient = ("_bm25", "_tokenizer")

    def __init__(
        self,
        corpus: Optional[str] = None,
        index_dir: Optional[str] = None,
        k1: float = 1.5,
        b: float = 0.75,
        method: Literal["lucene", "robertson", "atire", "bm25l", "bm25+"] = "lucene",
        stemmer: Optional[str] = None,
        stopwords: Optional[str] = "en",
        show_progress: bool = True,
    ):
        super().__init__(corpus, index_dir, show_progress)
        self.k1 = float(k1)
        self.b = float(b)
        self.method = method
        self.stemmer = stemmer
        self.stopwords = stopwords
        self._bm25: Any = None
        self._tokenizer: Any = None
        self._empty_id: Optional[int] = None

    def index_settings(self) -> dict[str, Any]:
        return {"k1": self.k1, "b": self.b, "method": self.method, "stemmer": self.stemmer, "stopwords": self.stopwords}

    def _new_tokenizer(self) -> Any:
        from bm25s.tokenization import Tokenizer

        # One Tokenizer class for corpus and queries: same lowercasing, splitting, stop words, stems.
        return Tokenizer(lower=True, stopwords=self.stopwords or [], stemmer=_stemmer_fn(self.stemmer))

    def _write(self, tmp: Path, rows: Iterator[tuple[str, str]], total: int) -> None:
        import bm25s
        from tqdm.auto import tqdm

        tok = self._new_tokenizer()
        ids: list[list[int]] = []
        chunk: list[str] = []
        # `with`: a malformed row ends the bar's line before its error is printed.
        with tqdm(total=total or None, desc="BM25 tokenise", unit="psg", disable=not self.show_progress) as bar:
            for _pid, contents in rows:
                chunk.append(contents)
                if len(chunk) >= _TOKENIZE_CHUNK:
                    ids.extend(tok.tokenize(chunk, update_vocab=True, return_as="ids", show_progress=False))
                    bar.update(len(chunk))
                    chunk = []
            if chunk:
                ids.extend(tok.tokenize(chunk, update_vocab=True, return_as="ids", show_progress=False))
                bar.update(len(chunk))
            bar.total = bar.n  # the line count included blank lines
        if not ids:
            return  # the caller reports the empty corpus
        model = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
        model.index((ids, tok.get_vocab_dict()), show_progress=self.show_progress)
        out = tmp / _SUBDIR
        model.save(str(out), show_progress=False)
        tok.save_vocab(str(out))
        tok.save_stopwords(str(out))

    def _read(self, index_dir: Path) -> None:
        import bm25s

        d = index_dir / _SUBDIR
        try:
            model = bm25s.BM25.load(str(d), mmap=False, show_progress=False, verbosity=0)
            tok = self._new_tokenizer()
            tok.load_vocab(str(d))
            tok.load_stopwords(str(d))
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise RetrievalError(f"corrupt BM25 index {d}: {e}") from e
        self._bm25, self._tokenizer = model, tok
        self._empty_id = tok.get_vocab_dict().get("")

    def _search(self, queries: list[str], k: int) -> list[list[Passage]]:
        assert self._corpus is not None
        k = min(k, len(self._corpus))
        # update_vocab="never": unknown query words must not grow the shared vocabulary.
        qids = list(self._tokenizer.tokenize(queries, update_vocab="never", return_as="ids", show_progress=False))
        live = [i for i, q in enumerate(qids) if any(t != self._empty_id for t in q)]
        out: list[list[Passage]] = [[] for _ in queries]  # no known word -> nothing relevant
        if not live:
            return out
        docs, scores = self._bm25.retrieve([qids[i] for i in live], k=k, show_progress=False, n_threads=0)
        docs, scores = np.asarray(docs), np.asarray(scores)
        for row, qi in enumerate(live):
            # Lucene (Pyserini, Search-R1's BM25) only returns documents sharing a term with the query.
            out[qi] = [self._corpus.passage(int(d), float(s)) for d, s in zip(docs[row], scores[row]) if s > 0]
        return out
