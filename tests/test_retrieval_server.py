"""The Search-R1-compatible server and the HttpRetriever client, on real sockets (127.0.0.1)."""
import json
import threading
import time
import urllib.error
import urllib.request

import httpx
import pytest

from lldslight.retrieval import (
    UNAVAILABLE,
    BM25Retriever,
    HttpRetriever,
    Passage,
    RetrievalError,
    ServerLimits,
    start_server,
    start_server_process,
)
from lldslight.retrieval.cli import index_main

FACTS = [
    ("Paris", "Paris is the capital and most populous city of France."),
    ("Berlin", "Berlin is the capital of Germany and its largest city."),
    ("Tokyo", "Tokyo is the capital of Japan."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    ("Amazon River", "The Amazon is the largest river in South America by discharge."),
    ("Jupiter", "Jupiter is the largest planet in the Solar System."),
]


def write_corpus(path):
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"{t}"\n{x}'}) + "\n"
                            for i, (t, x) in enumerate(FACTS)))
    return path


def post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("srv") / "c.jsonl")


@pytest.fixture(scope="module")
def server(corpus):
    limits = ServerLimits(max_queries=8, max_topk=5, max_body_bytes=4096)
    with start_server(BM25Retriever(str(corpus), show_progress=False), limits=limits) as h:
        yield h


def test_search_r1_shape_with_scores(server):
    status, body = post(server.url, {"queries": ["capital of Japan", "highest mountain"], "topk": 2, "return_scores": True})
    assert status == 200 and list(body) == ["result"] and len(body["result"]) == 2
    first = body["result"][0][0]
    assert set(first) == {"document", "score"} and isinstance(first["score"], float)
    assert first["document"] == {"id": "d2", "contents": '"Tokyo"\nTokyo is the capital of Japan.'}
    assert body["result"][1][0]["document"]["id"] == "d3"
    assert all(len(r) <= 2 for r in body["result"])


def test_search_r1_shape_without_scores_and_single_query(server):
    status, body = post(server.url, {"queries": ["capital of Japan"], "topk": 1})
    assert status == 200 and body == {"result": [[{"id": "d2", "contents": '"Tokyo"\nTokyo is the capital of Japan.'}]]}
    status, body = post(server.url, {"query": "largest planet", "topk": 1})
    assert status == 200 and body["result"][0][0]["id"] == "d5"
    status, body = post(server.url, {"queries": ["river"]})  # no topk: the default (3) applies
    assert status == 200 and body["result"][0][0]["id"] == "d4"
    status, body = post(server.url, {"queries": []})
    assert status == 200 and body == {"result": []}


def test_response_bytes_match_fastapi_json(server):
    # Search-R1's server returns a dict through FastAPI: compact separators, non-ASCII kept.
    r = httpx.post(server.url, json={"queries": ["capital of Germany"], "topk": 1})
    assert r.headers["content-type"] == "application/json"
    assert r.content == b'{"result":[[{"id":"d1","contents":"\\"Berlin\\"\\nBerlin is the capital of Germany and its largest city."}]]}'


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "malformed JSON"),
        (b'["a"]', 422, "JSON object"),
        ({"topk": 3}, 422, "missing field 'queries'"),
        ({"queries": "one string"}, 422, "'queries' must be a list"),
        ({"queries": ["ok", 7]}, 422, "'queries[1]' must be a string"),
        ({"query": 5}, 422, "'query' must be a string"),
        ({"queries": ["a"], "query": "b"}, 422, "not both"),
        ({"queries": ["a"], "topk": "3"}, 422, "'topk' must be an integer"),
        ({"queries": ["a"], "topk": 0}, 422, "between 1 and max_topk=5"),
        ({"queries": ["a"], "topk": 6}, 422, "between 1 and max_topk=5"),
        ({"queries": ["a"], "return_scores": "yes"}, 422, "'return_scores' must be a boolean"),
        ({"queries": ["q"] * 9}, 413, "max_queries=8"),
        ({"queries": ["x" * 5000]}, 413, "max_body_bytes=4096"),
    ],
)
def test_bad_requests_get_4xx_with_a_message(server, body, status, words):
    got, payload = post(server.url, body, raw=isinstance(body, bytes))
    assert got == status and words in payload["detail"]


