"""Retrieval for search agents: the Retriever contract, BM25 and dense backends, the
Search-R1-compatible HTTP server and client, and on-disk index building.

Names are imported on first use (PEP 562), so ``import lldslight.retrieval.base`` (or a config's
``class_path: lldslight.retrieval.HttpRetriever``) loads neither faiss, torch nor FastAPI.
"""
from __future__ import annotations

from lldslight.lazy import lazy_exports

from .base import Passage, RetrievalError, Retriever, register_retriever, retriever_class, retriever_names

_LAZY = {
    "BM25Retriever": "bm25",
    "DenseRetriever": "dense",
    "HttpRetriever": "http",
    "UNAVAILABLE": "http",
    "build_index": "index",
    "corpus_fingerprint": "index",
    "iter_corpus_spans": "index",
    "load_index": "index",
    "ServerHandle": "server",
    "ServerLimits": "server",
    "create_app": "server",
    "serve": "server",
    "start_server": "server",
    "start_server_process": "server",
}

__all__ = ["Passage", "RetrievalError", "Retriever", "register_retriever", "retriever_class", "retriever_names", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
