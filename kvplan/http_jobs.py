"""One HTTP request's job over the executors (`kvplan.executor_pool`): started with `Generate` on
the next executor, followed until its result, answered as one JSON body or as server-sent
events, and cancelled when its client goes away — streaming or not.

A job lives in the job queue, not in the executor that took the request: when the stream of the
executor answering it breaks (it died), the request re-attaches with `WatchJob` on another
executor, which replays the job's events and waits for the rest wherever the job is re-run; a
re-run's text is not streamed twice (`kvplan.attempts`). Before issue 33 the stream ended in an
error while the job was re-run elsewhere for nobody.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from executor.validation import check_size
from kvcore.request import InvalidRequest
from kvplan import openai_api as api
from kvplan.attempts import AttemptItems, AttemptText, Diverged
from kvcore.config import HttpConfig
from kvplan.executor_pool import ExecutorPool
from kvplan.http_errors import from_grpc, job_ended
from kvplan.http_guard import report_status
from kvplan.http_keys import metadata
from kvcore.keyfile import printable
from kvplan.openai_errors import ApiError, bad
from kvplan.openai_shapes import Shape
from protos import executor_pb2 as pb

log = logging.getLogger("kvplan.gateway")
TERMINAL = (pb.DONE, pb.FAILED, pb.CANCELLED)
REATTACH = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
# A broken stream re-attaches (0.5 s, 1 s, 2 s, 4 s, then every 5 s) for this long: an executor's
# start time on a busy CPU, as long as `kvplan up` waits for one (KVPLAN_START_TIMEOUT_S), so a
# stream outlives its only executor's restart (six tries, 17.5 s, did not: issue 42).
REATTACH_S = 180.0
REPLAY = pb.JobEvent()          # `_events`' marker: the job's events start again (a re-attach)


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


@dataclass
class _Job:
    """One request's job and the call following it: `executor` is the index of the executor
    answering it now (it changes when the stream re-attaches elsewhere)."""
    job_id: str
    call: object
    executor: int
    metadata: tuple


class HttpJobs:
    """The HTTP API's side of the jobs: one per app, over every executor of KVPLAN_EXECUTOR_ADDR."""

    def __init__(self, cfg: HttpConfig, model_name: str):
        self.cfg, self.model_name = cfg, model_name
        self.pool = ExecutorPool(cfg.executor_addrs)
        self._cancels: set[asyncio.Task] = set()

    async def open(self) -> None:
        await self.pool.open()

    async def close(self) -> None:
        if self._cancels:
            await asyncio.wait(self._cancels, timeout=5)
        await self.pool.close()

    async def healthy(self) -> bool:
        return await self.pool.healthy()

    async def authenticate(self, request: Request) -> None:
        """The request's key is one the executors take (401 if not), for a route that starts no
        job (`/v1/models`): a `GetJob` of no job, which the executor's key check answers first —
        UNAUTHENTICATED for a bad key, else INVALID_ARGUMENT for the empty job id."""
        md = metadata(request)
        try:
            await self.pool.stubs[self.pool.next()].GetJob(pb.JobRef(job_id=""), metadata=md, timeout=10)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise from_grpc(e) from None

    def check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ApiError(404, f"The model {printable(model)} does not exist; this server serves "
                                    f"`{self.model_name}`", param="model", code="model_not_found")

    def check_size(self, req: pb.GenerateRequest) -> None:
        """The job's text within KVPLAN_MAX_PROMPT_BYTES, before it is sent (400 naming the field)."""
        try:
            check_size(req, self.cfg.max_prompt_bytes)
        except InvalidRequest as e:
            raise bad(api.PARAMS.get(e.field, e.field), str(e).removeprefix(e.field + ": ")) from None

    async def answer(self, request: Request, key: tuple, req: pb.GenerateRequest, body: api.RequestBody, kind: str):
        """Start the job with the request's `key` (`metadata`) — its errors are this request's
        HTTP error — then answer in one JSON body or as an SSE stream; a client that goes away
        cancels its job, streaming or not.

        A stream's response starts with the job's first token (its first chunk carries the role
        and that token's text), as vLLM's does: every refusal that comes before it — a budget the
        plan cannot hold, a strategy that cannot compress this model, found once the prompt is
        tokenized, planned or prefilled — is this request's HTTP error (400 in OpenAI's shape, so
        the `openai` client raises BadRequestError before any chunk), and a client's time to
        first chunk is its time to first token (the role chunk used to go out at once: a TTFT of
        62 ms for a first token 5 to 25 s later)."""
        job, first = await self._start(req, key)
        shape = Shape(kind, first.job_id, self.model_name, logprobs=req.HasField("top_logprobs"))
        events = self._events(job, first)
        if body.stream:
            head = await self._while_connected(request, job, self._head(events))
            if isinstance(head, JSONResponse):
                return head
            return StreamingResponse(self._stream(request, job, events, head, shape, body.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        got = await self._while_connected(request, job, self._collect(events))
        return got if isinstance(got, JSONResponse) else JSONResponse(shape.response(got))

    async def _while_connected(self, request: Request, job: _Job, work):
        """`work`'s value while the client stays; a client that went away cancels the job (499)."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    self._cancel(job)
                    return JSONResponse(ApiError(499, "client closed the request").body(), status_code=499)
        except asyncio.CancelledError:                  # the server is stopping this request
            task.cancel()
            self._cancel(job)
            raise
        return task.result()

    async def _start(self, req: pb.GenerateRequest, metadata: tuple) -> tuple[_Job, pb.JobEvent]:
        """Generate on the next executor; one that cannot be reached (UNAVAILABLE before the job
        exists) passes the request to the next."""
        first_choice = self.pool.next()
        order = [first_choice, *[i for i in self.pool.after(first_choice) if i != first_choice]]
        for n, i in enumerate(order):
            call = self.pool.stubs[i].Generate(req, metadata=metadata, timeout=self.cfg.timeout_s)
            try:
                first = await call.read()               # the QUEUED event: the job exists
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and n + 1 < len(order):
                    continue
                raise from_grpc(e) from None
            if first is grpc.aio.EOF:
                raise ApiError(502, "the executor ended the call before the job started")
            return _Job(first.job_id, call, i, metadata), first
        raise ApiError(503, "no executor answers")           # (not reached: the last one raised)

    async def _events(self, job: _Job, first: pb.JobEvent):
        """The job's events until its result. A stream that breaks while the job runs (the
        executor answering it went away) re-attaches with WatchJob on another executor, which
        replays the job's events: REPLAY marks where they start again."""
        yield first
        tries, broke = 0, 0.0
        while True:
            try:
                ev = await job.call.read()
            except grpc.aio.AioRpcError as e:
                broke = broke or time.monotonic()
                if e.code() not in REATTACH or time.monotonic() - broke > REATTACH_S:
                    raise from_grpc(e) from None
                tries += 1
                await asyncio.sleep(min(5.0, 0.25 * 2 ** tries))
                job.executor = self.pool.after(job.executor)[0]
                log.warning("job %s: stream broke (%s); re-attaching on %s", job.job_id, e.code().name,
                            self.pool.addresses[job.executor])
                job.call = self.pool.stubs[job.executor].WatchJob(pb.JobRef(job_id=job.job_id), metadata=job.metadata,
                                                                  timeout=self.cfg.timeout_s)
                yield REPLAY
                continue
            if ev is grpc.aio.EOF:
                raise ApiError(502, f"job {job.job_id}: the executor's stream ended without a result")
            tries, broke = 0, 0.0
            yield ev
            kind = ev.WhichOneof("kind")
            if kind == "result":
                return
            if kind == "status" and ev.status.state in TERMINAL:
                if ev.status.HasField("result") and ev.status.state == pb.DONE:
                    yield pb.JobEvent(job_id=ev.job_id, attempt=ev.attempt, result=ev.status.result)
                    return
                raise job_ended(ev.status)

    @staticmethod
    async def _collect(events) -> pb.JobResult:
        async for ev in events:
            if ev is not REPLAY and ev.WhichOneof("kind") == "result":
                return ev.result
        raise ApiError(502, "no result")

    @staticmethod
    async def _head(events) -> list[pb.JobEvent]:
        """The job's events up to its first token (or its result); a refusal before it raises."""
        head = []
        async for ev in events:
            head.append(ev)
            if ev is not REPLAY and ev.WhichOneof("kind") in ("delta", "result"):
                break
        return head

    async def _stream(self, request: Request, job: _Job, events, head: list, shape: Shape, include_usage: bool):
        text, tokens, done, first = AttemptText(), AttemptItems(), False, True

        async def every():
            for ev in head:
                yield ev
            async for ev in events:
                yield ev
        try:
            async for ev in every():
                if ev is REPLAY:
                    text.replay()
                    tokens.replay()
                    continue
                kind = ev.WhichOneof("kind")
                if kind == "delta":
                    new = text.feed(ev.attempt, ev.delta.text)
                    lps = tokens.feed(ev.attempt, list(ev.delta.logprobs))
                    if new or lps or first:              # (text held back by a stop sequence: its tokens still)
                        yield _sse(shape.chunk(new, first=first, logprobs=lps))
                        first = False
                elif kind == "result":
                    rest, lps = text.finish(ev.result.text), tokens.finish(list(ev.result.logprobs))
                    if rest or lps or first:
                        yield _sse(shape.chunk(rest, first=first, logprobs=lps))
                    yield _sse(shape.last(ev.result))
                    if include_usage:
                        yield _sse(shape.usage_chunk(ev.result))
            done = True
        except ApiError as e:
            done = True
            report_status(request.scope, e.status)
            yield _sse(e.body())
        except Diverged as e:
            done = True
            report_status(request.scope, 500)
            yield _sse(ApiError(500, f"job {job.job_id} was re-run and its text changed: {e}").body())
        finally:
            if not done:                                 # the client went away mid-stream
                self._cancel(job)
        yield _sse(b"[DONE]")

    def _cancel(self, job: _Job) -> None:
        """Stop the job of a client that went away: end the call (the executor's Generate cancels
        its job) and cancel the job by id, in a task of its own (this request's is cancelled)."""
        job.call.cancel()

        async def cancel() -> None:
            for i in [job.executor, *[i for i in self.pool.after(job.executor) if i != job.executor]]:
                try:
                    await self.pool.stubs[i].CancelJob(pb.JobRef(job_id=job.job_id), metadata=job.metadata, timeout=10)
                    log.info("job %s: cancelled (the HTTP client went away)", job.job_id)
                    return
                except grpc.aio.AioRpcError as e:
                    log.warning("job %s: cancel on %s failed: %s", job.job_id, self.pool.addresses[i], e.code().name)

        task = asyncio.get_running_loop().create_task(cancel())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)
