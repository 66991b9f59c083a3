"""On-disk index lifecycle shared by every local retriever: corpus reading, fingerprints,
index location (cache or explicit directory), atomic builds, and ``load_index``.

A corpus is a jsonl file of ``{"id": ..., "contents": "\\"Title\\"\\ntext"}`` rows (wiki-18 style;
``{"id", "title", "text"}`` rows are accepted too). An index never copies the passages: it keeps
each row's byte span in the corpus file and reads the rows it returns on demand, so a 21M-passage
corpus costs no RAM beyond the index itself. The price is that the corpus must stay exactly as it
was when the index was built, which the fingerprint checks.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from lldslight.data.formats import CorpusRecordError, corpus_record
from lldslight.errors import require

from .base import Passage, RetrievalError, retriever_class  # noqa: F401  (retriever_class: re-exported)

CONFIG_NAME = "lldslight_index.json"
SPANS_NAME = "spans.npy"
FORMAT_VERSION = 1
_MIB = 1 << 20


# --------------------------------------------------------------------------- fingerprint


def corpus_fingerprint(path: str | os.PathLike) -> str:
    """Cheap identity of a corpus file: size, mtime_ns and sha256 of its first and last MiB.

    Hashing all of wiki-18 (14 GB) would take minutes on every start; size + mtime catch normal
    edits and the head/tail hash catches a same-size rewrite that preserved the mtime.
    """
    p = Path(path)
    try:
        st = p.stat()
        h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
        with open(p, "rb") as f:
            h.update(f.read(_MIB))
            if st.st_size > _MIB:
                f.seek(max(_MIB, st.st_size - _MIB))
                h.update(f.read(_MIB))
    except FileNotFoundError:
        raise RetrievalError(f"corpus not found: {p}") from None
    except OSError as e:
        raise RetrievalError(f"cannot read corpus {p}: {e}") from e
    return h.hexdigest()


# --------------------------------------------------------------------------- corpus reading


def parse_row(line: bytes | str, where: str) -> tuple[str, str]:
    """One corpus row -> (id, contents); errors start with ``where`` ("file:line")."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise RetrievalError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise RetrievalError(f"{where}: not valid UTF-8 ({e})") from None
    try:
        pid, contents = corpus_record(row)
    except CorpusRecordError as e:
        raise RetrievalError(f"{where}: {e}") from None
    return pid, contents


def iter_corpus_spans(path: str | os.PathLike) -> Iterator[tuple[int, int, str, str]]:
    """Yield (start, end, id, contents) per non-blank line of a corpus .jsonl; start/end are byte
    offsets, saved with an index for random access (lldslight.data.iter_corpus reads rows as dicts)."""
    p = Path(path)
    if not p.is_file():
        raise RetrievalError(f"corpus not found: {p}" if not p.exists() else f"corpus is not a file: {p}")
    pos = 0
    with open(p, "rb") as f:
        for lineno, line in enumerate(f, 1):
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            pid, contents = parse_row(line, f"{p}:{lineno}")
            yield start, pos, pid, contents


