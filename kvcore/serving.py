"""Serving plumbing every kvplan service shares: grpc.aio server, health, reflection, metrics,
raised message limits, graceful shutdown on SIGTERM; API keys and TLS (`kvcore.auth`,
`kvcore.channels`)."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Histogram, start_http_server

from kvcore import auth, channels, keyfile
from kvcore.config import SecurityConfig, ServiceConfig, from_env

log = logging.getLogger("kvplan.serving")

RPCS = Counter("kvplan_rpcs_total", "RPCs handled", ["service", "method", "code"])
# 5 ms to 30 min: a streaming Generate lasts as long as its job (a long prefill alone takes seconds on a CPU).
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
RPC_SECONDS = Histogram("kvplan_rpc_seconds", "RPC handling time (streams: until their last message)",
                        ["service", "method"], buckets=SECONDS_BUCKETS)


def channel_options(max_message_mb: int = 256) -> list[tuple[str, int]]:
    """Message limits, and reconnects at most 2 s apart: a peer that died and came back is
    reached again within seconds (gRPC's default backoff grows to 120 s, and a caller's health
    said NOT_SERVING all that while)."""
    limit = max_message_mb << 20
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts RPCs by method and status code, and times them (a stream until it ends)."""

    def __init__(self, service: str):
        self.service = service

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        service = self.service

        def wrap_unary(fn):
            async def run(request, context):
                t0 = time.perf_counter()
                try:
                    return await fn(request, context)
                finally:
                    RPC_SECONDS.labels(service, method).observe(time.perf_counter() - t0)
                    RPCS.labels(service, method, _code_name(context)).inc()
            return run

        def wrap_stream(fn):
            async def run(request, context):
                t0 = time.perf_counter()
                try:
                    async for item in fn(request, context):
                        yield item
                finally:
                    RPC_SECONDS.labels(service, method).observe(time.perf_counter() - t0)
                    RPCS.labels(service, method, _code_name(context)).inc()
            return run

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:                  # (the key gate's refusals: they never read the request)
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer)
        return handler


def _code_name(context) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK" if code in (None, 0) else str(code)


@dataclass
class Service:
    """One kvplan service: its servicer registrations, its warm-up, and its names."""

    name: str                                   # e.g. "executor"
    full_names: list[str]                       # e.g. ["kvplan.v1.Executor"]
    register: Callable[[grpc.aio.Server], None]
    warmup: Callable[[], Awaitable[None]] | None = None
    stop: Callable[[], Awaitable[None]] | None = None
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)
    warm_task: asyncio.Task | None = None       # resolves to None when warm, or the warm-up's error


async def start(svc: Service, cfg: ServiceConfig, with_metrics: bool = True,
                security: SecurityConfig | None = None) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for `svc`; returns (server, bound port).

    Health reports NOT_SERVING until the service's warm-up is done; the warm-up runs in the
    background so a slow model load never hides the health endpoint. `security` (default: from
    the env): API keys checked by the `auth.Gate` interceptor, TLS from PEM files.
    """
    security = security or from_env(SecurityConfig)
    # no SO_REUSEPORT: a second server on a taken port fails, instead of sharing it unseen (grpc
    # sets SO_REUSEADDR itself, so a port in TIME_WAIT after `kvplan down` binds at once)
    options = [*channel_options(cfg.max_message_mb)[:1], ("grpc.max_receive_message_length", cfg.max_receive_bytes),
               ("grpc.so_reuseport", 0)]
    gate = auth.Gate(keyfile.keyring(security), cfg.max_request_bytes)
    server = grpc.aio.server(options=options, interceptors=[_MetricsInterceptor(svc.name), gate])
    svc.register(server)
    health_pb2_grpc.add_HealthServicer_to_server(svc.health, server)
    reflection.enable_server_reflection([reflection.SERVICE_NAME, health.SERVICE_NAME, *svc.full_names], server)
    creds = channels.server_credentials(security)
    port = server.add_secure_port(cfg.address, creds) if creds else server.add_insecure_port(cfg.address)
    for name in ["", *svc.full_names]:
        await svc.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    if with_metrics:
        start_http_server(cfg.metrics_port, addr=cfg.host)

    async def warm() -> Exception | None:
        try:
            if svc.warmup:
                await svc.warmup()
        except Exception as e:
            log.exception("%s failed to warm up; it stays NOT_SERVING", svc.name)
            return e
        for name in ["", *svc.full_names]:
            await svc.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s serving on %s:%d", svc.name, cfg.host, port)
        return None

    svc.warm_task = asyncio.create_task(warm())
    return server, port


async def set_health(svc: Service, serving: bool) -> None:
    """Report the whole server and each of its services SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *svc.full_names]:
        await svc.health.set(name, status)


async def shutdown(server: grpc.aio.Server, svc: Service, grace_s: float) -> None:
    await svc.health.enter_graceful_shutdown()
    if svc.warm_task and not svc.warm_task.done():
        svc.warm_task.cancel()
    await server.stop(grace_s)
    if svc.stop:
        await svc.stop()


async def serve_forever(svc: Service, cfg: ServiceConfig) -> int:
    """Run until SIGTERM/SIGINT, then stop gracefully: in-flight RPCs get `grace_s`.
    Returns the exit code: 1 when the warm-up failed (a supervisor should see it, not a
    process stuck in NOT_SERVING)."""
    server, _ = await start(svc, cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([stopper, svc.warm_task], return_when=asyncio.FIRST_COMPLETED)
    failed = svc.warm_task.done() and svc.warm_task.result() is not None
    if not failed:
        await stopper
    log.info("%s stopping (grace %.1fs)", svc.name, cfg.grace_s)
    await shutdown(server, svc, cfg.grace_s)
    return 1 if failed else 0


async def wait_serving(address: str, timeout_s: float, service: str = "") -> bool:
    """Poll grpc.health.v1 at `address` until SERVING or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    async with channels.aio_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    return False


def check_health(address: str, timeout_s: float = 2.0, service: str = "") -> str:
    """One synchronous health check: "SERVING", "NOT_SERVING", or "DOWN"."""
    with channels.client_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return "DOWN"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