def test_health(server):
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["passages"] == len(FACTS)


def test_http_retriever_against_our_server(server):
    client = HttpRetriever(server.url, batch_size=3)
    queries = ["capital of France", "capital of Germany", "capital of Japan", "highest mountain", "river", "planet", "qqqzz"]
    res = client.search(queries, 1)  # 7 queries, 3 per request: the batch is split and reassembled
    assert [ps[0].id if ps else None for ps in res] == ["d0", "d1", "d2", "d3", "d4", "d5", None]
    assert isinstance(res[0][0], Passage) and res[0][0].title == "Paris" and res[0][0].score > 0
    with pytest.raises(RetrievalError, match="HTTP 422"):
        client.search(["a"], 50)  # a refused request is a bug: raised, never retried or hidden


def test_concurrent_requests_are_batched(corpus):
    class Slow(BM25Retriever):
        calls = []

        def search(self, queries, k):
            Slow.calls.append(len(queries))
            time.sleep(0.05)  # long enough for the other requests to queue up behind the first
            return super().search(queries, k)

    with start_server(Slow(str(corpus), show_progress=False)) as h:
        results = {}

        def one(i):
            results[i] = HttpRetriever(h.url).search([FACTS[i % len(FACTS)][0]], 1)[0][0].id

        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {i: f"d{i % len(FACTS)}" for i in range(12)}  # each answer went back to its asker
        assert sum(Slow.calls) == 12 and len(Slow.calls) < 12


def test_server_stopped_mid_run(corpus):
    h = start_server(BM25Retriever(str(corpus), show_progress=False))
    fail = HttpRetriever(h.url, retries=2, backoff=0.01, on_unavailable="fail")
    observe = HttpRetriever(h.url, retries=2, backoff=0.01, on_unavailable="observe")
    assert fail.search(["Tokyo"], 1)[0][0].id == "d2" and observe.search(["Tokyo"], 1)[0][0].id == "d2"
    h.stop()
    with pytest.raises(RetrievalError) as e:
        fail.search(["Tokyo"], 1)
    assert h.url in str(e.value) and "unavailable after 3 attempts" in str(e.value) and "Connect" in str(e.value)
    assert observe.search(["Tokyo", "Paris"], 3) == [[UNAVAILABLE], [UNAVAILABLE]]
    assert observe.unavailable_count == 2
    assert UNAVAILABLE.title == "Search unavailable"


def test_malformed_server_answers_are_named(tmp_path):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    import uvicorn
    import socket

    answers = {"/none": {"data": []}, "/short": {"result": []}, "/nocontents": {"result": [[{"document": {"id": 1}}]]},
               "/badscore": {"result": [[{"document": {"id": 1, "contents": "x"}, "score": "high"}]]}}
    app = FastAPI()
    for path, answer in answers.items():
        app.add_api_route(path, (lambda a: (lambda: JSONResponse(a)))(answer), methods=["POST"])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        base = f"http://127.0.0.1:{port}"
        expect = {"/none": "no 'result' field", "/short": "should hold 1 lists",
                  "/nocontents": r"result\[0\]\[0\]\.document has no 'contents'", "/badscore": "score should be a number"}
        for path, msg in expect.items():
            with pytest.raises(RetrievalError, match=msg):
                HttpRetriever(base + path, on_unavailable="observe").search(["q"], 3)
    finally:
        srv.should_exit = True
        t.join(10)


def test_serve_main_in_a_subprocess(tmp_path, corpus):
    out = tmp_path / "idx"
    assert index_main(["--corpus", str(corpus), "--out", str(out), "--quiet"]) == 0
    with start_server_process(["--index", str(out), "--max-topk", "4"], timeout=120) as proc:
        assert proc.url.startswith("http://127.0.0.1:")
        assert HttpRetriever(proc.url).search(["capital of France"], 1)[0][0].id == "d0"
        assert post(proc.url, {"queries": ["a"], "topk": 5})[0] == 422
    assert proc.proc.poll() is not None