def count_lines(path: str | os.PathLike) -> int:
    """Newline count (an upper bound on passages) for a progress-bar total; ~1 GB/s."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(16 * _MIB):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


class Corpus:
    """Random access to corpus rows by index, through the byte spans saved with an index."""

    def __init__(self, path: str | os.PathLike, spans: np.ndarray):
        self.path = Path(path)
        self.spans = spans  # (n, 2) int64 [start, end); may be a read-only memmap
        self._fd: Optional[int] = None
        self._fd_lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.spans.shape[0])

    def _file(self) -> int:
        if self._fd is None:
            with self._fd_lock:
                if self._fd is None:
                    try:
                        self._fd = os.open(self.path, os.O_RDONLY)
                    except FileNotFoundError:
                        raise RetrievalError(f"corpus not found: {self.path}") from None
        return self._fd

    def get(self, i: int) -> tuple[str, str]:
        start, end = (int(x) for x in self.spans[i])
        # pread keeps concurrent readers (server worker, rollout threads) off a shared file cursor.
        line = os.pread(self._file(), end - start, start)
        # Line numbers are not stored (blank lines shift them); the byte offset locates the row.
        return parse_row(line, f"{self.path} (passage {i} at byte {start})")

    def passage(self, i: int, score: float) -> Passage:
        pid, contents = self.get(i)
        return Passage(id=pid, contents=contents, score=float(score))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fd"], state["_fd_lock"] = None, None
        state["spans"] = np.asarray(self.spans)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fd_lock = threading.Lock()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- index config


@dataclass
class IndexConfig:
    """The JSON written next to every index (``lldslight_index.json``)."""

    kind: str  # "bm25" | "dense"
    settings: dict[str, Any]  # what the index's contents depend on; must match to reuse it
    query_settings: dict[str, Any]  # recorded for load_index, not checked (query_prefix, ...)
    corpus_path: str
    corpus_fingerprint: str
    count: int
    format: int = FORMAT_VERSION
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "retriever": self.kind,
            "settings": self.settings,
            "query_settings": self.query_settings,
            "corpus": {"path": self.corpus_path, "fingerprint": self.corpus_fingerprint, "count": self.count},
            "created": self.created,
        }

    @classmethod
    def read(cls, index_dir: str | os.PathLike) -> "IndexConfig":
        path = Path(index_dir) / CONFIG_NAME
        if Path(index_dir).is_file():  # a corpus given for its index, typically (was NotADirectoryError)
            raise RetrievalError(f"no index at {index_dir}: {index_dir} is a file, not an index directory (a corpus? "
                                 f"build its index with `lldslight index --corpus {index_dir} --out DIR`, or serve it "
                                 f"with --corpus {index_dir})")
        try:
            raw = json.loads(path.read_text())
            return cls(
                kind=raw["retriever"],
                settings=raw["settings"],
                query_settings=raw.get("query_settings", {}),
                corpus_path=raw["corpus"]["path"],
                corpus_fingerprint=raw["corpus"]["fingerprint"],
                count=int(raw["corpus"]["count"]),
                format=int(raw.get("format", 0)),
                created=float(raw.get("created", 0.0)),
            )
        except FileNotFoundError:
            raise RetrievalError(f"no index at {index_dir} (missing {CONFIG_NAME})") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise RetrievalError(f"corrupt index config {path}: {e!r}") from None

    def write(self, index_dir: str | os.PathLike) -> None:
        (Path(index_dir) / CONFIG_NAME).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def is_index_dir(path: str | os.PathLike | None) -> bool:
    return path is not None and (Path(path) / CONFIG_NAME).is_file()


def _settings_key(kind: str, settings: dict[str, Any], fingerprint: str) -> str:
    blob = json.dumps({"kind": kind, "settings": settings, "fp": fingerprint, "v": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _writable_dir(d: Path) -> bool:
    """Writable for us *and* not marked read-only: root passes os.access on a r-x directory,
    but a data set shipped read-only (shared/data) must not collect index files."""
    try:
        return os.access(d, os.W_OK | os.X_OK) and bool(d.stat().st_mode & 0o222)
    except OSError:
        return False


def default_cache_root() -> Path:
    base = os.environ.get("LLDSLIGHT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lldslight"
    )
    return Path(base) / "indexes"


def cache_location(corpus: Path, kind: str, settings: dict[str, Any], fingerprint: str,
                   cache_root: Optional[Path]) -> tuple[Path, str]:
    """Where the cached index for (corpus, settings) lives, and the name prefix its siblings share.

    Default: next to the corpus as ``.<name>.<kind>-<key>``; when the corpus sits in a read-only
    directory (shared data sets), under the user cache with the corpus path hashed into the name.
    """
    key = _settings_key(kind, settings, fingerprint)
    if cache_root is not None:
        prefix = f"{corpus.name}.{kind}-"
        return Path(cache_root) / f"{prefix}{key}", prefix
    if _writable_dir(corpus.parent):
        prefix = f".{corpus.name}.{kind}-"
        return corpus.parent / f"{prefix}{key}", prefix
    where = hashlib.sha256(str(corpus).encode()).hexdigest()[:8]
    prefix = f"{corpus.name}-{where}.{kind}-"
    return default_cache_root() / f"{prefix}{key}", prefix


def _remove_stale_siblings(target: Path, prefix: str, corpus: Path) -> None:
    """Drop older cached indexes of the same corpus (same name prefix and recorded path)."""
    for sib in target.parent.glob(prefix + "*"):
        if sib == target or not is_index_dir(sib):
            continue
        try:
            if Path(IndexConfig.read(sib).corpus_path) == corpus:
                shutil.rmtree(sib, ignore_errors=True)
        except RetrievalError:
            continue


# --------------------------------------------------------------------------- the base class


class IndexedRetriever:
    """Lazy life cycle of a retriever backed by an on-disk index over a jsonl corpus.

    Nothing touches the disk at construction (configs instantiate retrievers before the data
    exists). The first ``search`` (or ``load()``) resolves the index:

    * ``index_dir`` holding ``lldslight_index.json`` (made by ``lldslight index``): an explicit
      index. It is used as is; a corpus or settings mismatch is an error, never a silent rebuild.
    * otherwise a cache: ``<index_dir>/<corpus>.<kind>-<key>`` or, without ``index_dir``,
      ``.<corpus>.<kind>-<key>`` next to the corpus (the user cache when that directory is
      read-only). The key hashes the corpus fingerprint and the index settings, so an edited
      corpus or a new setting builds a fresh index and the stale one is removed.

    Subclasses define ``kind``, ``index_settings()``, ``query_settings()``, ``_write(tmp, rows,
    total)`` (build into a fresh directory, return the passage count), ``_read(dir)`` and
    ``_search(queries, k)``.
    """

    kind: str = ""

    def __init__(self, corpus: Optional[str], index_dir: Optional[str], show_progress: bool):
        require(corpus is not None or index_dir is not None, f"{type(self).__name__}.corpus / index_dir",
                "given (a corpus, an index_dir, or both)", None)
        self.corpus = corpus
        self.index_dir = index_dir
        self.show_progress = show_progress
        self._corpus: Optional[Corpus] = None
        self._lock = threading.RLock()
        self.index_path: Optional[Path] = None  # resolved on load
        self.build_count = 0  # how many times this object built an index (tests, logs)

    # -- subclass hooks ---------------------------------------------------------------------
    def index_settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def query_settings(self) -> dict[str, Any]:
        return {}

    def _write(self, tmp: Path, rows: Iterator[tuple[str, str]], total: int) -> None:
        raise NotImplementedError

    def _read(self, index_dir: Path) -> None:
        raise NotImplementedError

    def _search(self, queries: list[str], k: int) -> list[list[Passage]]:
        raise NotImplementedError

    # -- public ------------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._corpus is not None

    def __len__(self) -> int:
        self.load()
        assert self._corpus is not None
        return len(self._corpus)

    def load(self) -> "IndexedRetriever":
        """Resolve, build if needed, and open the index. Idempotent and thread-safe."""
        if self._corpus is not None:
            return self
        with self._lock:
            if self._corpus is None:
                self._open()
        return self

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if isinstance(queries, str):
            raise TypeError("search takes a list of queries, not a single string")
        require(k >= 1, f"{type(self).__name__}.search k (rollout.topk)", ">= 1", k)
        if not queries:
            return []
        self.load()
        return self._search(list(queries), int(k))

    def build(self, out_dir: str | os.PathLike, force: bool = False) -> Path:
        """Build an explicit index at ``out_dir`` (what ``lldslight index`` writes) and open it.

        An index already at ``out_dir`` is replaced only with ``force``: it may be another corpus's,
        hours of encoding. A non-empty directory that holds no index is never written into."""
        if self.corpus is None:
            raise RetrievalError("building an index needs a corpus")
        out = Path(out_dir).resolve()
        if out.exists() and not out.is_dir():
            raise RetrievalError(f"{out} is a file, not a directory; give --out a directory for the index")
        if out.exists() and any(out.iterdir()) and not is_index_dir(out):
            raise RetrievalError(f"{out} exists, is not empty and holds no lldslight index; refusing to overwrite")
        if is_index_dir(out) and not force:
            try:
                cfg = IndexConfig.read(out)
                what = f"a {cfg.kind} index of {cfg.corpus_path} ({cfg.count} passages)"
            except RetrievalError:
                what = "an lldslight index (its config is unreadable)"
            raise RetrievalError(f"{out} already holds {what}; pass --force to replace it, or choose another --out")
        corpus = Path(self.corpus).resolve()
        fp = corpus_fingerprint(corpus)
        with self._lock:
            self._build_at(out, corpus, fp, replace=True)
            self.index_dir = str(out)
            self._open_at(out, corpus, expect_fp=fp)
        return out

    # -- internals ----------------------------------------------------------------------------
    def _open(self) -> None:
        if is_index_dir(self.index_dir):
            self._open_explicit(Path(self.index_dir))  # type: ignore[arg-type]
            return
        if self.corpus is None:
            raise RetrievalError(f"no index at {self.index_dir} (missing {CONFIG_NAME}) and no corpus to build one from")
        corpus = Path(self.corpus).resolve()
        fp = corpus_fingerprint(corpus)  # raises "corpus not found: <path>"
        target, prefix = cache_location(corpus, self.kind, self.index_settings(), fp,
                                        Path(self.index_dir) if self.index_dir else None)
        if is_index_dir(target):
            try:
                self._open_at(target, corpus, expect_fp=fp)
                return
            except RetrievalError:
                shutil.rmtree(target, ignore_errors=True)  # a damaged cache entry is rebuilt
        self._build_at(target, corpus, fp, replace=False)
        _remove_stale_siblings(target, prefix, corpus)
        self._open_at(target, corpus, expect_fp=fp)

    def _open_explicit(self, index_dir: Path) -> None:
        cfg = IndexConfig.read(index_dir)
        if cfg.kind != self.kind:
            raise RetrievalError(f"{index_dir} holds a {cfg.kind!r} index, not {self.kind!r}; use load_index({str(index_dir)!r})")
        ours = self.index_settings()
        diff = {k: (cfg.settings.get(k), v) for k, v in ours.items() if cfg.settings.get(k) != v}
        if diff:
            lines = ", ".join(f"{k}: index has {a!r}, retriever has {b!r}" for k, (a, b) in diff.items())
            raise RetrievalError(f"index {index_dir} was built with other settings ({lines}); "
                                 f"pass the index's settings or use load_index({str(index_dir)!r})")
        corpus = Path(self.corpus).resolve() if self.corpus else Path(cfg.corpus_path)
        fp = corpus_fingerprint(corpus)
        if fp != cfg.corpus_fingerprint:
            raise RetrievalError(
                f"corpus {corpus} changed since the index {index_dir} was built (fingerprint {fp[:12]} != "
                f"{cfg.corpus_fingerprint[:12]}); rebuild it with `lldslight index --corpus {corpus} "
                f"--retriever {self.kind} --out {index_dir} --force`")
        self._open_at(index_dir, corpus, expect_fp=fp)

    def _open_at(self, index_dir: Path, corpus: Path, expect_fp: str) -> None:
        cfg = IndexConfig.read(index_dir)
        if cfg.corpus_fingerprint != expect_fp:
            raise RetrievalError(f"index {index_dir} does not match corpus {corpus}")
        try:
            spans = np.load(index_dir / SPANS_NAME, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise RetrievalError(f"corrupt index {index_dir}: {e}") from e
        if spans.shape != (cfg.count, 2):
            raise RetrievalError(f"corrupt index {index_dir}: {SPANS_NAME} has shape {spans.shape}, expected ({cfg.count}, 2)")
        self._read(index_dir)
        self._corpus = Corpus(corpus, spans)
        self.index_path = index_dir

    def _build_at(self, target: Path, corpus: Path, fp: str, replace: bool) -> None:
        """Build into a temporary sibling, then rename: readers never see a half-written index,
        and two processes racing on the same cache (DDP ranks) both end up with a valid one."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        except OSError as e:
            raise RetrievalError(f"cannot write the {self.kind} index for {corpus} to {target.parent}: {e}") from e
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; an index is meant to be shared
        try:
            spans: list[tuple[int, int]] = []

            def rows() -> Iterator[tuple[str, str]]:
                for start, end, pid, contents in iter_corpus_spans(corpus):
                    spans.append((start, end))
                    yield pid, contents

            total = count_lines(corpus) if self.show_progress else 0
            self._write(tmp, rows(), total)
            if not spans:
                raise RetrievalError(f"corpus {corpus} has no passages")
            np.save(tmp / SPANS_NAME, np.asarray(spans, dtype=np.int64).reshape(-1, 2))
            if corpus_fingerprint(corpus) != fp:
                raise RetrievalError(f"corpus {corpus} changed while its index was being built")
            IndexConfig(kind=self.kind, settings=self.index_settings(), query_settings=self.query_settings(),
                        corpus_path=str(corpus), corpus_fingerprint=fp, count=len(spans),
                        created=time.time()).write(tmp)
            self.build_count += 1
            if replace and target.exists():
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                os.rename(target, old)
                os.rename(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                try:
                    os.rename(tmp, target)
                except OSError:
                    if not is_index_dir(target):  # lost a race: the winner's index is as good
                        raise
        except OSError as e:  # a full disk or a quota: one line, and no half-written index left
            why = e.strerror or str(e).splitlines()[0]
            raise RetrievalError(f"cannot write the {self.kind} index for {corpus} to {target}: {why} (a full disk?); "
                                 f"nothing was written there") from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # Loaded state (models, faiss indexes, open files) is not pickled: a copy sent to a worker
    # process reopens the index from disk on its first search, without rebuilding it.
    _transient: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"], state["_corpus"] = None, None
        for name in self._transient:
            state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()


# --------------------------------------------------------------------------- build / load


def build_index(corpus: str, out: str, retriever: str = "bm25", force: bool = False, **settings: Any) -> Path:
    """Build an explicit index of ``retriever`` kind ("bm25" | "dense") for ``corpus`` at ``out``
    (an index already there is replaced only with ``force``)."""
    r = retriever_class(retriever, indexed=True)(corpus=corpus, **settings)
    return r.build(out, force=force)


def load_index(index_dir: str | os.PathLike, corpus: Optional[str] = None, **overrides: Any) -> IndexedRetriever:
    """Open an index written by ``lldslight index``, with the settings it was built with.

    ``corpus`` overrides the recorded corpus path (a moved corpus); its fingerprint must still
    match. ``overrides`` set run-time options (device, batch_size, ...). The index is opened now,
    so a missing or changed corpus fails here rather than at the first search.
    """
    cfg = IndexConfig.read(index_dir)
    cls = retriever_class(cfg.kind, indexed=True)
    kwargs: dict[str, Any] = {**cfg.settings, **cfg.query_settings, **overrides}
    r = cls(corpus=corpus, index_dir=str(index_dir), **kwargs)
    return r.load()
