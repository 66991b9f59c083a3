"""``lldslight index`` and ``lldslight serve`` (also ``python -m lldslight.retrieval.cli index|serve``)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence

from lldslight.errors import ArgumentParser, ConfigError, UserError, require

from .base import retriever_class, retriever_names

# Index-time settings (what the index's contents depend on, or how its queries must be encoded):
# the flag's dest -> (index kind, key in lldslight_index.json's settings / query_settings).
_INDEX_SETTINGS = {
    "encoder": ("dense", "encoder"), "pooling": ("dense", "pooling"), "normalize": ("dense", "normalize"),
    "query_prefix": ("dense", "query_prefix"), "passage_prefix": ("dense", "passage_prefix"),
    "max_seq_length": ("dense", "max_seq_length"), "index_type": ("dense", "index_type"), "hnsw_m": ("dense", "hnsw_m"),
    "k1": ("bm25", "k1"), "b": ("bm25", "b"), "method": ("bm25", "method"), "stemmer": ("bm25", "stemmer"),
    "stopwords": ("bm25", "stopwords"),
}


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: an integer in 0..65535 (0 picks a free port)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in 0..65535 (0 picks a free port), got {port}")
    return port


def _given(p: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests of the options written on the command line (abbreviated or not), not left at
    their defaults: ``argv`` parsed again with every default replaced by a marker."""
    unset = object()
    saved = {id(a): a.default for a in p._actions}
    try:
        for a in p._actions:
            a.default = unset
        parsed = vars(p.parse_args(list(argv)))
    finally:
        for a in p._actions:
            a.default = saved[id(a)]
    return {dest for dest, value in parsed.items() if value is not unset}


def _check_against_index(index_dir: str, args: argparse.Namespace, given: set[str]) -> None:
    """An index is searched with the settings that built it: a flag that says otherwise (``--encoder X``
    on an index built with Y) is an error, never silently ignored."""
    from .index import IndexConfig

    cfg = IndexConfig.read(index_dir)
    if "retriever" in given and args.retriever != cfg.kind:
        raise ConfigError(f"--retriever {args.retriever}: the index {index_dir} is a {cfg.kind} index "
                          "(drop --retriever; an --index is served as it was built)")
    recorded = {**cfg.settings, **cfg.query_settings}
    wanted = _settings(args, cfg.kind)
    for dest in sorted(given & set(_INDEX_SETTINGS)):
        kind, key = _INDEX_SETTINGS[dest]
        flag = "--" + ("no-normalize" if dest == "normalize" else dest.replace("_", "-"))
        if kind != cfg.kind:
            raise ConfigError(f"{flag} is a {kind} setting, and the index {index_dir} is a {cfg.kind} index")
        if key in recorded and recorded[key] != wanted[key]:
            raise ConfigError(
                f"{flag} {wanted[key]!r}: the index {index_dir} was built with {key}={recorded[key]!r}, and an index "
                f"is searched with the settings that built it; drop {flag}, or build another index with it "
                f"(lldslight index --corpus CORPUS --retriever {cfg.kind} {flag} ... --out DIR)")


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
    p.add_argument("--force", action="store_true", help="replace an index already in --out (never done without it)")
    _bm25_args(p)
    _dense_args(p)
    args = p.parse_args(argv)
    try:
        r = retriever_class(args.retriever, indexed=True)(corpus=args.corpus, show_progress=not args.quiet,
                                            **_settings(args, args.retriever))
        t0 = time.perf_counter()
        out = r.build(args.out, force=args.force)
        dt = time.perf_counter() - t0
        n = len(r)
    except UserError as e:
        print(f"lldslight index: error: {e}", file=sys.stderr)
        return 2
    print(f"lldslight index: {args.retriever} index of {n} passages written to {out} "
          f"in {dt:.1f}s ({n / max(dt, 1e-9):.0f} passages/s)")
    return 0


def serve_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lldslight serve --index DIR [--corpus FILE] --host 127.0.0.1 --port 8000 [limits]``.

    Without ``--index``, ``--corpus`` and ``--retriever`` build (or reuse) a cached index. With
    ``--index``, a build setting given on the command line must be the index's own.
    """
    from .server import ServerLimits, ServerProcess, serve

    p = ArgumentParser(prog="lldslight serve",
                                description="Serve a retrieval index over HTTP, Search-R1 compatible (POST /retrieve).")
    p.add_argument("--index", default=None, help="index directory from `lldslight index`")
    p.add_argument("--corpus", default=None, help="corpus path (overrides the index's; must be the same file)")
    p.add_argument("--retriever", choices=retriever_names(indexed=True), default="bm25", help="without --index: kind to build")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    p.add_argument("--max-queries", type=int, default=512, help="queries per request")
    p.add_argument("--max-topk", type=int, default=100)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--default-topk", type=int, default=3, help="topk when a request has none, null or 0")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a request body (408 beyond)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to complete a request's headers; it is closed beyond (slowloris)")
    p.add_argument("--max-inflight-passages", type=int, default=ServerLimits.max_inflight_passages,
                   help="most passages (queries x topk) being searched and answered at once over all requests; "
                        "further requests wait their turn (bounds the server's memory) (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="most queries in one search call; bigger requests are served in chunks, round-robin "
                        "with other requests (default: %(default)s)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="longest wait for concurrent requests to join a batch")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _bm25_args(p)
    _dense_args(p)
    args = p.parse_args(argv)
    given = _given(p, list(argv if argv is not None else sys.argv[1:]))
    if args.index is None and args.corpus is None:
        p.error("give --index DIR, or --corpus FILE (with --retriever) to serve a cached index")
    from .index import load_index

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"lldslight serve: warning: binding {args.host}, reachable beyond this machine; the server has no authentication",
              file=sys.stderr)
    try:
        limits = ServerLimits(max_queries=args.max_queries, max_topk=args.max_topk,
                              max_body_bytes=args.max_body_bytes, default_topk=args.default_topk,
                              body_timeout_s=args.body_timeout, header_timeout_s=args.header_timeout,
                              max_inflight_passages=args.max_inflight_passages)
        require(args.max_batch >= 1, "--max-batch", ">= 1", args.max_batch)
        require(args.max_wait_ms >= 0, "--max-wait-ms", ">= 0", args.max_wait_ms)
        if args.index is not None:
            _check_against_index(args.index, args, given)
            runtime = ({"batch_size": args.batch_size, "device": args.device, "threads": args.threads}
                       if _kind(args.index) == "dense" else {})
            retriever: Any = load_index(args.index, corpus=args.corpus, show_progress=not args.quiet, **runtime)
        else:
            retriever = retriever_class(args.retriever, indexed=True)(corpus=args.corpus, show_progress=not args.quiet,
                                                        **_settings(args, args.retriever))

        def ready(url: str) -> None:
            n = len(retriever) if hasattr(retriever, "__len__") else "?"
            print(f"lldslight serve: {type(retriever).__name__} over {n} passages", flush=True)
            print(f"{ServerProcess.READY}{url}", flush=True)

        serve(retriever, args.host, args.port, limits, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
              log_level=args.log_level, on_ready=ready)
    except UserError as e:
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
