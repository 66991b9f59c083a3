"""Faults and abuse, on real sockets (issue 23): the observe-mode circuit breaker against a hung
server, malformed answers, the server's content-type rule, header deadline, clients that hang up,
its passage budget, and serve/index refusing what would be ignored or overwritten."""
from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from lldslight.retrieval import UNAVAILABLE, BM25Retriever, HttpRetriever, RetrievalError, ServerLimits, start_server
from lldslight.retrieval.cli import index_main, serve_main
from lldslight.retrieval.index import CONFIG_NAME, IndexConfig

WORDS = ["capital", "largest", "river", "mountain", "planet", "city", "Japan", "France", "ocean", "desert"]


def write_corpus(path, n=200):
    """n passages, each with a few of WORDS, so a topk of 10 or more always has answers."""
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"Doc {i}"\n' + " ".join(
        WORDS[(i * j) % len(WORDS)] for j in range(1, 8)) + f" number {i}."}) + "\n" for i in range(n)))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("faults") / "c.jsonl")


def silent_socket():
    """A port that accepts connections and never answers: a hung retrieval server."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s, f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lines(logging.Handler):
    """The messages of one logger, attached to it directly (uvicorn's logging config stops them
    from propagating to pytest's root handler)."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.logger = logging.getLogger(name)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


# ----------------------------------------------------------------------------- client: circuit breaker


def test_a_hung_server_opens_the_circuit_and_searches_answer_at_once(caplog):
    caplog.set_level(logging.WARNING, logger="lldslight.retrieval.http")
    sock, url = silent_socket()
    try:
        r = HttpRetriever(url, timeout=0.4, retries=2, backoff=0.01, on_unavailable="observe",
                          breaker_failures=3, breaker_cooldown=1.5)
        got, first = timed(r.search, ["a", "b"], 2)
        assert got == [[UNAVAILABLE], [UNAVAILABLE]]
        assert 3 * 0.4 <= first < 3 * 0.4 + 1.0, first  # the full retry cycle, once
        assert r.breaker_open and r.breaker_opened == 1
        t0 = time.monotonic()
        for _ in range(20):  # the old client waited 1.2 s more for each of these
            assert r.search(["c"], 2) == [[UNAVAILABLE]]
        assert time.monotonic() - t0 < 1.0  # (bounds loose for a loaded machine; the old client: 24 s)
        assert r.unavailable_count == 22 and r.short_circuited_count == 20
        time.sleep(1.5)  # the cooldown: the next call probes with one attempt, and fails
        got, probe = timed(r.search, ["d"], 2)
        assert got == [[UNAVAILABLE]] and 0.4 <= probe < 0.4 + 1.0, probe
        assert r.breaker_open and r.breaker_opened == 1 and r.short_circuited_count == 20
        assert timed(r.search, ["e"], 2)[1] < 0.2  # open again
    finally:
        sock.close()
    messages = [rec.getMessage() for rec in caplog.records]
    opened = [m for m in messages if "circuit open:" in m]
    again = [m for m in messages if "the probe failed" in m and "circuit open again" in m]
    assert len(opened) == 1 and "3 failed attempts in a row" in opened[0] and url in opened[0], messages
    assert len(again) == 1, messages


def test_the_circuit_closes_when_the_server_answers_again(corpus, caplog):
    caplog.set_level(logging.WARNING, logger="lldslight.retrieval.http")
    port = free_port()
    bm25 = BM25Retriever(str(corpus), show_progress=False).load()
    r = HttpRetriever(f"http://127.0.0.1:{port}/retrieve", timeout=2, retries=1, backoff=0.01,
                      on_unavailable="observe", breaker_failures=2, breaker_cooldown=5.0)
    assert r.search(["capital"], 1) == [[UNAVAILABLE]] and r.breaker_open  # nothing listens yet
    opened = time.monotonic()
    with start_server(bm25, port=port):
        assert time.monotonic() - opened < 4.0, "the server took too long to start for this test's timing"
        assert r.search(["capital"], 1) == [[UNAVAILABLE]]  # still open: no request sent
        time.sleep(max(0.0, 5.0 - (time.monotonic() - opened)))
        hits = r.search(["capital"], 1)
        assert hits[0][0].id.startswith("d") and not r.breaker_open
        assert r.search(["river"], 2)[0][0] is not UNAVAILABLE
    assert r.short_circuited_count == 1
    closed = [m for m in (rec.getMessage() for rec in caplog.records) if "circuit closed" in m]
    assert len(closed) == 1 and "1 queries were answered 'unavailable'" in closed[0]


def test_fail_mode_keeps_its_retry_cycle(corpus):
    """The breaker is for observe mode: in fail mode the first outage ends the run anyway."""
    sock, url = silent_socket()
    try:
        r = HttpRetriever(url, timeout=0.3, retries=1, backoff=0.01, on_unavailable="fail")
        with pytest.raises(RetrievalError, match="unavailable after 2 attempts"):
            r.search(["a"], 1)
        assert not r.breaker_open
    finally:
        sock.close()


@pytest.fixture
def odd_server():
    """A real uvicorn app that answers /html with a 200 HTML page (a proxy's error page) and /500
    with HTTP 500."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, PlainTextResponse

    app = FastAPI()
    app.add_api_route("/html", lambda: HTMLResponse("<html><body>502 Bad Gateway</body></html>"), methods=["POST"])
    app.add_api_route("/500", lambda: PlainTextResponse("index not loaded", status_code=500), methods=["POST"])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    t.join(10)


def test_an_html_answer_is_a_failure_in_observe_mode_not_a_crash(odd_server):
    observe = HttpRetriever(odd_server + "/html", retries=1, backoff=0.01, on_unavailable="observe")
    assert observe.search(["q1", "q2"], 3) == [[UNAVAILABLE], [UNAVAILABLE]]
    assert observe.unavailable_count == 2
    with pytest.raises(RetrievalError, match=r"answered with non-JSON: '<html><body>502 Bad Gateway"):
        HttpRetriever(odd_server + "/html", on_unavailable="fail").search(["q"], 3)


def test_the_preflight_probe_says_a_failing_server_answered(odd_server):
    with pytest.raises(RetrievalError) as e:
        HttpRetriever(odd_server + "/500", retries=1, backoff=0.01, on_unavailable="observe").probe(3)
    msg = str(e.value)
    assert "answered but failed 2 attempts" in msg and "HTTP 500: index not loaded" in msg
    assert "unreachable" not in msg and "start it" not in msg


# ----------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(corpus):
    limits = ServerLimits(header_timeout_s=1.0, body_timeout_s=5.0)
    with start_server(BM25Retriever(str(corpus), show_progress=False), limits=limits) as h:
        yield h


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_searched(server, content_type):
    """A web page can POST text/plain (or a form) to a loopback server without a CORS preflight."""
    headers = {"Content-Type": content_type} if content_type else {}
    before = httpx.get(server.base_url + "/health").json()["queries"]
    content = json.dumps({"queries": ["capital"], "topk": 1}).encode()
    with httpx.Client() as c:
        req = c.build_request("POST", server.url, content=content, headers=headers)
        assert req.headers.get("Content-Type") == content_type
        resp = c.send(req)
    assert resp.status_code == 415
    assert resp.json()["detail"].startswith("Content-Type must be application/json, got ")
    assert httpx.get(server.base_url + "/health").json()["queries"] == before  # nothing was searched
    ok = httpx.post(server.url, content=content, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and len(ok.json()["result"][0]) == 1


@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "one_byte_at_a_time"])
def test_a_connection_that_never_completes_its_headers_is_closed(server, trickle):
    with Lines("uvicorn.error") as log:
        closed_after = slow_headers(server.port, trickle)
    assert closed_after is not None and 0.9 <= closed_after < 2.5, closed_after
    assert any("sent no complete request headers within header_timeout_s=1s; connection closed" in m for m in log.messages)
    # a normal client on a kept-alive connection is not cut off between its requests
    with httpx.Client() as c:
        for _ in range(3):
            assert c.post(server.url, json={"queries": ["river"], "topk": 1}).status_code == 200
            time.sleep(0.3)


def slow_headers(port: int, trickle: bool):
    """Seconds until the server closed a connection whose headers never end (None: still open at 6 s)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.1)
    head = b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 100
    t0, closed_after = time.monotonic(), None
    i = 0
    while time.monotonic() - t0 < 6:
        if trickle and i < len(head):
            try:
                sock.sendall(head[i:i + 1])  # every 0.1 s: uvicorn's keep-alive timer restarts at each byte
            except OSError:
                closed_after = time.monotonic() - t0
                break
            i += 1
        try:
            if sock.recv(1) == b"":
                closed_after = time.monotonic() - t0
                break
        except socket.timeout:
            continue
        except OSError:
            closed_after = time.monotonic() - t0
            break
    sock.close()
    return closed_after


