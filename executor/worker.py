"""The job worker: claim a job from the queue, plan it, run it, publish its events and result.

    claim -> RUNNING -> Plan() (or local fallback) -> prefill + decode in a thread
          -> result event -> DONE -> ack

A heartbeat keeps the claim alive and carries cancellation in; if another executor took the
job over (this one was presumed dead), the run stops and writes nothing.
"""
from __future__ import annotations

import asyncio
import logging
import threading

from prometheus_client import Counter, Histogram

from cachestore.handle import JobHandle, StoreUnavailable, Unavailable
from executor import prompt as prompts
from executor import validation
from executor.jobqueue import Claim, JobBackend
from executor.planner_client import PlannerClient
from executor.runner import Cancelled, Runner, RunResult, Sampling
from kvplan.config import ExecutorConfig
from planner.request import InvalidRequest
from protos import executor_pb2 as pb

log = logging.getLogger("kvplan.executor.worker")
JOBS = Counter("kvplan_executor_jobs_total", "jobs ended, by state", ["state"])
TOKENS = Counter("kvplan_executor_generated_tokens_total", "tokens generated")
PREFILL_S = Histogram("kvplan_executor_prefill_seconds", "prefill time per job")
DECODE_TPS = Histogram("kvplan_executor_decode_tokens_per_second", "decode speed per job",
                       buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500))

TERMINAL = (pb.DONE, pb.FAILED, pb.CANCELLED)


class LostClaim(Exception):
    """Another executor took the job over, or this one is shutting down: write nothing, and
    leave the queue entry un-acked so that a live executor re-claims it."""


class Worker:
    def __init__(self, cfg: ExecutorConfig, backend: JobBackend, runner: Runner, planner: PlannerClient,
                 executor_id: str, cachestore=None):
        """cachestore: opens a job's `JobHandle` (`cachestore.client.CachestoreClient`); None: offload
        plans keep their rows in this process."""
        self.cfg, self.backend, self.runner, self.planner = cfg, backend, runner, planner
        self.cachestore = cachestore
        self.executor_id = executor_id
        self._stopping = asyncio.Event()
        self._abandon = threading.Event()     # set at shutdown: stop the running job, keep it queued

    async def run_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                claim = await self.backend.claim(self.executor_id, block_ms=500)
                if claim is not None:
                    await self.process(claim)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker loop error; retrying")
                await asyncio.sleep(1.0)

    def stop(self) -> None:
        """Claim nothing new; the running job may finish."""
        self._stopping.set()

    def abandon(self) -> None:
        """Stop the running job now without ending it (another executor re-claims it)."""
        self._abandon.set()

    async def process(self, claim: Claim) -> None:
        job_id = claim.job_id
        raw_status, raw_req = await self.backend.status(job_id), await self.backend.request(job_id)
        if raw_status is None or raw_req is None:
            await self.backend.finish(claim, self.cfg.job_ttl_s)      # expired record: drop the entry
            return
        status = pb.JobStatus.FromString(raw_status)
        if status.state in TERMINAL:
            await self.backend.finish(claim, self.cfg.job_ttl_s)
            return
        status.attempts = claim.attempt
        if await self.backend.is_cancelled(job_id):
            return await self._end(claim, status, pb.CANCELLED)
        if claim.attempt > self.cfg.max_attempts:
            status.error = f"gave up after {self.cfg.max_attempts} attempts (executors lost mid-job)"
            return await self._end(claim, status, pb.FAILED)

        status.state, status.executor_id, status.generated_tokens = pb.RUNNING, self.executor_id, 0
        await self._publish_status(claim, status)
        log.info("job %s: running (attempt %d)", job_id, claim.attempt)
        try:
            result = await self._run(claim, pb.GenerateRequest.FromString(raw_req), status)
        except LostClaim:
            log.warning("job %s: dropping this run (%s)", job_id,
                        "executor shutting down" if self._abandon.is_set() else "taken over by another executor")
            return
        except Cancelled:
            return await self._end(claim, status, pb.CANCELLED)
        except InvalidRequest as e:
            status.error = str(e)
            return await self._end(claim, status, pb.FAILED)
        except Exception as e:
            log.exception("job %s failed", job_id)
            status.error = f"{type(e).__name__}: {e}"
            return await self._end(claim, status, pb.FAILED)
        status.result.CopyFrom(result)
        status.generated_tokens = result.generated_tokens
        await self.backend.append_event(job_id, pb.JobEvent(job_id=job_id, attempt=claim.attempt,
                                                            result=result).SerializeToString())
        await self._end(claim, status, pb.DONE, publish=False)
        TOKENS.inc(result.generated_tokens)
        PREFILL_S.observe(result.prefill_s)
        DECODE_TPS.observe(result.decode_tokens_per_s)

    async def _run(self, claim: Claim, req: pb.GenerateRequest, status: pb.JobStatus) -> pb.JobResult:
        lm = self.runner.lm
        checked = validation.check(req, self.cfg.default_max_new_tokens)
        prompt = prompts.build(lm.tokenizer, checked.messages, req.question)
        validation.check_length(prompt, checked.max_new_tokens, lm.max_context)
        outcome = await self.planner.plan(claim.job_id, req.tenant, req.strategy, req.budget, req.profile,
                                          len(prompt.context_ids), lm, prompt.context_ids,
                                          len(prompt.question_ids), checked.max_new_tokens)
        sampling = Sampling(checked.max_new_tokens, checked.temperature, checked.top_p, checked.seed)

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        stop_flag = threading.Event()
        counted = {"tokens": 0}

        def emit(kind: str, payload) -> None:                 # called from the model thread
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        async def pump() -> None:                              # keeps events in order
            while True:
                kind, payload = await events.get()
                if kind == "progress":
                    ev = pb.JobEvent(progress=pb.Progress(phase="prefill", done=payload[0], total=payload[1]))
                else:
                    counted["tokens"] += len(payload[1])
                    ev = pb.JobEvent(delta=pb.TokenDelta(text=payload[0], token_ids=payload[1]))
                ev.job_id, ev.attempt = claim.job_id, claim.attempt
                await self.backend.append_event(claim.job_id, ev.SerializeToString())
                events.task_done()

        lost = {"flag": False}

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
                if self._abandon.is_set() or not await self.backend.heartbeat(claim, self.executor_id):
                    lost["flag"] = True
                    stop_flag.set()
                    return
                if await self.backend.is_cancelled(claim.job_id):
                    stop_flag.set()
                status.generated_tokens = counted["tokens"]
                await self.backend.set_status(claim.job_id, status.SerializeToString())

        budget = _budget_ratio(req.budget, prompt.num_tokens)
        store = await self._open_store(claim, req, outcome.plan, prompt.num_tokens + checked.max_new_tokens)
        tasks = [asyncio.create_task(pump()), asyncio.create_task(heartbeat())]
        run: RunResult | None = None
        try:
            run = await asyncio.to_thread(self.runner.run, prompt, outcome.plan, sampling, emit, stop_flag.is_set,
                                          store=store, budget=budget)
            await events.join()
        except Cancelled:
            pass
        finally:
            for t in tasks:
                t.cancel()
            if store is not None:             # finished, failed or cancelled: the store drops the rows
                await asyncio.to_thread(store.release)
        if lost["flag"]:
            raise LostClaim()
        if run is None or run.finish_reason == "cancelled":
            raise Cancelled()
        return _result(run, outcome, self.executor_id, self.runner)

    async def _open_store(self, claim: Claim, req: pb.GenerateRequest, plan, max_tokens: int) -> JobHandle | None:
        """The job's cachestore handle when its plan offloads; an unreachable cachestore gives a
        failed handle (the job runs on its low-bit copy, degraded) — never a failed job."""
        if not plan.offload.enabled or self.cachestore is None:
            return None
        lm = self.runner.lm
        try:
            return await asyncio.to_thread(
                self.cachestore.open, req.tenant or "default", claim.job_id, lm.num_layers, lm.num_kv_heads,
                lm.head_dim, self.runner.storage_dtype, max_tokens, plan.offload.candidates)
        except StoreUnavailable as e:
            log.warning("job %s: cachestore unavailable (%s); running on the low-bit copy, degraded", claim.job_id, e)
            return Unavailable(str(e))

    async def _publish_status(self, claim: Claim, status: pb.JobStatus) -> None:
        await self.backend.set_status(claim.job_id, status.SerializeToString())
        await self.backend.append_event(claim.job_id, pb.JobEvent(
            job_id=claim.job_id, attempt=claim.attempt, status=status).SerializeToString())

    async def _end(self, claim: Claim, status: pb.JobStatus, state: int, publish: bool = True) -> None:
        status.state = state
        if publish:
            await self._publish_status(claim, status)
        else:
            await self.backend.set_status(claim.job_id, status.SerializeToString())
        await self.backend.finish(claim, self.cfg.job_ttl_s)
        JOBS.labels(pb.JobState.Name(state)).inc()
        log.info("job %s: %s%s", claim.job_id, pb.JobState.Name(state), f" ({status.error})" if status.error else "")


