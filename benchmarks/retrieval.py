"""Retrieval benchmark: index build, in-process vs server latency/throughput, batching under
concurrency, and recall@3 on HotpotQA, for BM25 and dense (MiniLM) over >= 10,000 passages.

    .venv/bin/python benchmarks/retrieval.py --json bench_retrieval.json
    .venv/bin/python benchmarks/retrieval.py --retrievers bm25 --requests 100   # quick

Corpus: HotpotQA dev-500 contexts (4931) + 2Wiki (6119) + MuSiQue (1890) + wiki-18 first 1000 from
../shared/data (13,940 passages); without shared data, a synthetic corpus of 12,000 passages.
The server runs in a child process (as in training), bound to 127.0.0.1. Every loop is bounded.

Targets checked: dense build >= 250 passages/s; 8 concurrent clients >= 2x one sequential client;
server overhead at batch 1 (server median - in-process median) <= 3 ms. The encoder alone is also
timed on corpus passages and on short sentences, with their token counts: the build rate is bounded
by the encoder's rate on the same passages, and that rate falls with tokens per passage.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lldslight.retrieval import HttpRetriever, start_server_process  # noqa: E402
from lldslight.retrieval.index import is_index_dir, load_index, retriever_class  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


# --------------------------------------------------------------------------- data


def build_corpus(path: Path, synthetic: int) -> tuple[list[str], list[dict[str, Any]], str]:
    """Write the benchmark corpus; return (queries, hotpot questions, description)."""
    rows: list[tuple[str, str]] = []
    queries: list[str] = []
    hotpot: list[dict[str, Any]] = []
    mh = SHARED / "multihop"
    if (mh / "hotpotqa_dev500_with_contexts.jsonl").is_file() and synthetic == 0:
        with open(mh / "hotpotqa_dev500_with_contexts.jsonl") as f:
            hotpot = [json.loads(line) for line in f if line.strip()]
        for q in hotpot:
            queries.append(q["question_text"])
            for i, c in enumerate(q["contexts"]):
                rows.append((f'hotpot-{q["question_id"]}-{i}', f'"{c["title"]}"\n{c["paragraph_text"]}'))
        for name in ("2wiki_corpus.json", "musique_train100_corpus.json"):
            for i, d in enumerate(json.loads((mh / name).read_text())):
                rows.append((f"{name.split('_')[0]}-{i}", f'"{d["title"]}"\n{d["text"]}'))
        queries += [q["question"] for q in json.loads((mh / "2wiki_questions1000.json").read_text())]
        with open(SHARED / "corpus" / "wiki18_first1000.jsonl") as f:
            for line in f:
                d = json.loads(line)
                rows.append((f"wiki18-{d['id']}", d["contents"]))
        desc = "shared: hotpot contexts + 2wiki + musique + wiki18[:1000]"
    else:
        rng = random.Random(0)
        vocab = [f"w{rng.randrange(10**6):06d}" for _ in range(20_000)]
        n = synthetic or 12_000
        for i in range(n):
            words = rng.choices(vocab, k=rng.randint(40, 120))
            rows.append((f"syn-{i}", f'"Topic {i}"\n' + " ".join(words)))
            if i % 10 == 0:
                queries.append(" ".join(rng.sample(words, 6)))
        desc = f"synthetic ({n} passages)"
    with open(path, "w") as f:
        for pid, contents in rows:
            f.write(json.dumps({"id": pid, "contents": contents}) + "\n")
    return queries, hotpot, desc


# --------------------------------------------------------------------------- measurement


def timed_calls(fn: Callable[[list[str]], Any], queries: list[str], batch: int, calls: int) -> dict[str, float]:
    lat: list[float] = []
    fn(queries[:batch])  # warm-up (lazy paths, connection)
    t0 = time.perf_counter()
    for c in range(calls):
        s = (c * batch) % max(1, len(queries) - batch)
        t = time.perf_counter()
        fn(queries[s : s + batch])
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    lat.sort()
    return {"batch": batch, "calls": calls, "qps": calls * batch / wall,
            "median_ms": statistics.median(lat) * 1e3, "p95_ms": lat[min(len(lat) - 1, int(0.95 * len(lat)))] * 1e3}


def concurrent_vs_sequential(url: str, queries: list[str], clients: int, per_client: int) -> dict[str, float]:
    """``clients`` threads each send ``per_client`` single-query requests back to back, against
    one client sending the same number of requests sequentially."""
    seq = HttpRetriever(url)
    seq.search(queries[:1], 3)
    n = clients * per_client
    t0 = time.perf_counter()
    for i in range(n):
        seq.search([queries[i % len(queries)]], 3)
    seq_qps = n / (time.perf_counter() - t0)

    workers = [HttpRetriever(url) for _ in range(clients)]
    for w in workers:
        w.search(queries[:1], 3)
    start = threading.Barrier(clients + 1)

    def run(ci: int) -> None:
        start.wait()
        for j in range(per_client):
            workers[ci].search([queries[(ci * per_client + j) % len(queries)]], 3)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    conc_qps = n / (time.perf_counter() - t0)
    return {"clients": clients, "requests": n, "sequential_qps": seq_qps, "concurrent_qps": conc_qps,
            "ratio": conc_qps / seq_qps}


def recall_at_3(retriever: Any, hotpot: list[dict[str, Any]]) -> float:
    res = retriever.search([q["question_text"] for q in hotpot], 3)
    found = total = 0
    for q, ps in zip(hotpot, res):
        got = {p.contents for p in ps}
        for c in q["contexts"]:
            if c["is_supporting"] in (True, "True", "true"):
                total += 1
                found += f'"{c["title"]}"\n{c["paragraph_text"]}' in got
    return found / max(total, 1)


def encoder_alone(corpus: Path, queries: list[str], n: int = 512) -> dict[str, Any]:
    """The encoder by itself (no index, no corpus reading), on n corpus passages and on n short
    sentences (the questions), with their mean token counts: what the build rate should be compared
    with, since MiniLM's cost on a CPU grows with tokens per passage."""
    from lldslight.data.formats import iter_corpus
    from lldslight.retrieval.dense import DEFAULT_ENCODER, TextEncoder

    enc = TextEncoder(DEFAULT_ENCODER, device="cpu")
    passages = [r["contents"] for _, r in zip(range(n), iter_corpus(corpus))]
    out: dict[str, Any] = {}
    for name, texts in (("passages", passages), ("sentences", queries[:n])):
        enc.encode(texts[:64])  # warm-up
        t0 = time.perf_counter()
        enc.encode(texts)
        seconds = time.perf_counter() - t0
        tokens = [len(t) for t in enc.tokenizer(texts, truncation=True, max_length=enc.max_seq_length)["input_ids"]]
        out[name] = {"n": len(texts), "per_s": len(texts) / seconds, "mean_tokens": statistics.mean(tokens)}
    return out


