"""What the HTTP API does with a request before any route sees it: a pure ASGI middleware that
counts and times requests, and refuses a body over `max_body_bytes` with 413 before it is read —
from its Content-Length, or, for a body sent in chunks, as soon as the bytes received pass the
limit (the rest is never read). A 50 MB prompt costs the gateway nothing; before issue 33 the
whole body was parsed first, and the executor's refusal came back as 429, so the `openai`
client uploaded it three times.

A pure ASGI middleware (not Starlette's `BaseHTTPMiddleware`) leaves the request's `receive`
channel to the route, so a route sees a client that went away (`Request.is_disconnected`).
"""
from __future__ import annotations

import json
import time

from prometheus_client import Counter, Gauge, Histogram

from kvplan.openai_errors import ApiError
from kvplan.serving import SECONDS_BUCKETS

REQUESTS = Counter("kvplan_http_requests_total", "HTTP API requests", ["route", "status"])
SECONDS = Histogram("kvplan_http_request_seconds", "HTTP API request time (streams: to their last byte)",
                    ["route"], buckets=SECONDS_BUCKETS)
IN_FLIGHT = Gauge("kvplan_http_requests_in_flight", "HTTP API requests being answered")


class Guard:
    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, t0, status = scope["path"], time.perf_counter(), [500]

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
            if route.startswith("/v1/"):
                REQUESTS.labels(route, str(status[0])).inc()
                SECONDS.labels(route).observe(time.perf_counter() - t0)

    async def _bounded(self, scope, receive, send):
        """`receive` for the app, or None when the body was too large (and 413 was sent)."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _refuse(send, ApiError(400, "Content-Length: not a number", param="Content-Length",
                                             code="invalid_value"))
                return None
            if int(length) > self.max_body_bytes:
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
            if size > self.max_body_bytes:
                await _refuse(send, _too_large(size, self.max_body_bytes, more=message.get("more_body", False)))
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), [False]

        async def replay():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()                           # then: the disconnect, when it comes
        return replay


def _too_large(size: int, limit: int, more: bool = False) -> ApiError:
    return ApiError(413, f"the request body is {size}{'+' if more else ''} bytes, more than the {limit} this "
                         "server reads (KVPLAN_HTTP_MAX_BODY_BYTES)", code="request_too_large")


async def _refuse(send, e: ApiError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
