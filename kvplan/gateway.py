"""`kvplan serve http`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over the executor's
gRPC API.

    GET  /v1/models             the served model
    POST /v1/completions        prompt -> text (the text as it is, no chat template; SSE with "stream": true)
    POST /v1/chat/completions   messages -> assistant message (SSE with "stream": true)
    GET  /health                200 when the executor answers SERVING, else 503
    GET  /metrics               Prometheus

Each request is one executor `Generate` call (`kvplan.http_jobs`: the job goes through the job
queue, so it survives the executor that held it, and the request re-attaches to it on any
executor of KVPLAN_EXECUTOR_ADDR; a stream starts with the job's first token). The request's
`Authorization: Bearer` header travels as gRPC `authorization` metadata (a malformed one is 401
here). A body over KVPLAN_HTTP_MAX_BODY_BYTES is 413 and never parsed (`kvplan.http_guard`); bad
input is HTTP 400 in OpenAI's error shape naming the parameter, before any job exists — strict
JSON types, numbers within their fields' ranges, valid UTF-8, no field nobody knows
(`kvplan.openai_fields`) — and every error, Starlette's and HTTP's own included
(`kvplan.http_protocol`), has that shape with a bounded message (never a bare 500, never
`{"detail": ...}`). A client that goes away cancels its job, streaming or not. Request bodies:
`kvplan.openai_api`; response bodies: `kvplan.openai_shapes`; errors: `kvplan.openai_errors` (the
shape) and `kvplan.http_errors` (an executor's statuses).
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvplan import openai_api as api
from kvcore.config import HttpConfig, ModelConfig, from_env
from kvplan.http_guard import Guard
from kvplan.http_jobs import HttpJobs
from kvplan.http_keys import metadata
from kvplan.http_protocol import Protocol
from kvplan.openai_errors import ApiError

log = logging.getLogger("kvplan.gateway")


def create_app(cfg: HttpConfig, model_name: str) -> FastAPI:
    gw = HttpJobs(cfg, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.open()
        yield
        await gw.close()

    app = FastAPI(title="kvplan", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw
    app.add_middleware(Guard, max_body_bytes=cfg.max_body_bytes, drain_bytes=cfg.drain_bytes,
                       router=app.router)                         # 413 before a body is parsed; metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":          # its loc is a byte offset, not a field
            at = [x for x in err.get("loc", ()) if isinstance(x, int)]
            where = f" (at character {at[0]})" if at else ""
            return JSONResponse(ApiError(400, f"the body is not valid JSON{where}: {err.get('msg')}",
                                         code="invalid_json").body(), status_code=400)
        param = api.field_path(x for x in err.get("loc", ()) if x != "body") or None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return JSONResponse(ApiError(400, message, param=param, code="invalid_value").body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        """Starlette's own errors (a body that is no JSON or no UTF-8, an unknown route, a wrong
        method) in OpenAI's shape too, never `{"detail": ...}`."""
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        code = {400: "invalid_body", 404: "unknown_route", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(ApiError(e.status_code, message, code=code).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"internal error ({type(e).__name__})", code="internal_error").body(),
                            status_code=500)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        ok = await gw.healthy()
        return JSONResponse({"status": "ok" if ok else "executor unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        await gw.authenticate(request)                 # a key, as every /v1 route asks
        return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": 0,
                                             "owned_by": "kvplan"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatBody, request: Request):
        key = metadata(request)                        # a malformed key first: 401
        gw.check_model(body.model)
        req = api.chat_request(body)
        gw.check_size(req)
        return await gw.answer(request, key, req, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionBody, request: Request):
        key = metadata(request)
        gw.check_model(body.model)
        req = api.completion_request(body)
        gw.check_size(req)
        return await gw.answer(request, key, req, body, "text")

    return app


def run(cfg: HttpConfig | None = None) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn's graceful stop: in-flight requests get `grace_s`)."""
    import uvicorn
    from kvcore.serving import configure_logging
    cfg = cfg or from_env(HttpConfig)
    configure_logging(cfg.log_level.upper())
    app = create_app(cfg, cfg.model_name(from_env(ModelConfig)))
    log.info("HTTP API on http://%s:%d/v1 over the executor at %s", cfg.host, cfg.port, cfg.executor_addr)
    # uvicorn binds with SO_REUSEADDR: the port is free again at once after `kvplan down`
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(), http=Protocol,
                timeout_graceful_shutdown=int(cfg.grace_s), access_log=False)
    return 0