def _result(run: RunResult, outcome, executor_id: str, runner: Runner) -> pb.JobResult:
    kv, full = run.kv_bytes, run.full_kv_bytes
    return pb.JobResult(
        text=run.text, strategy=outcome.plan.strategy, plan_id=outcome.plan.plan_id,
        prompt_tokens=run.prompt_tokens, generated_tokens=len(run.token_ids),
        kv_bytes=kv, full_kv_bytes=full, reserve_ratio=kv / full if full else 0.0,
        prefill_s=run.prefill_s, decode_s=run.decode_s,
        prefill_tokens_per_s=run.prompt_tokens / run.prefill_s if run.prefill_s else 0.0,
        decode_tokens_per_s=run.decode_steps / run.decode_s if run.decode_s else 0.0,
        degraded=outcome.degraded or run.degraded, finish_reason=run.finish_reason, executor_id=executor_id,
        storage_dtype=str(runner.storage_dtype).removeprefix("torch."),
        per_layer=[pb.LayerStats(layer=x.layer, kept_tokens=x.kept_tokens, kv_bytes=x.kv_bytes,
                                 full_kv_bytes=x.full_kv_bytes, kind=x.kind) for x in run.layers],
        offload=_offload_stats(run.offload),
    )


def _offload_stats(report: dict | None) -> pb.OffloadStats | None:
    if report is None:
        return None
    part, st = report["part"], report["stats"]
    return pb.OffloadStats(
        transport=report["transport"], low_bits=part["low_bits"], group_size=part["group_size"], top_k=part["top_k"],
        recent_window=part["recent_window"], host_kv_bytes=st["bytes_put"], prefetches=st["prefetches"],
        in_time=st["in_time"], late=st["late"], bytes_fetched=st["bytes_fetched"], stall_s=st["stall_s"],
        error=report["error"], rerank=part["rerank"])


def _budget_ratio(budget: pb.Budget, prompt_tokens: int) -> float | None:
    """The job's budget as a reserve ratio (what an offload part is fitted to); None: unset."""
    kind = budget.WhichOneof("kind")
    if kind == "reserve_ratio":
        return budget.reserve_ratio
    if kind == "kv_tokens" and prompt_tokens:
        return budget.kv_tokens / prompt_tokens
    return None