class SlowBM25(BM25Retriever):
    """Real BM25, plus 20 ms per query: a stand-in for an encoder, so requests stay in flight."""

    def __init__(self, *args, delay=0.02, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.calls: list[int] = []
        self.first_call = threading.Event()

    def search(self, queries, k):
        self.calls.append(len(queries))
        self.first_call.set()
        time.sleep(self.delay * len(queries))
        return super().search(queries, k)


def test_a_client_that_hangs_up_has_the_rest_of_its_queries_dropped(corpus):
    retriever = SlowBM25(str(corpus), show_progress=False)
    queries = [f"{WORDS[i % 10]} {WORDS[(i // 10) % 10]}" for i in range(256)]  # 256 x 20 ms = 5 s of work
    body = json.dumps({"queries": queries, "topk": 5}).encode()
    with start_server(retriever, max_batch=16) as h, Lines("uvicorn.error") as log:
        sock = socket.create_connection(("127.0.0.1", h.port))
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert retriever.first_call.wait(10)
        sock.close()  # gone after its first chunk of 16
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and httpx.get(h.base_url + "/health").json()["abandoned_queries"] == 0:
            time.sleep(0.05)
        time.sleep(0.5)  # any further search call would start now
        health = httpx.get(h.base_url + "/health").json()
        # and the server still serves
        assert httpx.post(h.url, json={"queries": ["ocean"], "topk": 1}).status_code == 200
    assert health["abandoned_requests"] == 1 and health["abandoned_queries"] == 256
    assert sum(retriever.calls[:-1]) <= 32, retriever.calls  # the chunk in flight, maybe the next; not 256
    assert health["inflight_passages"] == 0
    assert sum(bool(re.search(r"hung up before its answer; its 256 queries were dropped", m)) for m in log.messages) == 1


def test_concurrent_big_requests_stay_within_the_passage_budget(corpus):
    """10 requests of 50 queries x topk 10 (500 passages each) at once, with room for 1000 passages:
    at most two are searched and answered at a time, and every answer is the right one."""
    retriever = SlowBM25(str(corpus), show_progress=False, delay=0.002)
    limits = ServerLimits(max_topk=20, max_inflight_passages=1000)
    requests = [[f"{WORDS[(i + j) % 10]} number {j}" for j in range(50)] for i in range(10)]
    answers: dict[int, list] = {}
    with start_server(retriever, limits=limits, max_batch=64) as h:
        def run(i):
            answers[i] = HttpRetriever(h.url, timeout=60, batch_size=512).search(requests[i], 10)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        health = httpx.get(h.base_url + "/health").json()
    assert health["peak_inflight_passages"] == 1000 and health["max_inflight_passages"] == 1000
    assert health["inflight_passages"] == 0
    plain = BM25Retriever(str(corpus), show_progress=False)
    for i in range(10):
        assert [[p.id for p in ps] for ps in answers[i]] == [[p.id for p in ps] for ps in plain.search(requests[i], 10)]
    # a request bigger than the whole budget is served alone, not refused or stuck
    with start_server(plain, limits=ServerLimits(max_topk=20, max_inflight_passages=100)) as h:
        assert len(HttpRetriever(h.url).search(requests[0], 10)) == 50


# ----------------------------------------------------------------------------- serve / index refuse


def one_line(capsys, code, command, *needles):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"lldslight {command}: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("ix") / "bm25"
    assert index_main(["--corpus", str(corpus), "--out", str(out), "--quiet", "--k1", "1.2"]) == 0
    return out


def test_serve_refuses_a_build_setting_the_index_was_not_built_with(bm25_index, tmp_path, capsys):
    code = serve_main(["--index", str(bm25_index), "--k1", "2.0", "--port", "0"])
    one_line(capsys, code, "serve", "--k1 2.0", f"the index {bm25_index} was built with k1=1.2")
    code = serve_main(["--index", str(bm25_index), "--encoder", "intfloat/e5-base-v2", "--port", "0"])
    one_line(capsys, code, "serve", "--encoder is a dense setting", "is a bm25 index")
    # A dense index's record (written by the real IndexConfig): --encoder X is refused before loading.
    dense = tmp_path / "dense"
    dense.mkdir()
    IndexConfig(kind="dense", settings={"encoder": "all-MiniLM-L6-v2", "pooling": "mean", "normalize": True,
                                        "passage_prefix": "", "max_seq_length": 256, "index_type": "flat"},
                query_settings={"query_prefix": ""}, corpus_path="c.jsonl", corpus_fingerprint="x", count=1).write(dense)
    code = serve_main(["--index", str(dense), "--encoder", "intfloat/e5-base-v2", "--port", "0"])
    one_line(capsys, code, "serve", "--encoder 'intfloat/e5-base-v2'", "built with encoder='all-MiniLM-L6-v2'")


@pytest.mark.parametrize("args, needles", [
    (["--max-topk", "1"], ["default_topk (--default-topk) must be in 1..max_topk (1)", "got 3"]),
    (["--header-timeout", "0"], ["header_timeout_s (--header-timeout) must be > 0 seconds, got 0.0"]),
    (["--port", "99999"], ["--port must be in 0..65535", "got 99999"]),
], ids=["max_topk_below_default", "header_timeout", "port"])
def test_serve_limits_are_checked_at_start(bm25_index, capsys, args, needles):
    from lldslight.cli import main

    try:
        code = main(["serve", "--index", str(bm25_index), *args])
    except SystemExit as e:  # argparse's usage errors exit
        code = e.code
    one_line(capsys, code, "serve", *needles)


def test_index_never_replaces_another_index_without_force(tmp_path, corpus, capsys):
    other = write_corpus(tmp_path / "other.jsonl", n=20)
    out = tmp_path / "idx"
    assert index_main(["--corpus", str(corpus), "--out", str(out), "--quiet"]) == 0
    files = lambda: {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    capsys.readouterr()
    code = index_main(["--corpus", str(other), "--out", str(out), "--quiet"])
    one_line(capsys, code, "index", f"{out.resolve()} already holds a bm25 index of {corpus.resolve()} (200 passages)",
             "pass --force to replace it")
    assert files() == before
    assert index_main(["--corpus", str(other), "--out", str(out), "--quiet", "--force"]) == 0
    assert json.loads((out / CONFIG_NAME).read_text())["corpus"]["count"] == 20
