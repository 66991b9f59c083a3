"""A retrieval server byte-compatible with Search-R1's ``retrieval_server.py``.

``POST /retrieve {"queries": [...], "topk": k, "return_scores": true}`` ->
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``; without
``return_scores`` the inner items are the documents themselves. ``{"query": "...", "topk": k}``
is answered in the same shape with one list. ``GET /health`` says the server is up.

Concurrent requests are merged by a micro-batcher into one ``retriever.search`` call run in a
worker thread: one encoder forward pass for many rollout workers instead of one each. A lone
request is dispatched at once (no fixed wait), so batching costs nothing at low load. No call
holds more than ``max_batch`` queries: a bigger request is served a chunk at a time, round-robin
with the other requests, so a one-query request is not stuck behind a 512-query one.

Abuse is answered in one line, never a traceback: malformed or too deeply nested JSON gets 400, a
body not received within ``body_timeout_s`` gets 408, a client gone mid-request one log line. A body
that is not ``Content-Type: application/json`` gets 415 (a web page can POST text/plain to a local
server without a CORS preflight). A connection that does not complete a request's headers within
``header_timeout_s`` is closed (slowloris). A client that hangs up while its request waits or is
being searched has the rest of its queries dropped (checked between search calls of at most
``max_batch`` queries). At most ``max_inflight_passages`` passages (queries x topk) are being
searched and answered at once, over all requests; the others wait their turn, so the memory of
concurrent big requests is bounded.
"""
# No ``from __future__ import annotations`` here: FastAPI reads the endpoint annotations at
# definition time, and ``Request`` is imported inside ``create_app`` to keep imports lazy.

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from lldslight.errors import require

from .base import Passage, RetrievalError, Retriever

