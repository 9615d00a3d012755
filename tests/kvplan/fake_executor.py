"""A scripted executor on real gRPC (no model): `Generate` and `WatchJob` play a list of events
and may break the stream part-way with UNAVAILABLE, as an executor that dies would; every
call's metadata and request are recorded. For the gateway's, the SDK's and the CLI's handling
of re-runs, degraded results, auth headers and errors, without the cost of a model."""
from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import executor_pb2 as pb
from protos import executor_pb2_grpc

JOB = "job0"


def events(*attempts: tuple[int, list[str]], result: pb.JobResult | None = None) -> list[pb.JobEvent]:
    """The QUEUED status, then per (attempt, deltas) a RUNNING status and the deltas, then the result."""
    out = [pb.JobEvent(job_id=JOB, status=pb.JobStatus(job_id=JOB, state=pb.QUEUED))]
    for attempt, deltas in attempts:
        out.append(pb.JobEvent(job_id=JOB, attempt=attempt, status=pb.JobStatus(job_id=JOB, state=pb.RUNNING)))
        out += [pb.JobEvent(job_id=JOB, attempt=attempt, delta=pb.TokenDelta(text=d)) for d in deltas]
    if result is not None:
        out.append(pb.JobEvent(job_id=JOB, attempt=attempts[-1][0] if attempts else 1, result=result))
    return out


class Script(executor_pb2_grpc.ExecutorServicer):
    def __init__(self):
        self.events: list[pb.JobEvent] = []
        self.break_generate_after: int | None = None     # UNAVAILABLE after this many events
        self.reject: tuple[grpc.StatusCode, str] | None = None
        self.metadata: list[dict[str, str]] = []
        self.requests: list[pb.GenerateRequest] = []
        self.calls: list[str] = []
        self.cancelled: list[str] = []

    def _record(self, name: str, context) -> None:
        self.calls.append(name)
        self.metadata.append({k: v for k, v in context.invocation_metadata()})

    async def Generate(self, req, context):
        self._record("Generate", context)
        self.requests.append(req)
        if self.reject:
            await context.abort(*self.reject)
        for i, ev in enumerate(self.events):
            if self.break_generate_after is not None and i >= self.break_generate_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "executor went away")
            yield ev
            await asyncio.sleep(0.01)

    async def WatchJob(self, ref, context):
        self._record("WatchJob", context)
        for ev in self.events:
            yield ev

    async def GetJob(self, ref, context):
        """As the executor's: an empty job id is INVALID_ARGUMENT (the HTTP API's key check asks it)."""
        self._record("GetJob", context)
        if not ref.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id: must be 1 to 128 printable characters")
        return pb.JobStatus(job_id=ref.job_id, state=pb.RUNNING)

    async def CancelJob(self, ref, context):
        self._record("CancelJob", context)
        self.cancelled.append(ref.job_id)
        return pb.JobStatus(job_id=ref.job_id, state=pb.CANCELLED)


class FakeExecutor:
    """`with FakeExecutor() as fx: fx.address, fx.script` — a grpc.aio server in a thread."""

    def __init__(self, interceptors: list | None = None):
        self.script = Script()
        self.interceptors = interceptors
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> "FakeExecutor":
        self._thread.start()

        async def start():
            server = grpc.aio.server(interceptors=self.interceptors)
            executor_pb2_grpc.add_ExecutorServicer_to_server(self.script, server)
            self.health = health.aio.HealthServicer()
            await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self._server, port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        self.address = f"127.0.0.1:{port}"
        return self

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.run_coroutine_threadsafe(self.health.set("", status), self._loop).result(10)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def result(text: str, **kw) -> pb.JobResult:
    fields = dict(strategy="auto", plan_id="p", prompt_tokens=100, generated_tokens=len(text.split()),
                  kv_bytes=200, full_kv_bytes=1000, reserve_ratio=0.2, finish_reason="eos")
    fields.update(kw)
    return pb.JobResult(text=text, **fields)
