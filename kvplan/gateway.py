"""`kvplan serve http`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over the executor's
gRPC API.

    GET  /v1/models             the served model
    POST /v1/completions        prompt -> text (one user message; SSE with "stream": true)
    POST /v1/chat/completions   messages -> assistant message (SSE with "stream": true)
    GET  /health                200 when the executor answers SERVING, else 503
    GET  /metrics               Prometheus

Each request is one executor `Generate` call (the job goes through the job queue, so it survives
the executor that held it; a re-run's text is not streamed twice: `kvplan.attempts`). The
request's `Authorization: Bearer` header travels as gRPC `authorization` metadata. Bad input is
HTTP 400 in OpenAI's error shape naming the parameter, before any job exists; a client that goes
away cancels its job. Request and response bodies: `kvplan.openai_api`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from kvplan import openai_api as api
from kvplan.attempts import AttemptText, Diverged
from kvplan.channels import aio_channel
from kvplan.config import HttpConfig, ModelConfig, SecurityConfig, from_env
from kvplan.serving import SECONDS_BUCKETS, channel_options
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc

log = logging.getLogger("kvplan.gateway")
REQUESTS = Counter("kvplan_http_requests_total", "HTTP API requests", ["route", "status"])
SECONDS = Histogram("kvplan_http_request_seconds", "HTTP API request time (streams: to their last byte)",
                    ["route"], buckets=SECONDS_BUCKETS)
IN_FLIGHT = Gauge("kvplan_http_requests_in_flight", "HTTP API requests being answered")

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}
TERMINAL = (pb.DONE, pb.FAILED, pb.CANCELLED)


def from_grpc(e: grpc.aio.AioRpcError) -> api.ApiError:
    """An executor error as the HTTP error a client of OpenAI's API expects."""
    status = HTTP_STATUS.get(e.code(), 500)
    details = e.details() or e.code().name
    param = None
    if status == 400:
        field, sep, rest = details.partition(": ")
        if sep and " " not in field:
            param = api.PARAMS.get(field, field)
            details = f"{param}: {rest}"
    if status == 503:
        details += " (is the executor up? `kvplan up` starts a local cluster)"
    retry = dict(e.trailing_metadata() or ()).get("retry-after")
    return api.ApiError(status, details, param=param, code=e.code().name.lower(),
                        headers={"Retry-After": str(retry)} if retry else None)


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    auth = request.headers.get("authorization")
    return (("authorization", auth),) if auth else ()


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