def bench_one(kind: str, corpus: Path, work: Path, queries: list[str], hotpot: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"device": args.device, "threads": args.threads} if kind == "dense" else {}
    out = work / f"index-{kind}"
    res: dict[str, Any] = {"retriever": kind}
    if args.reuse_index and is_index_dir(out):
        # Re-measure search on an index built by an earlier run (same --work), e.g. on a busy machine.
        r = load_index(str(out), **settings)
        res.update(passages=len(r), build_s=None, build_pps=None)
        print(f"[{kind}] reusing the index in {out}", flush=True)
    else:
        r = retriever_class(kind)(corpus=str(corpus), show_progress=not args.quiet, **settings)
        t0 = time.perf_counter()
        r.build(out)
        build_s = time.perf_counter() - t0
        res.update(passages=len(r), build_s=build_s, build_pps=len(r) / build_s)
        print(f"[{kind}] built {len(r)} passages in {build_s:.1f}s ({len(r) / build_s:.0f}/s)", flush=True)
        if kind == "dense":
            res["encoder_alone"] = encoder_alone(corpus, queries)
            print(f"[{kind}] encoder alone: {res['encoder_alone']}", flush=True)
    n = res["passages"]

    calls1 = args.requests if kind == "bm25" else max(20, args.requests // 4)
    calls64 = max(3, args.requests // 20)
    res["inproc_b1"] = timed_calls(lambda q: r.search(q, 3), queries, 1, calls1)
    res["inproc_b64"] = timed_calls(lambda q: r.search(q, 3), queries, 64, calls64)
    if hotpot:
        res["hotpot_recall@3"] = recall_at_3(r, hotpot)

    serve_args = ["--index", str(out), "--quiet"]
    if kind == "dense":
        serve_args += ["--device", args.device] + (["--threads", str(args.threads)] if args.threads else [])
    with start_server_process(serve_args, timeout=600) as server:
        client = HttpRetriever(server.url)
        res["server_b1"] = timed_calls(lambda q: client.search(q, 3), queries, 1, calls1)
        res["server_b64"] = timed_calls(lambda q: client.search(q, 3), queries, 64, calls64)
        res["concurrency"] = concurrent_vs_sequential(server.url, queries, 8, max(5, calls1 // 8))
    res["server_overhead_b1_ms"] = res["server_b1"]["median_ms"] - res["inproc_b1"]["median_ms"]
    return res


# --------------------------------------------------------------------------- report


def report(results: list[dict[str, Any]], desc: str) -> None:
    # Load average: on a shared 2-core machine other jobs move every number here.
    print(f"\ncorpus: {desc}; cpu cores: {os.cpu_count()}; load average now: {os.getloadavg()[0]:.1f}")
    head = f"{'retriever':<9} {'mode':<10} {'batch':>5} {'q/s':>9} {'median ms':>10} {'p95 ms':>9}"
    print(head)
    print("-" * len(head))
    for r in results:
        for mode in ("inproc", "server"):
            for b in (1, 64):
                m = r[f"{mode}_b{b}"]
                print(f"{r['retriever']:<9} {mode:<10} {b:>5} {m['qps']:>9.1f} {m['median_ms']:>10.2f} {m['p95_ms']:>9.2f}")
    print()
    for r in results:
        c = r["concurrency"]
        dense = r["retriever"] == "dense"
        built = r["build_pps"] is not None
        checks = [
            ("build passages/s", f"{r['build_pps']:.0f}" if built else "(index reused)", ">= 250" if dense else "-",
             (r["build_pps"] >= 250) if dense and built else None),
            ("8 concurrent / sequential", f"{c['ratio']:.2f}x ({c['concurrent_qps']:.0f} vs {c['sequential_qps']:.0f} q/s)",
             ">= 2x", c["ratio"] >= 2),
            ("server overhead @ batch 1", f"{r['server_overhead_b1_ms']:.2f} ms", "<= 3 ms", r["server_overhead_b1_ms"] <= 3),
        ]
        if "encoder_alone" in r and built:
            e = r["encoder_alone"]
            checks.append(("encoder alone, passages", f"{e['passages']['per_s']:.0f}/s at {e['passages']['mean_tokens']:.0f} tokens",
                           "-", None))
            checks.append(("encoder alone, sentences", f"{e['sentences']['per_s']:.0f}/s at {e['sentences']['mean_tokens']:.0f} tokens",
                           "-", None))
            ratio = r["build_pps"] / e["passages"]["per_s"]
            checks.append(("build / encoder alone", f"{ratio:.2f}x (same passages)", ">= 0.9x", ratio >= 0.9))
        if "hotpot_recall@3" in r:
            checks.append(("HotpotQA recall@3 (500 q)", f"{r['hotpot_recall@3']:.3f}", "-", None))
        print(f"[{r['retriever']}] {r['passages']} passages" + (f", built in {r['build_s']:.1f}s" if built else ""))
        for name, value, target, ok in checks:
            flag = "" if ok is None else ("  ok" if ok else "  MISSED")
            print(f"  {name:<28} {value:<34} target {target}{flag}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--retrievers", default="bm25,dense")
    p.add_argument("--requests", type=int, default=200, help="batch-1 requests per measurement (bounded loops)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads for dense (in-process and server)")
    p.add_argument("--synthetic", type=int, default=0, help="use a synthetic corpus of N passages")
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--reuse-index", action="store_true", help="reuse indexes left in --work by an earlier run")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="lldslight-bench-")
    work = Path(args.work or tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    if args.reuse_index and corpus.is_file():
        # Rewriting the corpus would change its fingerprint and invalidate the reused indexes.
        queries, hotpot, desc = build_corpus(work / "corpus.check.jsonl", args.synthetic)
        (work / "corpus.check.jsonl").unlink()
    else:
        queries, hotpot, desc = build_corpus(corpus, args.synthetic)
    random.Random(1).shuffle(queries)
    results = []
    for kind in [k.strip() for k in args.retrievers.split(",") if k.strip()]:
        load_before = os.getloadavg()[0]
        results.append(bench_one(kind, corpus, work, queries, hotpot, args))
        results[-1]["loadavg_1min"] = [load_before, os.getloadavg()[0]]
    report(results, desc)
    if args.json:
        Path(args.json).write_text(json.dumps({"corpus": desc, "cpu_count": os.cpu_count(), "results": results}, indent=2))
        print(f"\nwrote {args.json}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
