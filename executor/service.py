"""Executor service: Generate (stream), SubmitJob, GetJob, WatchJob, CancelJob.

Every job goes through the job queue (Generate is SubmitJob + WatchJob), so a job is never
lost with the executor that took the request.

A job's tenant is the caller's API key's (`kvcore.auth`); another tenant's job is NOT_FOUND.
Limits come before work: the text's size before tokenizing, every number before queueing, the
tenant's rate before either, and the queue's bounds (RESOURCE_EXHAUSTED with `retry-after`
metadata) with the write. An unreachable Redis answers UNAVAILABLE after `redis_retry_s`, and
health says NOT_SERVING until it is back (`executor.watchdog`). Jobs are claimed fairly across
tenants (`executor.fairness`), each tenant weighted as the keys file says.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from cachestore.client import CachestoreClient
from executor import prompt as prompts
from executor import validation, watchdog
from executor.job_backend import PATIENCE, Limits, QueueFull, QueueUnavailable
from executor.jobqueue import open_backend
from executor.planner_client import PlannerClient
from executor.prompt import Prompt
from executor.engine import KVBudget, LLMEngine, OverBudget, Sampling
from executor.engine.kv_budget import default_budget
from executor.worker import TERMINAL, Worker
from kvcore import threads
from kvcore.auth import Denied, acting_tenant, caller
from kvcore.keyfile import KeyRing
from kvcore.model import load as load_model
from kvcore.config import ExecutorConfig, ModelConfig, SecurityConfig, from_env
from kvcore.plan import full_plan
from kvcore.serving import Service
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc

log = logging.getLogger("kvplan.executor")


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, cfg: ExecutorConfig, model_cfg: ModelConfig):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.executor_id = cfg.executor_id or f"{socket.gethostname()}-{os.getpid()}"
        sec = from_env(SecurityConfig)                      # the tenants' weights in fair claiming
        ring = KeyRing(sec.keys_file) if sec.auth_on and sec.keys_file else None
        self.backend = open_backend(cfg.redis_url, claim_idle_ms=cfg.claim_idle_ms,
                                    max_connections=cfg.redis_max_connections, pool_timeout_s=cfg.redis_pool_timeout_s,
                                    weight=ring.weight if ring is not None else None)
        self.planner = PlannerClient(cfg.planner_addr, cfg.plan_deadline_s, cfg.plan_deadline_per_1k_s)
        self.engine: LLMEngine | None = None
        self.worker: Worker | None = None
        self.cachestore: CachestoreClient | None = None
        self._worker_task: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def warmup(self) -> None:
        # the event loop's helper threads (loading, tokenizing, statistics to the wire) run torch on
        # one thread each: the engine thread's OpenMP team is the process's only one (kvcore/threads.py)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="kvplan-helper", initializer=threads.one))
        await self.backend.open()
        lm = await asyncio.to_thread(load_model, self.model_cfg)
        self.engine = await asyncio.to_thread(self._engine, lm)
        self.cachestore = CachestoreClient(self.cfg.cachestore_addr, self.cfg.cachestore_transport)
        self.worker = Worker(self.cfg, self.backend, self.engine, self.planner, self.executor_id, self.cachestore)
        self._worker_task = asyncio.create_task(self.worker.run_forever())
        log.info("executor %s ready (model %s, queue %s)", self.executor_id, lm.path.name,
                 "redis" if self.cfg.redis_url else "in-process")

    async def stop(self) -> None:
        if self.worker:
            self.worker.stop()
        if self._worker_task:
            try:      # the running job gets the grace period to finish ...
                await asyncio.wait_for(asyncio.shield(self._worker_task), self.cfg.grace_s)
            except asyncio.TimeoutError:
                self.worker.abandon()         # ... then stops un-acked: another executor re-claims it
                await asyncio.wait({self._worker_task}, timeout=30)
        await self.planner.close()
        if self.cachestore is not None:
            self.cachestore.close()
        await self.backend.close()

    def _engine(self, lm) -> LLMEngine:
        """The engine under the configured KV budget (default: a share of the memory available
        now); logged with how many full-KV 4k jobs it holds, as vLLM logs its concurrency."""
        cfg, dtype = self.cfg, getattr(torch, self.model_cfg.storage_dtype)
        budget = KVBudget(cfg.kv_budget_bytes or default_budget(cfg.kv_budget_share))
        engine = LLMEngine(lm, dtype, budget, cfg.max_batched_tokens, cfg.max_seqs, cfg.prefill_chunk,
                           cfg.prefetch_wait_s, tenant_weight=self.backend.fair.weight)   # the queue's weights
        full_4k = engine.reservation(full_plan(lm.num_layers, "sizing"), Prompt(list(range(4096)), []), Sampling(1))
        log.info("KV budget %.2f GiB%s: %d full-KV 4k-token jobs at once (at most %d jobs)", budget.total / 2**30,
                 "" if cfg.kv_budget_bytes else f" ({cfg.kv_budget_share:.0%} of the memory available)",
                 budget.total // full_4k, cfg.max_seqs)
        return engine

    def _check_budget(self, prompt, checked, strategy: str) -> None:
        """A job the whole KV budget could never hold fails now (`OverBudget`, RESOURCE_EXHAUSTED):
        whatever its plan, its prefill holds its dense context; under `full`, its whole job."""
        whole = strategy == "full"
        need = self.engine.reservation(full_plan(self.engine.lm.num_layers, "sizing"),
                                       prompt if whole else Prompt(prompt.context_ids, []),
                                       Sampling(checked.max_new_tokens if whole else 1))
        self.engine.budget.check_fits_at_all(need)

    # -- RPCs -------------------------------------------------------------------------------
    async def SubmitJob(self, req: pb.GenerateRequest, context) -> pb.JobStatus:
        async with self._errors(context):
            return await self._submit(req, context)

    async def GetJob(self, ref: pb.JobRef, context) -> pb.JobStatus:
        async with self._errors(context):
            return await self._status(ref, context)

    async def CancelJob(self, ref: pb.JobRef, context) -> pb.JobStatus:
        async with self._errors(context):
            status = await self._status(ref, context)
            if status.state in TERMINAL:
                return status
            await self.backend.cancel(ref.job_id)
            if status.state == pb.QUEUED:     # no executor has it yet: cancel right away
                status.state = pb.CANCELLED
                await self.backend.set_status(ref.job_id, status.SerializeToString())
                await self.backend.append_event(ref.job_id, pb.JobEvent(
                    job_id=ref.job_id, status=status).SerializeToString())
            return status

    async def WatchJob(self, ref: pb.JobRef, context):
        async with self._errors(context):
            await self._status(ref, context)       # NOT_FOUND for unknown jobs
            async for ev in self._follow(ref.job_id):
                yield ev

    async def Generate(self, req: pb.GenerateRequest, context):
        async with self._errors(context):
            status = await self._submit(req, context)
            finished = False
            try:
                async for ev in self._follow(status.job_id):
                    yield ev
                finished = True
            finally:
                if not finished:                   # the client went away: don't burn CPU for nobody
                    with contextlib.suppress(QueueUnavailable):
                        await self.backend.cancel(status.job_id)

    # -- helpers ------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _errors(self, context):
        """The statuses of the queue's failures; Redis calls in this RPC retry `redis_retry_s`."""
        PATIENCE.set(self.cfg.redis_retry_s)
        try:
            yield
        except QueueUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; retry")
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry after {e.retry_after_s}s",
                                trailing_metadata=(("retry-after", str(e.retry_after_s)),))

    @property
    def limits(self) -> Limits:
        return Limits(self.cfg.max_queued, self.cfg.max_queued_per_tenant, self.cfg.tenant_rate_per_min)

    async def _submit(self, req: pb.GenerateRequest, context) -> pb.JobStatus:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor is warming up (loading the model)")
        try:
            tenant = acting_tenant(req.tenant, "default")
            validation.check_size(req, self.cfg.max_prompt_bytes)               # before any tokenizing
            lm = self.engine.lm
            checked = validation.check(req, self.cfg.default_max_new_tokens, lm.max_context)
            await self.backend.room(tenant, self.limits)                          # the queue's bounds, a first look
            await self.backend.admit(tenant, self.limits)                         # the tenant's rate
            validation.check_strategy(req.strategy, await self.planner.strategies())
            prompt = await asyncio.to_thread(prompts.build, lm.tokenizer, checked.messages, req.question, checked.raw)
            validation.check_length(prompt, checked.max_new_tokens, lm.max_context)
            self._check_budget(prompt, checked, req.strategy)
        except OverBudget as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Denied as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:                                                   # InvalidRequest among them
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        req.tenant = tenant                                                       # the key's, for the worker
        job_id = uuid.uuid4().hex
        status = pb.JobStatus(job_id=job_id, state=pb.QUEUED, submitted_at=time.time())
        await self.backend.submit(job_id, req.SerializeToString(), status.SerializeToString(), tenant, self.limits,
                                  cost=prompt.num_tokens + checked.max_new_tokens)
        await self.backend.append_event(job_id, pb.JobEvent(job_id=job_id, status=status).SerializeToString())
        log.info("job %s: queued for tenant %s (%d prompt tokens)", job_id, tenant, prompt.num_tokens)
        return status

    async def _status(self, ref: pb.JobRef, context) -> pb.JobStatus:
        """The job's status; NOT_FOUND for an unknown job and for another tenant's (but an admin's)."""
        if not ref.job_id or len(ref.job_id) > 128 or not ref.job_id.isprintable():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id: must be 1 to 128 printable characters")
        raw = await self.backend.status(ref.job_id)
        who = caller()
        if raw is None or (who.role != "admin" and await self.backend.tenant(ref.job_id) != who.tenant):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no job {ref.job_id!r} (unknown or expired)")
        return pb.JobStatus.FromString(raw)

    async def _follow(self, job_id: str):
        """Replay the job's events, then follow them until the job ends."""
        after, idle_checks = "0", 0
        while True:
            batch = await self.backend.events(job_id, after, block_ms=1000)
            for eid, raw in batch:
                after = eid
                ev = pb.JobEvent.FromString(raw)
                yield ev
                if ev.WhichOneof("kind") == "result" or (
                        ev.WhichOneof("kind") == "status" and ev.status.state in TERMINAL):
                    return
            if batch:
                idle_checks = 0
                continue
            raw_status = await self.backend.status(job_id)
            if raw_status is None:
                return                                  # expired while watching
            status = pb.JobStatus.FromString(raw_status)
            if status.state in TERMINAL:
                idle_checks += 1
                if idle_checks > 1:                     # its final event is gone (expired log)
                    yield pb.JobEvent(job_id=job_id, attempt=status.attempts, status=status)
                    return


def build_service(cfg: ExecutorConfig, model_cfg: ModelConfig) -> Service:
    servicer = ExecutorServicer(cfg, model_cfg)
    watcher: list[asyncio.Task] = []

    async def warmup() -> None:
        await servicer.warmup()
        watcher.append(asyncio.create_task(watchdog.watch(servicer.backend, svc)))

    async def stop() -> None:
        for task in watcher:
            task.cancel()
        await servicer.stop()

    svc = Service(
        name="executor", full_names=["kvplan.v1.Executor"],
        register=lambda server: executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server),
        warmup=warmup, stop=stop,
    )
    return svc
