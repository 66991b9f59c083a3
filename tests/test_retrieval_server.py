"""The Search-R1-compatible server and the HttpRetriever client, on real sockets (127.0.0.1)."""
import json
import re
import socket
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
        ({"queries": ["a"], "topk": -1}, 422, "between 1 and max_topk=5 (0 or null: the default, 3), got -1"),
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
                HttpRetriever(base + path, on_unavailable="fail").search(["q"], 3)
            # "observe" rides it out as a failed attempt (issue 23): the run goes on, the reason is logged.
            observe = HttpRetriever(base + path, on_unavailable="observe", retries=0)
            assert observe.search(["q"], 3) == [[UNAVAILABLE]] and observe.unavailable_count == 1
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


# ----------------------------------------------------------------------------- topk as Search-R1 reads it


@pytest.mark.parametrize("topk", [0, None])
def test_topk_zero_or_null_means_the_default(server, corpus, topk):
    # Search-R1's server: `if not request.topk: request.topk = config.retrieval_topk`.
    status, body = post(server.url, {"queries": ["capital city"], "topk": topk})
    expected = BM25Retriever(str(corpus), show_progress=False).search(["capital city"], 3)[0]
    assert status == 200 and len(expected) == 3
    assert [d["id"] for d in body["result"][0]] == [p.id for p in expected]


# ----------------------------------------------------------------------------- abuse, on raw sockets


def send_raw(port, data, *, close=False):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(data)
    if close:
        sock.close()
        return None
    return sock


def http_post_bytes(body, content_length=None):
    n = len(body) if content_length is None else content_length
    head = f"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    return head.encode() + body


def read_response(sock, timeout):
    """(status, headers, body) of one response, read until the server closes or the body is complete."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


@pytest.fixture(scope="module")
def abuse_server(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("abuse") / "idx"
    assert index_main(["--corpus", str(corpus), "--out", str(out), "--quiet"]) == 0
    with start_server_process(["--index", str(out), "--body-timeout", "1", "--log-level", "info"], timeout=120) as proc:
        yield proc


def port_of(proc):
    return int(re.search(r":(\d+)/retrieve", proc.url).group(1))


def wait_for_log(proc, pattern, count, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = [line for line in proc.log if re.search(pattern, line)]
        if len(hits) >= count:
            return hits
        time.sleep(0.05)
    return [line for line in proc.log if re.search(pattern, line)]


def test_deeply_nested_json_is_a_400_not_a_traceback(abuse_server):
    for body in (b"[" * 100_000, b'{"queries": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        sock = send_raw(port_of(abuse_server), http_post_bytes(body))
        status, _, payload = read_response(sock, 30)
        sock.close()
        assert status == 400 and json.loads(payload) == {"detail": "malformed JSON body: nested too deeply to parse"}
    assert HttpRetriever(abuse_server.url).search(["capital of Japan"], 1)[0][0].id == "d2"  # still serving
    assert not any("Traceback" in line or "Exception in ASGI" in line for line in abuse_server.log)


def test_client_gone_mid_body_is_one_log_line(abuse_server):
    before = len(abuse_server.log)
    for _ in range(3):
        send_raw(port_of(abuse_server), http_post_bytes(b'{"queries": ["cap', content_length=200), close=True)
    hits = wait_for_log(abuse_server, r"disconnected before sending its whole request", 3)
    time.sleep(0.3)  # anything else the server would write about these requests
    assert len(hits) == 3
    new = abuse_server.log[before:]
    assert len(new) == 3 and all(re.match(r"WARNING: +retrieval: 127\.0\.0\.1:\d+ disconnected", line) for line in new), new


def test_half_sent_body_times_out_with_408(abuse_server):
    sock = send_raw(port_of(abuse_server), http_post_bytes(b'{"queries": ["cap', content_length=200))
    t0 = time.monotonic()
    status, headers, payload = read_response(sock, 15)  # the old server held it forever
    waited = time.monotonic() - t0
    assert status == 408 and headers.get("connection") == "close"
    assert json.loads(payload) == {"detail": "request body not received within body_timeout_s=1s"}
    assert 0.9 <= waited < 10
    assert sock.recv(1) == b""  # and closed the connection
    sock.close()
    assert wait_for_log(abuse_server, r"sent no complete body within body_timeout_s=1s; answered 408", 1)
    assert HttpRetriever(abuse_server.url).search(["capital of Japan"], 1)[0][0].id == "d2"


# ----------------------------------------------------------------------------- fairness


class SlowBM25(BM25Retriever):
    """Real BM25, plus 4 ms per query: a stand-in for an encoder whose cost grows with the batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []
        self.first_call = threading.Event()

    def search(self, queries, k):
        self.calls.append(len(queries))
        self.first_call.set()
        time.sleep(0.004 * len(queries))
        return super().search(queries, k)


def test_a_small_request_is_not_stuck_behind_a_big_one(corpus):
    retriever = SlowBM25(str(corpus), show_progress=False)
    words = ["capital", "largest", "river", "mountain", "planet", "city", "Japan", "France"]
    big = [f"{words[i % 8]} {words[(i // 8) % 8]}" for i in range(512)]
    done = {}
    with start_server(retriever, max_batch=32) as h:
        def run(name, queries):
            done[name] = (HttpRetriever(h.url, timeout=60, batch_size=512).search(queries, 2), time.monotonic())

        t_big = threading.Thread(target=run, args=("big", big))
        t0 = time.monotonic()
        t_big.start()
        assert retriever.first_call.wait(30)
        t1 = time.monotonic()
        run("small", ["highest mountain"])
        t_big.join(60)
    small_latency, big_latency = done["small"][1] - t1, done["big"][1] - t0
    assert done["small"][1] < done["big"][1]
    assert big_latency > 2.0 and small_latency < big_latency / 3, (small_latency, big_latency)
    assert max(retriever.calls) <= 32 and sum(retriever.calls) == 513
    assert done["small"][0][0][0].id == "d3"
    # Served in 16+ chunks, the big request's answers are still the right ones, in order.
    plain = BM25Retriever(str(corpus), show_progress=False).search(big, 2)
    assert [[p.id for p in ps] for ps in done["big"][0]] == [[p.id for p in ps] for ps in plain]