DEFAULT_HOST = "127.0.0.1"
# uvicorn's error logger: our one-line notices share its format and its --log-level.
log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ServerLimits:
    """Request limits; anything past them is refused with a 4xx and a message."""

    max_queries: int = 512  # queries in one request (413 beyond)
    max_topk: int = 100  # largest topk (422 beyond)
    max_body_bytes: int = 4 << 20  # request body size (413 beyond)
    default_topk: int = 3  # topk when the request has none, null or 0 (Search-R1's retrieval_topk)
    # Seconds to receive a request's body once its headers are in (408 beyond). uvicorn times out
    # only idle keep-alive connections, so without it a client that stops mid-body holds its
    # connection and request forever.
    body_timeout_s: float = 30.0
    # Seconds a connection has to complete a request's headers, from when it opens or its last
    # response was sent (closed beyond). uvicorn's keep-alive timer restarts at every byte, so a
    # client that trickles a header a byte at a time would hold its connection forever.
    header_timeout_s: float = 10.0
    # Passages (queries x topk) being searched and answered at once over all requests. Each holds
    # its passages' text until its answer is rendered; 20 maximal requests (512 x 100) at once
    # took the server from ~0.5 to ~1 GB. Two maximal requests' worth by default; a request larger
    # than the bound on its own is served alone.
    max_inflight_passages: int = 2 * 512 * 100

    def __post_init__(self) -> None:
        # One line naming the setting and its range when the server starts, not a 422 on every request.
        require(self.max_queries >= 1, "max_queries (--max-queries)", ">= 1", self.max_queries)
        require(self.max_topk >= 1, "max_topk (--max-topk)", ">= 1", self.max_topk)
        require(1 <= self.default_topk <= self.max_topk, "default_topk (--default-topk)",
                f"in 1..max_topk ({self.max_topk}), the topk a request without one gets", self.default_topk)
        require(self.max_body_bytes >= 1, "max_body_bytes (--max-body-bytes)", ">= 1", self.max_body_bytes)
        require(self.body_timeout_s > 0, "body_timeout_s (--body-timeout)", "> 0 seconds", self.body_timeout_s)
        require(self.header_timeout_s > 0, "header_timeout_s (--header-timeout)", "> 0 seconds", self.header_timeout_s)
        require(self.max_inflight_passages >= 1, "max_inflight_passages (--max-inflight-passages)", ">= 1",
                self.max_inflight_passages)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_request(payload: Any, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a decoded /retrieve body -> (queries, topk, return_scores)."""
    if not isinstance(payload, dict):
        raise BadRequest(422, f"body must be a JSON object, got {type(payload).__name__}")
    has_many, has_one = payload.get("queries") is not None, payload.get("query") is not None
    if has_many and has_one:
        raise BadRequest(422, "give either 'queries' (a list) or 'query' (a string), not both")
    if has_one:
        q = payload["query"]
        if not isinstance(q, str):
            raise BadRequest(422, f"field 'query' must be a string, got {type(q).__name__}")
        queries = [q]
    elif has_many:
        queries = payload["queries"]
        if not isinstance(queries, list):
            raise BadRequest(422, f"field 'queries' must be a list of strings, got {type(queries).__name__}")
        if len(queries) > limits.max_queries:
            raise BadRequest(413, f"too many queries: {len(queries)} > max_queries={limits.max_queries}; split the batch")
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise BadRequest(422, f"field 'queries[{i}]' must be a string, got {type(q).__name__}")
    else:
        raise BadRequest(422, "missing field 'queries' (a list of strings) or 'query' (a string)")
    topk = payload.get("topk")
    if isinstance(topk, float) and topk.is_integer():
        topk = int(topk)
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int)):
        raise BadRequest(422, f"field 'topk' must be an integer, got {type(payload.get('topk')).__name__}")
    if not topk:  # absent, null or 0: the default, as Search-R1's server does (`if not request.topk`)
        topk = limits.default_topk
    if not 1 <= topk <= limits.max_topk:
        raise BadRequest(422, f"field 'topk' must be between 1 and max_topk={limits.max_topk} (0 or null: "
                              f"the default, {limits.default_topk}), got {topk}")
    rs = payload.get("return_scores")
    if rs is None:
        rs = False
    if not isinstance(rs, bool):
        raise BadRequest(422, f"field 'return_scores' must be a boolean, got {type(rs).__name__}")
    return queries, topk, rs


def render_result(results: list[list[Passage]], return_scores: bool) -> bytes:
    docs = [[{"id": p.id, "contents": p.contents} for p in ps] for ps in results]
    if return_scores:
        body: Any = {"result": [[{"document": d, "score": p.score} for d, p in zip(ds, ps)]
                                for ds, ps in zip(docs, results)]}
    else:
        body = {"result": docs}
    # Starlette's JSONResponse encoding, i.e. what Search-R1's FastAPI server sends.
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


@dataclass(eq=False)
class _Job:
    """One request's queries, the results found so far, and the future its handler awaits."""

    queries: list[str]
    k: int
    future: asyncio.Future
    results: list[list[Passage]] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return len(self.queries) - len(self.results)


class MicroBatcher:
    """Merge concurrent searches into ``retriever.search`` calls of at most ``max_batch`` queries,
    run one at a time on a worker thread.

    Each call goes round the pending requests in turn, one chunk from each, until it holds
    ``max_batch`` queries; a request served in a call goes to the back of the line, behind the
    requests that arrived meanwhile. A 512-query request is therefore searched over several calls,
    and a one-query request that arrives during it rides along in the next call instead of waiting
    for all 512. Before each call, the batcher waits (up to ``max_wait_ms``) only while other
    requests are still being read (``arriving``), so a lone request goes out immediately.
    """

    def __init__(self, retriever: Retriever, max_batch: int = 64, max_wait_ms: float = 5.0):
        require(max_batch >= 1, "MicroBatcher.max_batch (--max-batch)", ">= 1", max_batch)
        self.retriever = retriever
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.arriving = 0  # requests whose body is being read or validated
        self.batches = 0
        self.batched_queries = 0
        self._new: Optional[asyncio.Queue] = None  # jobs not yet in the line
        self._line: deque[_Job] = deque()  # jobs with queries left, in serving order
        self._task: Optional[asyncio.Task] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval-search")

    async def start(self) -> None:
        self._new = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        assert self._new is not None, "MicroBatcher.start() was not awaited"
        if not queries:
            return []
        fut = asyncio.get_running_loop().create_future()
        self._new.put_nowait(_Job(list(queries), k, fut))
        return await fut

    def _admit(self) -> None:
        assert self._new is not None
        while not self._new.empty():
            self._line.append(self._new.get_nowait())

    async def _gather(self) -> None:
        """Admit every queued request, yielding while more are being read, up to max_wait."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait
        while True:
            self._admit()
            if sum(j.remaining for j in self._line) >= self.max_batch:
                return
            if self.arriving > 0 and loop.time() < deadline:
                await asyncio.sleep(0)
            else:
                return

    def _compose(self) -> list[tuple[_Job, int, int]]:
        """The next call: (job, start, end) slices of the jobs at the front, max_batch queries in all."""
        parts, used = [], 0
        for job in self._line:
            if used == self.max_batch:
                break
            start = len(job.results)
            end = min(len(job.queries), start + self.max_batch - used)
            parts.append((job, start, end))
            used += end - start
        return parts

    async def _run(self) -> None:
        assert self._new is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._line:
                self._line.append(await self._new.get())
            await self._gather()
            self._line = deque(j for j in self._line if not j.future.done())  # client went away
            if not self._line:
                continue
            parts = self._compose()
            queries = [q for job, a, b in parts for q in job.queries[a:b]]
            kmax = max(job.k for job, _, _ in parts)
            self.batches += 1
            self.batched_queries += len(queries)
            try:
                results = await loop.run_in_executor(self._executor, self.retriever.search, queries, kmax)
                if len(results) != len(queries):
                    raise RetrievalError(f"retriever returned {len(results)} lists for {len(queries)} queries")
                failed: Optional[Exception] = None
            except Exception as e:  # one failed search fails the requests in its call, not the server
                failed = e
            pos = 0
            for job, a, b in parts:
                if failed is not None:
                    if not job.future.done():
                        job.future.set_exception(failed)
                else:
                    job.results.extend(r[: job.k] for r in results[pos : pos + b - a])
                    pos += b - a
                    if job.remaining == 0 and not job.future.done():
                        job.future.set_result(job.results)
            # Requests that arrived during the call queue ahead of the ones just served.
            served = {id(job) for job, _, _ in parts}
            self._admit()
            waiting = [j for j in self._line if id(j) not in served]
            again = [job for job, _, _ in parts if job.remaining > 0 and not job.future.done()]
            self._line = deque(waiting + again)


class PassageBudget:
    """At most ``limit`` passages (queries x topk) in flight: searched, or answered and not yet
    rendered. A request takes its share before it is searched and gives it back once its answer
    is rendered; one that would pass the limit waits, in arrival order (a big request is not
    starved by a stream of small ones). A request above the limit on its own takes all of it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._queue: deque = deque()
        self._cond: Optional[asyncio.Condition] = None

    async def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        if self._cond is None:
            self._cond = asyncio.Condition()
        me = object()
        async with self._cond:
            self._queue.append(me)
            try:
                await self._cond.wait_for(lambda: self._queue[0] is me and self.used + n <= self.limit)
            finally:
                self._queue.remove(me)
                self._cond.notify_all()  # the next in line may fit now, or may be first now
            self.used += n
            self.peak = max(self.peak, self.used)
        return n

    async def release(self, n: int) -> None:
        assert self._cond is not None
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


async def _until_disconnected(request: Any) -> None:
    """Returns when the client hangs up. Only once the body is read: ASGI's receive() then waits
    for nothing but the disconnect (uvicorn also answers it once the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _is_json(content_type: Optional[str]) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


def create_app(retriever: Retriever, limits: ServerLimits = ServerLimits(), max_batch: int = 64,
               max_wait_ms: float = 5.0) -> Any:
    """The FastAPI app. The retriever should already be loaded (``serve`` and ``start_server`` do)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    batcher = MicroBatcher(retriever, max_batch=max_batch, max_wait_ms=max_wait_ms)
    budget = PassageBudget(limits.max_inflight_passages)
    gone = {"requests": 0, "queries": 0}  # clients that hung up before their answer, and their queries

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="lldslight retrieval (Search-R1 compatible)", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.limits = limits
    app.state.budget = budget

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"detail": message}, status_code=status)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise BadRequest(413, f"request body of {declared} bytes exceeds max_body_bytes={limits.max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_body_bytes:
                raise BadRequest(413, f"request body exceeds max_body_bytes={limits.max_body_bytes}")
        return bytes(body)

    def client(request: Request) -> str:
        return f"{request.client.host}:{request.client.port}" if request.client else "a client"

    async def answer(queries: list[str], topk: int, return_scores: bool) -> Response:
        share = await budget.acquire(len(queries) * topk)
        try:
            results = await batcher.search(queries, topk)
            return Response(render_result(results, return_scores), media_type="application/json")
        finally:
            await asyncio.shield(budget.release(share))  # given back even when the client left

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        if not _is_json(request.headers.get("content-type")):
            got = request.headers.get("content-type")
            return error(415, f"Content-Type must be application/json, got {got!r}" if got else
                              "Content-Type must be application/json, got none")
        batcher.arriving += 1
        try:
            body = await asyncio.wait_for(read_body(request), limits.body_timeout_s)
            try:
                payload = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(400, f"malformed JSON body: {e}") from None
            except RecursionError:
                raise BadRequest(400, "malformed JSON body: nested too deeply to parse") from None
            queries, topk, return_scores = parse_request(payload, limits)
        except BadRequest as e:
            return error(e.status, e.message)
        except asyncio.TimeoutError:
            log.warning("retrieval: %s sent no complete body within body_timeout_s=%gs; answered 408",
                        client(request), limits.body_timeout_s)
            # Connection: close: a stalled client would otherwise keep the connection by trickling bytes.
            return JSONResponse({"detail": f"request body not received within body_timeout_s={limits.body_timeout_s:g}s"},
                                status_code=408, headers={"Connection": "close"})
        except ClientDisconnect:
            log.warning("retrieval: %s disconnected before sending its whole request", client(request))
            return Response(status_code=400)  # nobody is there to read it; uvicorn drops it
        finally:
            batcher.arriving -= 1
        work = asyncio.ensure_future(answer(queries, topk, return_scores))
        left = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if not work.done():
            # Cancelling drops its job from the batcher's line: no further search call for it.
            work.cancel()
            gone["requests"] += 1
            gone["queries"] += len(queries)
            log.warning("retrieval: %s hung up before its answer; its %d queries were dropped", client(request), len(queries))
            return Response(status_code=499)  # nobody reads it
        try:
            return work.result()
        except Exception as e:
            return error(500, f"search failed: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        info: dict[str, Any] = {"status": "ok", "retriever": type(retriever).__name__,
                                "batches": batcher.batches, "queries": batcher.batched_queries,
                                "inflight_passages": budget.used, "peak_inflight_passages": budget.peak,
                                "max_inflight_passages": budget.limit,
                                "abandoned_requests": gone["requests"], "abandoned_queries": gone["queries"]}
        if getattr(retriever, "loaded", False):
            info["passages"] = len(retriever)  # type: ignore[arg-type]
        return info

    return app


def _bind(host: str, port: int) -> socket.socket:
    """Bind and listen before uvicorn starts: port 0 gets a free port we can report, and clients
    that connect early wait in the backlog instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # says TCP, and without it every keep-alive response waits ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RetrievalError(f"cannot bind {host}:{port}: {e}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/retrieve"


def _header_deadline_protocol(header_timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools or h11, as uvicorn picks) with a deadline on request
    headers: armed when the connection opens and after each response, disarmed once a request's
    headers are in; when it fires the connection is closed. uvicorn has no such option: its
    keep-alive timer is reset by every byte received, so a slowloris client keeps it forever."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: Optional[asyncio.TimerHandle] = None

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._in_request():
                self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._in_request() or self.transport.is_closing():
                return
            who = "%s:%d" % self.client if self.client else "a client"
            log.warning("retrieval: %s sent no complete request headers within header_timeout_s=%gs; connection closed",
                        who, header_timeout_s)
            self.transport.close()

    return HeaderDeadlineProtocol


def _uvicorn_server(app: Any, log_level: str, header_timeout_s: float = ServerLimits.header_timeout_s) -> Any:
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=2,
                            http=_header_deadline_protocol(header_timeout_s))
    return uvicorn.Server(config)


def serve(retriever: Retriever, host: str = DEFAULT_HOST, port: int = 8000, limits: ServerLimits = ServerLimits(),
          max_batch: int = 64, max_wait_ms: float = 5.0, log_level: str = "warning",
          on_ready: Optional[Callable[[str], None]] = None) -> None:
    """Load the retriever, bind, and serve until interrupted (blocking)."""
    load = getattr(retriever, "load", None)
    if callable(load):
        load()
    sock = _bind(host, port)
    if on_ready is not None:
        on_ready(_url(sock, host))
    server = _uvicorn_server(create_app(retriever, limits, max_batch, max_wait_ms), log_level, limits.header_timeout_s)
    server.run(sockets=[sock])


class ServerHandle:
    """A server running on a background thread of this process (tests, notebooks)."""

    def __init__(self, server: Any, thread: threading.Thread, sock: socket.socket, url: str, app: Any):
        self._server, self._thread, self._sock = server, thread, sock
        self.url = url
        self.base_url = url.rsplit("/", 1)[0]
        self.port = int(sock.getsockname()[1])
        self.app = app

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server(retriever: Retriever, host: str = DEFAULT_HOST, port: int = 0, limits: ServerLimits = ServerLimits(),
                 max_batch: int = 64, max_wait_ms: float = 5.0, log_level: str = "warning",
                 timeout: float = 60.0) -> ServerHandle:
    """Serve ``retriever`` on a daemon thread; ``port=0`` picks a free port. Returns once it
    accepts requests: ``handle.url`` is the /retrieve URL, ``handle.stop()`` shuts it down."""
    load = getattr(retriever, "load", None)
    if callable(load):
        load()
    sock = _bind(host, port)
    app = create_app(retriever, limits, max_batch, max_wait_ms)
    server = _uvicorn_server(app, log_level, limits.header_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="retrieval-server")
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise RetrievalError(f"retrieval server on {host}:{port} failed to start")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RetrievalError(f"retrieval server did not start within {timeout:.0f}s")
        time.sleep(0.01)
    return ServerHandle(server, thread, sock, _url(sock, host), app)


class ServerProcess:
    """A server in a child process (``python -m lldslight.retrieval.cli serve ...``), so that
    benchmarks measure it without sharing the client's interpreter lock."""

    READY = "lldslight serve: listening on "

    def __init__(self, proc: subprocess.Popen, url: str, log: list[str]):
        self.proc = proc
        self.url = url
        self.base_url = url.rsplit("/", 1)[0]
        self.log = log

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server_process(serve_args: Sequence[str], host: str = DEFAULT_HOST, port: int = 0,
                         timeout: float = 300.0, env: Optional[dict[str, str]] = None) -> ServerProcess:
    """Start ``lldslight serve <serve_args> --host H --port P`` in a child process and wait until
    it listens (index loading included, hence the generous timeout)."""
    cmd = [sys.executable, "-m", "lldslight.retrieval.cli", "serve", *serve_args, "--host", host, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, **(env or {})})
    log: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # drain the pipe for the child's whole life, or it blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip("\n"))
            del log[:-200]
            if not url and line.startswith(ServerProcess.READY):
                url.append(line[len(ServerProcess.READY):].strip())
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True, name="retrieval-server-log").start()
    if not ready.wait(timeout) or not url:
        proc.kill()
        proc.wait()
        tail = "\n".join(log[-20:])
        raise RetrievalError(f"server process did not start ({' '.join(cmd)}):\n{tail}")
    return ServerProcess(proc, url[0], log)
