"""What the HTTP API does with a request before any route sees it: a pure ASGI middleware that
counts and times requests by their route's template, and refuses a body over `max_body_bytes`
with 413 before any of it is parsed.

**413, read once.** A client (the `openai` one, curl, httpx) sends its whole body before it reads
the answer. A server that answers and closes while the body still comes makes the kernel reset
the connection, and the client sees a dropped connection instead of the 413 — and retries it
(the `openai` client retries connection errors: a 5 MB or 20 MB body went up twice or three
times, issue 42). So an oversized body is read and discarded — never kept — up to `drain_bytes`
and for at most `DRAIN_S` (nginx's lingering close, bounded the same way), then answered; a body
declared larger than `drain_bytes` is answered at once (its client may see the reset: nothing
bounded can help it). A client that asked `Expect: 100-continue` is answered before it sends.

**Metrics by template.** Requests are labelled by the route that matched (`/v1/chat/completions`),
or `other` for a path no route knows: a bounded set (`/metrics` and `/health` are not counted). Labelled by the raw path, 300 GETs to
distinct 2 KB paths took `/metrics` from 4.7 KB to 14.3 MB (issue 42). A route that answers an
error in a stream already started (a 200 on the wire) reports its real status with
`report_status`, so the metrics count it as what it was.

A pure ASGI middleware (not Starlette's `BaseHTTPMiddleware`) leaves the request's `receive`
channel to the route, so a route sees a client that went away (`Request.is_disconnected`).
"""
from __future__ import annotations

import asyncio
import json
import time

from prometheus_client import Counter, Gauge, Histogram
from starlette.routing import Match

from kvplan.openai_errors import ApiError
from kvcore.serving import SECONDS_BUCKETS

REQUESTS = Counter("kvplan_http_requests_total", "HTTP API requests, by route template and status",
                   ["route", "status"])
SECONDS = Histogram("kvplan_http_request_seconds", "HTTP API request time (streams: to their last byte)",
                    ["route"], buckets=SECONDS_BUCKETS)
IN_FLIGHT = Gauge("kvplan_http_requests_in_flight", "HTTP API requests being answered")
OTHER = "other"                 # the label of a path no route matches
UNCOUNTED = frozenset({"/metrics", "/health"})     # the scrapers' and health checks' own: not the API's load
DRAIN_S = 30.0                  # the longest an oversized body is read (and discarded) before its 413
_STATUS = "kvplan.status"       # scope key: the request's status cell (`report_status`)


def report_status(scope, status: int) -> None:
    """The status the request ended with when it differs from the one on the wire (an error
    event in a stream that started with 200)."""
    cell = scope.get(_STATUS)
    if cell is not None:
        cell[0] = status


class Guard:
    def __init__(self, app, max_body_bytes: int, drain_bytes: int, router=None):
        """router: whose routes' templates label the metrics (None: every request is `other`)."""
        self.app, self.max_body_bytes, self.drain_bytes, self.router = app, max_body_bytes, drain_bytes, router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, t0, status = self._template(scope), time.perf_counter(), [500]
        scope[_STATUS] = status

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        IN_FLIGHT.inc()
        try:
            receive = await self._bounded(scope, receive, send_counted)
            if receive is not None:
                await self.app(scope, receive, send_counted)
        finally:
            IN_FLIGHT.dec()
            if route not in UNCOUNTED:
                REQUESTS.labels(route, str(status[0])).inc()
                SECONDS.labels(route).observe(time.perf_counter() - t0)

    def _template(self, scope) -> str:
        """The path template of the route that serves `scope` (a wrong method's too), or OTHER."""
        for route in getattr(self.router, "routes", ()):
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return getattr(route, "path", OTHER)
        return OTHER

    async def _bounded(self, scope, receive, send):
        """`receive` for the app, or None when the request was answered here (413, or a bad
        Content-Length)."""
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _refuse(send, ApiError(400, "Content-Length: not a number", param="Content-Length",
                                             code="invalid_value"))
                return None
            if int(length) > self.max_body_bytes:
                if int(length) <= self.drain_bytes and headers.get(b"expect", b"").lower() != b"100-continue":
                    await self._drain(receive, 0)
                await _refuse(send, _too_large(int(length), self.max_body_bytes))
                return None
            return receive
        if scope["method"] in ("GET", "HEAD"):
            return receive
        # no Content-Length (a chunked body): read it here, at most the limit, then replay it
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None                                  # the client left while sending
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                if more:
                    more = not await self._drain(receive, size)
                await _refuse(send, _too_large(size, self.max_body_bytes, more=more))
                return None
            chunks.append(message.get("body", b""))
            if not more:
                break
        body, replayed = b"".join(chunks), [False]

        async def replay():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()                           # then: the disconnect, when it comes
        return replay

    async def _drain(self, receive, size: int) -> bool:
        """Read and discard the rest of a body (`size` bytes of it read already) until its end,
        `drain_bytes` in all, or DRAIN_S; True when the client sent all of it."""
        try:
            async with asyncio.timeout(DRAIN_S):
                while size <= self.drain_bytes:
                    message = await receive()
                    if message["type"] != "http.request":
                        return False                         # the client left
                    size += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return True
        except TimeoutError:
            pass
        return False


def _too_large(size: int, limit: int, more: bool = False) -> ApiError:
    return ApiError(413, f"the request body is {size}{'+' if more else ''} bytes, more than the {limit} this "
                         "server reads (KVPLAN_HTTP_MAX_BODY_BYTES)", code="request_too_large")


async def _refuse(send, e: ApiError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
