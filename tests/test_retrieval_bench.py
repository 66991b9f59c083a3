"""benchmarks/retrieval.py: its side-by-side timing, its FLOP arithmetic, and a small end-to-end
run (BM25 over a synthetic corpus, the server in a child process) writing the JSON it documents."""
import json

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("retrieval")


def test_side_by_side_gives_every_mode_the_same_queries_in_alternating_blocks(bench):
    calls = []
    modes = {m: (lambda q, m=m: calls.append((m, tuple(q)))) for m in ("a", "b")}
    queries = [f"q{i}" for i in range(50)]
    out = bench.side_by_side(modes, queries, batch=2, calls=6, rounds=3)
    assert [out[m]["calls"] for m in "ab"] == [6, 6]
    # Per round: an untimed call, then 2 timed ones, for a and then for b, on the same queries.
    assert [m for m, _ in calls] == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    for r in range(3):
        block_a, block_b = calls[6 * r : 6 * r + 3], calls[6 * r + 3 : 6 * r + 6]
        assert [q for _, q in block_a] == [q for _, q in block_b]
        assert all(len(q) == 2 for _, q in block_a)
    assert out["a"]["qps"] > 0 and out["a"]["median_ms"] <= out["a"]["p95_ms"]


def test_flop_per_token_counts_encoder_linears_and_attention(bench):
    from lldslight.retrieval.dense import DEFAULT_ENCODER, TextEncoder

    model = TextEncoder(DEFAULT_ENCODER, device="cpu").model
    h, ffn, layers = 384, 1536, 6  # all-MiniLM-L6-v2
    linear = layers * (4 * h * h + 2 * h * ffn)  # q, k, v, o and the two FFN matrices; no pooler
    assert bench.flop_per_token(model, 0) == 2 * linear
    assert bench.flop_per_token(model, 100) == 2 * linear + 4 * 100 * h * layers


def test_small_bm25_run_writes_the_documented_json(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--synthetic", "400", "--retrievers", "bm25", "--requests", "16", "--rounds", "2", "--no-repeat",
                       "--work", str(tmp_path / "work"), "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())["results"][0]
    assert res["retriever"] == "bm25" and res["passages"] == 400 and res["build_pps"] > 0
    for key in ("inproc_b1", "inproc_b8", "inproc_b64", "server_b1", "server_b64"):
        assert res[key]["qps"] > 0 and res[key]["calls"] >= 2, key
        assert res[key]["busy_blocks"] in (0, 1, 2) and res[key]["max_other_cores"] >= 0, key  # load recorded per block
    c = res["concurrency"]
    assert len(c["ratios"]) == 2 and c["concurrent_qps"] > 0 and c["sequential_qps"] > 0
    assert 1.0 <= c["queries_per_search"] <= 8.0  # the server's own counters, 8 one-query clients
    assert res["server_overhead_b1_ms"] == pytest.approx(res["server_b1"]["median_ms"] - res["inproc_b1"]["median_ms"])
    printed = capsys.readouterr().out
    assert "server overhead @ batch 1" in printed and "queries per search call" in printed
