"""Client for any Search-R1-compatible retrieval server (ours, Search-R1's, FlashRAG's)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Literal

from lldslight.errors import require, require_choice

from .base import Passage, RetrievalError

log = logging.getLogger(__name__)

OnUnavailable = Literal["fail", "observe"]
UNAVAILABLE = Passage(id="unavailable", contents='"Search unavailable"\nThe search engine is unavailable right now.',
                      score=0.0)
_RETRY_STATUS = {429, 500, 502, 503, 504}


class _Unavailable(Exception):
    """The server could not be reached or kept failing; carries the last error and whether the
    server answered at all (an HTTP error or a malformed answer) or was never reached."""

    def __init__(self, last: str, answered: bool = False, attempts: int = 0):
        super().__init__(last)
        self.answered = answered
        self.attempts = attempts


class HttpRetriever:
    """Search through ``POST {url}`` in the Search-R1 format.

    Args:
        url: the server's /retrieve endpoint.
        timeout: seconds for one HTTP request (connect + read).
        retries: extra attempts after a connection error, a timeout or a 429/5xx answer.
        backoff: first wait between attempts in seconds; doubles each retry (capped at 10 s).
        batch_size: queries per request; larger batches are split (servers cap request size).
        on_unavailable: when the server stays down after the retries, "fail" raises
            RetrievalError (URL and last error); "observe" answers every query of the failed
            request with one "Search unavailable" passage and counts it in ``unavailable_count``,
            so a long training run survives a retrieval-server restart.
        breaker_failures: ("observe") after this many failed attempts in a row (timeouts,
            connection errors, 429/5xx, malformed answers; over all requests), the circuit
            opens: searches get the "Search unavailable" passage at once, without a request, for
            ``breaker_cooldown`` seconds. Then one request probes the server with a single
            attempt: an answer closes the circuit, a failure opens it for another cooldown.
            Without it, a hung server costs every search call its whole retry cycle
            (``(retries + 1) x timeout`` plus back-off). 0 = no circuit breaker.
        breaker_cooldown: seconds the circuit stays open before the next probe.

    In "fail" mode, malformed answers (no "result", wrong number of lists, items without
    "contents", an HTML page) raise at once: they are bugs to fix. In "observe" mode they count as
    a failed attempt, like an outage, so one proxy error page does not end a long run. 4xx answers
    always raise. Counters for logging: ``unavailable_count`` (queries answered "unavailable"),
    ``short_circuited_count`` (of those, answered by the open circuit without a request),
    ``breaker_opened`` (times the circuit opened) and ``breaker_open`` (whether it is open now).
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000/retrieve",
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        batch_size: int = 256,
        on_unavailable: OnUnavailable = "fail",
        breaker_failures: int = 3,
        breaker_cooldown: float = 30.0,
    ):
        require_choice(on_unavailable, "HttpRetriever.on_unavailable", OnUnavailable)
        require(breaker_failures >= 0, "HttpRetriever.breaker_failures", ">= 0 (0 = no circuit breaker)", breaker_failures)
        require(breaker_cooldown > 0, "HttpRetriever.breaker_cooldown", "> 0 seconds", breaker_cooldown)
        require(batch_size >= 1, "HttpRetriever.batch_size", ">= 1", batch_size)
        require(retries >= 0, "HttpRetriever.retries", ">= 0", retries)
        require(timeout > 0, "HttpRetriever.timeout", "> 0 seconds", timeout)
        self.url = url
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.batch_size = int(batch_size)
        self.on_unavailable = on_unavailable
        self.breaker_failures = int(breaker_failures)
        self.breaker_cooldown = float(breaker_cooldown)
        self.unavailable_count = 0  # queries answered with the UNAVAILABLE passage
        self.short_circuited_count = 0  # of those, answered by the open circuit (no request sent)
        self.breaker_opened = 0  # times the circuit opened
        self._failures = 0  # failed attempts in a row
        self._open_until: float | None = None  # monotonic time the circuit may probe again; None = closed
        self._probing = False  # a probe request is in flight (other calls stay short-circuited)
        self._client: Any = None
        self._lock = threading.Lock()

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            with self._lock:
                if self._client is None:
                    self._client = httpx.Client(timeout=self.timeout)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if isinstance(queries, str):
            raise TypeError("search takes a list of queries, not a single string")
        require(k >= 1, f"{type(self).__name__}.search k (rollout.topk)", ">= 1", k)
        out: list[list[Passage]] = []
        for s in range(0, len(queries), self.batch_size):
            chunk = list(queries[s : s + self.batch_size])
            if self.on_unavailable == "fail":
                try:
                    out.extend(self._request(chunk, k))
                except _Unavailable as e:
                    raise RetrievalError(f"retrieval server {self.url} unavailable after {self.retries + 1} attempts: {e}") from None
                continue
            attempts, probe = self._admit()
            if attempts == 0:  # the circuit is open: no request, no waiting
                with self._lock:
                    self.unavailable_count += len(chunk)
                    self.short_circuited_count += len(chunk)
                out.extend([UNAVAILABLE] for _ in chunk)
                continue
            try:
                out.extend(self._request(chunk, k, attempts))
            except _Unavailable as e:
                with self._lock:
                    first = self.unavailable_count == 0
                    self.unavailable_count += len(chunk)
                if first:
                    log.warning("retrieval server %s unavailable after %d attempts (%s): answering with a 'Search "
                                "unavailable' observation (on_unavailable=observe); counted per step in "
                                "retrieval/unavailable", self.url, e.attempts, e)
                out.extend([UNAVAILABLE] for _ in chunk)
            finally:
                if probe:
                    with self._lock:
                        self._probing = False
        return out

    # -- circuit breaker ("observe" mode) ---------------------------------------------------------

    @property
    def breaker_open(self) -> bool:
        return self._open_until is not None

    def _admit(self) -> tuple[int, bool]:
        """(attempts the next request may make, whether it is the probe): all of them while the
        circuit is closed, one (the probe) once an open circuit's cooldown is over, none while it
        is open or another call is probing."""
        with self._lock:
            if self.breaker_failures == 0 or self._open_until is None:
                return self.retries + 1, False
            if self._probing or time.monotonic() < self._open_until:
                return 0, False
            self._probing = True
            return 1, True

    def _record(self, ok: bool, error: str = "") -> None:
        """Count an attempt's outcome; open or close the circuit, said in one line each time."""
        if self.on_unavailable != "observe" or self.breaker_failures == 0:
            return
        with self._lock:
            if ok:
                self._failures = 0
                closed, self._open_until = self._open_until is not None, None
                if closed:
                    log.warning("retrieval server %s answers again: circuit closed, searching normally "
                                "(%d queries were answered 'unavailable' while it was open)", self.url,
                                self.short_circuited_count)
                return
            self._failures += 1
            reopen = self._open_until is not None  # a failed probe
            if reopen or self._failures >= self.breaker_failures:
                self._open_until = time.monotonic() + self.breaker_cooldown
                if not reopen:
                    self.breaker_opened += 1
                log.warning("retrieval server %s: %s; circuit %s: searches answer 'Search unavailable' at once for "
                            "%gs, then one request probes it (counted in retrieval/short_circuited)", self.url,
                            f"the probe failed ({error})" if reopen else f"{self._failures} failed attempts in a row ({error})",
                            "open again" if reopen else "open", self.breaker_cooldown)

    def probe(self, topk: int) -> None:
        """One request in Search-R1's format with ``topk`` (any compatible server answers it; Search-R1's
        own has no /health): raises RetrievalError, whatever ``on_unavailable`` says, when the server
        cannot be reached or refuses ``topk`` (its 4xx message names its limit). Called before training."""
        try:
            self._request(["lldslight preflight"], topk, strict=True)
        except _Unavailable as e:
            if e.answered:  # it is up, and failing: "start it" would be the wrong advice
                raise RetrievalError(f"retrieval server {self.url} answered but failed {self.retries + 1} attempts "
                                     f"(last: {e}); see the server's log") from None
            raise RetrievalError(f"retrieval server {self.url} unreachable after {self.retries + 1} attempts ({e}); "
                                 "start it (lldslight serve --index DIR --port N) or fix the retriever's url") from None
        except RetrievalError as e:
            raise RetrievalError(f"{e} (probed with rollout.topk={topk})") from None

    def _request(self, queries: list[str], k: int, attempts: int | None = None, strict: bool = False) -> list[list[Passage]]:
        """One request, retried: ``attempts`` tries in all (default retries + 1). A malformed answer
        raises at once in "fail" mode or when ``strict``, else counts as a failed attempt."""
        import httpx

        payload = {"queries": queries, "topk": k, "return_scores": True}
        attempts = self.retries + 1 if attempts is None else attempts
        tolerate_malformed = self.on_unavailable == "observe" and not strict
        record = (lambda ok, error="": None) if strict else self._record  # the pre-flight probe trips nothing
        last, answered, made = "", False, 0
        for attempt in range(attempts):
            if attempt:
                if self.breaker_open and not strict:  # opened by this request's failures or another thread's
                    break
                wait = min(self.backoff * 2 ** (attempt - 1), 10.0)
                # Every failed attempt is said as it happens: a hung server is not minutes of silence.
                log.warning("retrieval server %s: attempt %d/%d failed (%s); retrying in %.1fs",
                            self.url, attempt, attempts, last, wait)
                time.sleep(wait)
            t0 = time.perf_counter()
            made += 1
            try:
                resp = self._http().post(self.url, json=payload)
            except httpx.TransportError as e:
                last = f"{type(e).__name__} after {time.perf_counter() - t0:.1f}s" + (f": {e}" if str(e) else "")
                record(False, last)
                continue
            if resp.status_code in _RETRY_STATUS:
                last, answered = f"HTTP {resp.status_code}: {resp.text[:300]}", True
                record(False, f"HTTP {resp.status_code}")
                continue
            if resp.status_code != 200:
                raise RetrievalError(f"retrieval server {self.url} refused the request: HTTP {resp.status_code}: {resp.text[:500]}")
            try:
                result = parse_response(resp, len(queries), k, self.url)
            except RetrievalError as e:
                if not tolerate_malformed:
                    raise
                last, answered = f"malformed answer: {e}", True
                record(False, "malformed answer")
                continue
            record(True)
            return result
        log.warning("retrieval server %s: attempt %d/%d failed (%s); giving up", self.url, made, attempts, last)
        raise _Unavailable(last, answered, made)

    def __getstate__(self) -> dict:
        # Picklable for multiprocess data loading / DDP spawn: clients are per process.
        state = self.__dict__.copy()
        state["_client"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HttpRetriever(url={self.url!r}, on_unavailable={self.on_unavailable!r})"


def parse_response(resp: Any, n_queries: int, k: int, url: str) -> list[list[Passage]]:
    """Validate a Search-R1 /retrieve answer and convert it to passages."""
    try:
        body = resp.json()
    except ValueError:
        raise RetrievalError(f"retrieval server {url} answered with non-JSON: {resp.text[:200]!r}") from None
    if not isinstance(body, dict) or "result" not in body:
        keys = list(body)[:10] if isinstance(body, dict) else type(body).__name__
        raise RetrievalError(f"retrieval server {url}: response has no 'result' field (got {keys})")
    result = body["result"]
    if not isinstance(result, list) or len(result) != n_queries:
        got = f"{len(result)} lists" if isinstance(result, list) else type(result).__name__
        raise RetrievalError(f"retrieval server {url}: 'result' should hold {n_queries} lists (one per query), got {got}")
    out: list[list[Passage]] = []
    for qi, items in enumerate(result):
        if not isinstance(items, list):
            raise RetrievalError(f"retrieval server {url}: result[{qi}] should be a list, got {type(items).__name__}")
        out.append([_passage(item, f"result[{qi}][{j}]", url) for j, item in enumerate(items[:k])])
    return out


def _passage(item: Any, where: str, url: str) -> Passage:
    if not isinstance(item, dict):
        raise RetrievalError(f"retrieval server {url}: {where} should be an object, got {type(item).__name__}")
    score: Any = 0.0
    doc = item
    if "document" in item:  # return_scores=true shape
        doc, score = item["document"], item.get("score", 0.0)
        where += ".document"
        if not isinstance(doc, dict):
            raise RetrievalError(f"retrieval server {url}: {where} should be an object, got {type(doc).__name__}")
    contents = doc.get("contents")
    if not isinstance(contents, str):
        what = "has no 'contents'" if contents is None else f"has a non-string 'contents' ({type(contents).__name__})"
        raise RetrievalError(f"retrieval server {url}: {where} {what}")
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise RetrievalError(f"retrieval server {url}: {where} score should be a number, got {type(score).__name__}")
    return Passage(id=str(doc.get("id", "")), contents=contents, score=float(score))