class Gateway:
    def __init__(self, cfg: HttpConfig, model_name: str):
        self.cfg, self.model_name = cfg, model_name
        self.channel: grpc.aio.Channel | None = None
        self.stub: executor_pb2_grpc.ExecutorStub | None = None
        self._cancels: set[asyncio.Task] = set()

    async def open(self) -> None:
        # TLS as the process is configured; never this process's own API key: each request acts
        # with its client's key (its Authorization header), or with none
        sec = dataclasses.replace(from_env(SecurityConfig), api_key="")
        self.channel = aio_channel(self.cfg.executor_addr, options=channel_options(), sec=sec)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)

    async def close(self) -> None:
        if self._cancels:
            await asyncio.wait(self._cancels, timeout=5)
        if self.channel is not None:
            await self.channel.close()

    async def healthy(self) -> bool:
        try:
            r = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise api.ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                               param="model", code="model_not_found")

    async def answer(self, request: Request, req: pb.GenerateRequest, body: api.RequestBody, kind: str):
        """Start the job (its errors are this request's HTTP error), then answer in one JSON body
        or as an SSE stream."""
        metadata = _metadata(request)
        call = self.stub.Generate(req, metadata=metadata, timeout=self.cfg.timeout_s)
        try:
            first = await call.read()                   # the QUEUED event: the job exists
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        if first is grpc.aio.EOF:
            raise api.ApiError(502, "the executor ended the call before the job started")
        shape = api.Shape(kind, first.job_id, self.model_name)
        if body.stream:
            return StreamingResponse(self._stream(call, first, shape, body.include_usage, metadata),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._collect(call, first))
        while not collect.done():                       # a client that goes away cancels its job
            await asyncio.wait({collect}, timeout=0.5)
            if not collect.done() and await request.is_disconnected():
                collect.cancel()
                self._cancel(call, first.job_id, metadata)
                return JSONResponse(api.ApiError(499, "client closed the request").body(), status_code=499)
        return JSONResponse(shape.response(collect.result()))

    async def _events(self, call, first: pb.JobEvent):
        yield first
        while True:
            try:
                ev = await call.read()
            except grpc.aio.AioRpcError as e:
                raise from_grpc(e) from None
            if ev is grpc.aio.EOF:
                raise api.ApiError(502, f"job {first.job_id}: the executor's stream ended without a result")
            yield ev
            kind = ev.WhichOneof("kind")
            if kind == "result":
                return
            if kind == "status" and ev.status.state in TERMINAL:
                if ev.status.HasField("result") and ev.status.state == pb.DONE:
                    yield pb.JobEvent(job_id=ev.job_id, attempt=ev.attempt, result=ev.status.result)
                    return
                raise _ended(ev.status)

    async def _collect(self, call, first: pb.JobEvent) -> pb.JobResult:
        async for ev in self._events(call, first):
            if ev.WhichOneof("kind") == "result":
                return ev.result
        raise api.ApiError(502, "no result")

    async def _stream(self, call, first: pb.JobEvent, shape: api.Shape, include_usage: bool, metadata: tuple):
        text, done = AttemptText(), False
        try:
            yield _sse(shape.chunk(first=True))
            async for ev in self._events(call, first):
                kind = ev.WhichOneof("kind")
                if kind == "delta":
                    new = text.feed(ev.attempt, ev.delta.text)
                    if new:
                        yield _sse(shape.chunk(new))
                elif kind == "result":
                    rest = text.finish(ev.result.text)
                    if rest:
                        yield _sse(shape.chunk(rest))
                    yield _sse(shape.last(ev.result))
                    if include_usage:
                        yield _sse(shape.usage_chunk(ev.result))
            done = True
        except api.ApiError as e:
            done = True
            yield _sse(e.body())
        except Diverged as e:
            done = True
            yield _sse(api.ApiError(500, f"job {first.job_id} was re-run and its text changed: {e}").body())
        finally:
            if not done:                                 # the client went away mid-stream
                self._cancel(call, first.job_id, metadata)
        yield _sse(b"[DONE]")

    def _cancel(self, call, job_id: str, metadata: tuple) -> None:
        """Stop the job of a client that went away: end the call (the executor's Generate cancels
        its job) and cancel the job by id, in a task of its own (this request's is cancelled)."""
        call.cancel()

        async def cancel() -> None:
            try:
                await self.stub.CancelJob(pb.JobRef(job_id=job_id), metadata=metadata, timeout=10)
                log.info("job %s: cancelled (the HTTP client went away)", job_id)
            except grpc.aio.AioRpcError as e:
                log.warning("job %s: cancel failed: %s", job_id, e.code().name)

        task = asyncio.get_running_loop().create_task(cancel())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)


def _ended(status: pb.JobStatus) -> api.ApiError:
    name = pb.JobState.Name(status.state)
    if status.state == pb.CANCELLED:
        return api.ApiError(409, f"job {status.job_id} was cancelled", code="job_cancelled")
    return api.ApiError(500, f"job {status.job_id} ended {name}: {status.error}", code="job_failed")


def create_app(cfg: HttpConfig, model_name: str) -> FastAPI:
    gw = Gateway(cfg, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.open()
        yield
        await gw.close()

    app = FastAPI(title="kvplan", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw

    @app.middleware("http")
    async def measure(request: Request, call_next):
        route, t0 = request.url.path, time.perf_counter()
        IN_FLIGHT.inc()
        try:
            response = await call_next(request)
        finally:
            IN_FLIGHT.dec()
        if route.startswith("/v1/"):
            REQUESTS.labels(route, str(response.status_code)).inc()
            SECONDS.labels(route).observe(time.perf_counter() - t0)
        return response

    @app.exception_handler(api.ApiError)
    async def api_error(request: Request, e: api.ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return JSONResponse(api.ApiError(400, message, param=param, code="invalid_value").body(), status_code=400)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        ok = await gw.healthy()
        return JSONResponse({"status": "ok" if ok else "executor unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": 0,
                                             "owned_by": "kvplan"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatBody, request: Request):
        gw.check_model(body.model)
        return await gw.answer(request, api.chat_request(body), body, "chat")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionBody, request: Request):
        gw.check_model(body.model)
        return await gw.answer(request, api.completion_request(body), body, "text")

    return app


def run(cfg: HttpConfig | None = None) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn's graceful stop: in-flight requests get `grace_s`)."""
    import uvicorn
    from kvplan.serving import configure_logging
    cfg = cfg or from_env(HttpConfig)
    configure_logging(cfg.log_level.upper())
    app = create_app(cfg, cfg.model_name(from_env(ModelConfig)))
    log.info("HTTP API on http://%s:%d/v1 over the executor at %s", cfg.host, cfg.port, cfg.executor_addr)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
                timeout_graceful_shutdown=int(cfg.grace_s), access_log=False)
    return 0
