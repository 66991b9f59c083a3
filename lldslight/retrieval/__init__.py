"""Retrieval for search agents: the Retriever contract, BM25 and dense backends, the
Search-R1-compatible HTTP server and client, and on-disk index building."""
from .base import Passage, RetrievalError, Retriever
from .bm25 import BM25Retriever
from .dense import DenseRetriever
from .http import UNAVAILABLE, HttpRetriever
from .index import build_index, corpus_fingerprint, iter_corpus_spans, load_index
from .server import ServerHandle, ServerLimits, create_app, serve, start_server, start_server_process

__all__ = [
    "Passage",
    "RetrievalError",
    "Retriever",
    "BM25Retriever",
    "DenseRetriever",
    "HttpRetriever",
    "UNAVAILABLE",
    "build_index",
    "corpus_fingerprint",
    "iter_corpus_spans",
    "load_index",
    "ServerHandle",
    "ServerLimits",
    "create_app",
    "serve",
    "start_server",
    "start_server_process",
]
