"""``lldslight index`` and ``lldslight serve`` (also ``python -m lldslight.retrieval.cli index|serve``)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence

from lldslight.errors import ArgumentParser

from .base import RetrievalError, retriever_class, retriever_names


def _dense_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dense")
    g.add_argument("--encoder", default="all-MiniLM-L6-v2",
                   help="packaged all-MiniLM-L6-v2, a local model dir, or a hub id (default: %(default)s)")
    g.add_argument("--pooling", choices=["mean", "cls"], default="mean")
    g.add_argument("--no-normalize", dest="normalize", action="store_false", help="keep raw embedding norms")
    g.add_argument("--query-prefix", default=None, help='default: "query: " for e5 encoders, else ""')
    g.add_argument("--passage-prefix", default=None, help='default: "passage: " for e5 encoders, else ""')
    g.add_argument("--max-seq-length", type=int, default=256)
    g.add_argument("--index-type", choices=["flat", "hnsw"], default="flat")
    g.add_argument("--hnsw-m", type=int, default=32)
    g.add_argument("--batch-size", type=int, default=64, help="encoder batch size")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads for the encoder (default: torch's)")


def _bm25_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bm25")
    g.add_argument("--k1", type=float, default=1.5)
    g.add_argument("--b", type=float, default=0.75)
    g.add_argument("--method", default="lucene", choices=["lucene", "robertson", "atire", "bm25l", "bm25+"])
    g.add_argument("--stemmer", default=None, help="PyStemmer language, e.g. english (needs PyStemmer)")
    g.add_argument("--stopwords", default="en", help='bm25s stop-word list, or "none"')


def _settings(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    if kind == "bm25":
        return {"k1": args.k1, "b": args.b, "method": args.method, "stemmer": args.stemmer,
                "stopwords": None if str(args.stopwords).lower() == "none" else args.stopwords}
    return {"encoder": args.encoder, "pooling": args.pooling, "normalize": args.normalize,
            "query_prefix": args.query_prefix, "passage_prefix": args.passage_prefix,
            "max_seq_length": args.max_seq_length, "index_type": args.index_type, "hnsw_m": args.hnsw_m,
            "batch_size": args.batch_size, "device": args.device, "threads": args.threads}


def index_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lldslight index --corpus corpus.jsonl --retriever dense|bm25 --out DIR [options]``."""
    p = ArgumentParser(prog="lldslight index", description="Build a retrieval index over a jsonl corpus.")
    p.add_argument("--corpus", required=True, help='jsonl with {"id", "contents"} rows')
    p.add_argument("--retriever", choices=retriever_names(indexed=True), default="bm25")
    p.add_argument("--out", required=True, help="index directory to write")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _bm25_args(p)
    _dense_args(p)
    args = p.parse_args(argv)
    try:
        r = retriever_class(args.retriever, indexed=True)(corpus=args.corpus, show_progress=not args.quiet,
                                            **_settings(args, args.retriever))
        t0 = time.perf_counter()
        out = r.build(args.out)
        dt = time.perf_counter() - t0
        n = len(r)
    except RetrievalError as e:
        print(f"lldslight index: error: {e}", file=sys.stderr)
        return 2
    print(f"lldslight index: {args.retriever} index of {n} passages written to {out} "
          f"in {dt:.1f}s ({n / max(dt, 1e-9):.0f} passages/s)")
    return 0


def serve_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lldslight serve --index DIR [--corpus FILE] --host 127.0.0.1 --port 8000 [limits]``.

    Without ``--index``, ``--corpus`` and ``--retriever`` build (or reuse) a cached index.
    """
    p = ArgumentParser(prog="lldslight serve",
                                description="Serve a retrieval index over HTTP, Search-R1 compatible (POST /retrieve).")
    p.add_argument("--index", default=None, help="index directory from `lldslight index`")
    p.add_argument("--corpus", default=None, help="corpus path (overrides the index's; must be the same file)")
    p.add_argument("--retriever", choices=retriever_names(indexed=True), default="bm25", help="without --index: kind to build")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--max-queries", type=int, default=512, help="queries per request")
    p.add_argument("--max-topk", type=int, default=100)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--default-topk", type=int, default=3, help="topk when a request has none, null or 0")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a request body (408 beyond)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="most queries in one search call; bigger requests are served in chunks, round-robin "
                        "with other requests (default: %(default)s)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="longest wait for concurrent requests to join a batch")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _bm25_args(p)
    _dense_args(p)
    args = p.parse_args(argv)
    if args.index is None and args.corpus is None:
        p.error("give --index DIR, or --corpus FILE (with --retriever) to serve a cached index")
    from .index import load_index
    from .server import ServerLimits, ServerProcess, serve

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"lldslight serve: warning: binding {args.host}, reachable beyond this machine; the server has no authentication",
              file=sys.stderr)
    try:
        if args.index is not None:
            runtime = ({"batch_size": args.batch_size, "device": args.device, "threads": args.threads}
                       if _kind(args.index) == "dense" else {})
            retriever: Any = load_index(args.index, corpus=args.corpus, show_progress=not args.quiet, **runtime)
        else:
            retriever = retriever_class(args.retriever, indexed=True)(corpus=args.corpus, show_progress=not args.quiet,
                                                        **_settings(args, args.retriever))
        limits = ServerLimits(max_queries=args.max_queries, max_topk=args.max_topk,
                              max_body_bytes=args.max_body_bytes, default_topk=args.default_topk,
                              body_timeout_s=args.body_timeout)

        def ready(url: str) -> None:
            n = len(retriever) if hasattr(retriever, "__len__") else "?"
            print(f"lldslight serve: {type(retriever).__name__} over {n} passages", flush=True)
            print(f"{ServerProcess.READY}{url}", flush=True)

        serve(retriever, args.host, args.port, limits, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
              log_level=args.log_level, on_ready=ready)
    except RetrievalError as e:
        print(f"lldslight serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def _kind(index_dir: str) -> str:
    from .index import IndexConfig

    return IndexConfig.read(index_dir).kind


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"index": index_main, "serve": serve_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m lldslight.retrieval.cli {index|serve} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
