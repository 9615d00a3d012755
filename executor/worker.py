"""The job worker: intake for the engine. Claims jobs while the engine has room, plans each one,
hands it to the engine as a sequence, and publishes its events and result; one loop steps the
engine, which runs every admitted job at once.

    claim -> RUNNING -> validate, tokenize -> Plan() (or the local fallback) -> engine.add
    engine loop: step() in a thread while there is work; a finished sequence -> result -> DONE -> ack
    jobs wait for bytes: the dense running jobs re-planned at the load's ratio -> engine.shrink

A heartbeat per job keeps its claim alive and carries cancellation in; if another executor took
the job over (this one was presumed dead) or this one is shutting down, the job stops and
writes nothing, its queue entry left un-acked for a live executor to re-claim. While Redis is
unreachable a running job goes on: the engine keeps stepping, its events wait in order in its
queue, and its queue calls wait for Redis (docs/operations.md, Redis outages)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

from cachestore.handle import StoreUnavailable, Unavailable
from executor import prompt as prompts
from executor import validation
from executor.engine import LLMEngine, OverBudget, Sampling, Sequence
from executor.engine.result import run_result
from executor.job_backend import PATIENCE, Claim, JobBackend, QueueUnavailable
from executor.metrics import JOBS, QUEUE_DEPTH, REFUSED, observe_finished, observe_usage
from executor.planner_client import PRECHECK_TOKENS, PlanOutcome, PlannerClient
from executor.report import job_result, token_logprobs
from kvcore import statistics, threads
from kvcore.statistics import LayerStatistics
from kvcore.config import ExecutorConfig
from kvcore.request import InvalidRequest
from protos import executor_pb2 as pb
from protos import planner_pb2

log = logging.getLogger("kvplan.executor.worker")

TERMINAL = (pb.DONE, pb.FAILED, pb.CANCELLED)
MAX_PLANNING = 2          # jobs claimed and being planned, or admitted-but-waiting, at once
IDLE_WAIT_S = 0.05        # an engine with nothing runnable looks again after this, or at news
INTAKE_PATIENCE_S = 5.0   # how long a claim retries an unreachable Redis before the loop looks again
TENANT_ACTIVE_S = 60.0    # a tenant with a job here this recently shares the slots (KVPLAN_TENANT_MAX_SHARE)


@dataclass
class Job:
    """One claimed job while this executor has it."""
    claim: Claim
    status: pb.JobStatus
    outcome: PlanOutcome | None = None
    seq: Sequence | None = None
    stop: threading.Event = field(default_factory=threading.Event)    # read by the engine thread
    lost: bool = False
    failed: bool = False                          # stopped by an error of its own (status.error says it)
    tokens: int = 0
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: list = field(default_factory=list)
    plan_call: object = None                      # the Plan call, its job's fields bound (token_ids= or stats=)
    stats: object = None                          # the PlanStatistics its prefill gathered, kept for a shrink's plan
    shrink_asked: int = 0                         # jobs sharing the budget when a shrink's plan was last asked
    request: pb.GenerateRequest | None = None
    max_tokens: int = 0


class Worker:
    def __init__(self, cfg: ExecutorConfig, backend: JobBackend, engine: LLMEngine, planner: PlannerClient,
                 executor_id: str, cachestore=None):
        """cachestore: opens a job's `JobHandle` (`cachestore.client.CachestoreClient`); None: offload
        plans keep their rows in this process."""
        self.cfg, self.backend, self.engine, self.planner = cfg, backend, engine, planner
        self.lm = engine.lm
        self.cachestore, self.executor_id = cachestore, executor_id
        self.jobs: dict[str, Job] = {}
        self._stopping = asyncio.Event()
        self._work = threading.Event()           # set when the engine has something new (from any thread)
        self._halt = threading.Event()           # the engine thread ends at its next look
        self._depth = 0                          # jobs waiting or running in the queue, as last counted
        self._tenant_seen: dict[str, float] = {}  # tenant -> when it last had a job here (monotonic)


    # -- the loops ------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        """Claim and run jobs until `stop()`; then until the running jobs ended (or were abandoned)."""
        # Every step on one thread of its own, stepping back to back while there is work: torch's
        # OpenMP team belongs to the thread that calls it (a step hopping between pool threads left
        # idle teams spinning against the working one: docs/benchmarks.md, "Figures behind the
        # code"), and a step never waits for this event loop to hand it the next one.
        stepper = threading.Thread(target=self._step_forever, args=(asyncio.get_running_loop(),),
                                   name="kvplan-engine", daemon=True)
        stepper.start()
        try:
            await self._intake()
            while self.jobs:
                await asyncio.sleep(0.05)
        finally:
            self._halt.set()
            self._work.set()

    async def _intake(self) -> None:
        PATIENCE.set(INTAKE_PATIENCE_S)           # a claim waits this long for Redis, so stop() is heard
        counted = 0.0
        while not self._stopping.is_set():
            try:
                if time.monotonic() - counted > 1.0:
                    self._depth = await self.backend.depth()
                    QUEUE_DEPTH.set(self._depth)
                    counted = time.monotonic()
                if not self._room():
                    await asyncio.sleep(0.05)
                    continue
                full = self._full_tenants()
                claim = await self.backend.claim(self.executor_id, block_ms=100 if full else 500, exclude=full)
                if claim is not None:
                    asyncio.create_task(self._start(claim))
            except asyncio.CancelledError:
                raise
            except QueueUnavailable as e:
                log.warning("job queue unreachable (%s); retrying", e)
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("intake error; retrying")
                await asyncio.sleep(1.0)

    def _room(self) -> bool:
        """Whether to claim another job: the engine runs fewer than it may, and few claimed jobs
        wait for bytes or a plan (the rest stay in the queue for other executors)."""
        waiting = sum(1 for j in self.jobs.values() if j.seq is None or j.seq.t_admitted is None)
        return len(self.jobs) < self.cfg.max_seqs and waiting < MAX_PLANNING

    def _full_tenants(self) -> frozenset[str]:
        """Tenants holding their share of this executor's job slots (KVPLAN_TENANT_MAX_SHARE of
        KVPLAN_MAX_SEQS) while other tenants use it too (had a job here in the last
        TENANT_ACTIVE_S): their waiting jobs are left in the queue, so the slots left stay free
        for the others — a tenant that floods the queue cannot take every slot and make the next
        tenant's job wait for one of its jobs to end (issue 33). A tenant alone may take them all."""
        now = time.monotonic()
        held: dict[str, int] = {}
        for job in self.jobs.values():
            held[job.claim.tenant] = held.get(job.claim.tenant, 0) + 1
            self._tenant_seen[job.claim.tenant] = now
        for tenant in [t for t, seen in self._tenant_seen.items() if now - seen > TENANT_ACTIVE_S]:
            del self._tenant_seen[tenant]
        if len(self._tenant_seen) < 2:
            return frozenset()
        return frozenset(t for t, n in held.items() if n >= self.cfg.tenant_max_jobs)

    def _step_forever(self, loop: asyncio.AbstractEventLoop) -> None:
        """The engine thread: step while there is work; after each step its metrics, and what the
        event loop does with it (`_after_step`), handed over without waiting for it. torch's
        threads are this thread's (`kvcore.threads`)."""
        log.info("engine thread: %d torch threads", threads.own())
        while not self._halt.is_set():
            if not self.engine.has_work():
                self._work.wait(1.0)          # news sets it; the second is a safety net
                self._work.clear()
                continue
            self._work.clear()
            try:
                finished = self.engine.step()
            except Exception:
                log.exception("engine step failed; failing its jobs")
                finished = self._fail_running()
            observe_usage(self.engine)
            blocked = self.engine.blocked()
            try:
                loop.call_soon_threadsafe(self._after_step, finished, blocked)
            except RuntimeError:                   # the loop is closed: the executor is gone
                return
            if not self.engine.stats.last[0] and not finished:
                # nothing could run (jobs wait for a plan, or for room): wait for news, do not spin
                self._work.wait(IDLE_WAIT_S)

    def _after_step(self, finished: list[Sequence], blocked: list[Sequence]) -> None:
        """On the event loop, after a step: room asked for the blocked jobs, the finished ones completed."""
        self._make_room(blocked)
        for seq in finished:
            job = self.jobs.get(seq.job_id)
            if job is not None:
                asyncio.create_task(self._complete(job))

    def stop(self) -> None:
        """Claim nothing new; the running jobs may finish."""
        self._stopping.set()

    def abandon(self) -> None:
        """Stop every running job now without ending it (another executor re-claims it)."""
        for job in self.jobs.values():
            job.lost = True
            job.stop.set()
        self._work.set()

    # -- one job --------------------------------------------------------------------------------
    async def _start(self, claim: Claim) -> None:
        # A job's own queue calls wait for an unreachable Redis to come back (the backend's patience),
        # not the intake's few seconds this task was created with: its events queue up in order
        # while the engine goes on stepping, and are written when Redis answers again. With the
        # intake's patience a Redis outage of 5 s dropped every running job's run, and each was run
        # again from its start (issue 42).
        PATIENCE.set(None)
        job_id = claim.job_id
        if job_id in self.jobs:
            # this executor's own claim came back to it (XAUTOCLAIM): Redis was away longer than the
            # lease while the job ran here; the run goes on, its heartbeat holds the claim again
            log.info("job %s: re-claimed while it runs here (Redis was away past its lease); it goes on", job_id)
            return
        raw_status, raw_req = await self.backend.status(job_id), await self.backend.request(job_id)
        if raw_status is None or raw_req is None:
            await self.backend.finish(claim, self.cfg.job_ttl_s)      # expired record: drop the entry
            return
        status = pb.JobStatus.FromString(raw_status)
        job = Job(claim, status)
        if status.state in TERMINAL:
            await self.backend.finish(claim, self.cfg.job_ttl_s)
            return
        status.attempts = claim.attempt
        if await self.backend.is_cancelled(job_id):
            return await self._end(job, pb.CANCELLED)
        if claim.attempt > self.cfg.max_attempts:
            status.error = f"gave up after {self.cfg.max_attempts} attempts (executors lost mid-job)"
            return await self._end(job, pb.FAILED)
        self.jobs[job_id] = job
        status.state, status.executor_id, status.generated_tokens = pb.RUNNING, self.executor_id, 0
        await self._publish_status(job)
        log.info("job %s: running (attempt %d)", job_id, claim.attempt)
        job.tasks = [asyncio.create_task(self._pump(job)), asyncio.create_task(self._heartbeat(job))]
        try:
            job.seq = await self._sequence(job, pb.GenerateRequest.FromString(raw_req))
        except (InvalidRequest, OverBudget) as e:
            job.status.error = str(e)
            job.status.error_field = getattr(e, "field", "")     # bad input: the field at fault
            return await self._close(job, pb.FAILED)
        except Exception as e:
            log.exception("job %s failed before it ran", job_id)
            job.status.error = f"{type(e).__name__}: {e}"
            return await self._close(job, pb.FAILED)
        self.engine.add(job.seq)
        self._work.set()

    async def _sequence(self, job: Job, req: pb.GenerateRequest) -> Sequence:
        lm, job_id = self.lm, job.claim.job_id
        checked = validation.check(req, self.cfg.default_max_new_tokens, lm.max_context)
        prompt = await asyncio.to_thread(prompts.build, lm.tokenizer, checked.messages, req.question, checked.raw)
        validation.check_length(prompt, checked.max_new_tokens, lm.max_context)
        sampling = Sampling(checked.max_new_tokens, checked.temperature, checked.top_p, checked.seed,
                            ignore_eos=req.ignore_eos, stop=checked.stop, logprobs=checked.top_logprobs,
                            min_tokens=checked.min_tokens)
        job.plan_call = functools.partial(self.planner.plan, job_id, req.tenant, req.strategy, req.budget, req.profile,
                                          len(prompt.context_ids), lm, suffix_tokens=len(prompt.question_ids),
                                          new_tokens=checked.max_new_tokens)
        info = await self.planner.strategy_for(req.strategy, req.budget) if self.cfg.plan_from_prefill else None
        statistics = LayerStatistics(info.probe_mode, info.probe_losses, shares=False) \
            if info and info.probe_mode else None                   # (the similar-row shares: no plan reads them)
        plan, store = None, None
        if statistics is not None and req.budget.WhichOneof("kind") in ("reserve_ratio", "kv_tokens"):
            # the plan waits for the prefill's statistics: a budget no plan can hold is refused first
            # (planner.precheck), not after the prefill; an unreachable planner is no refusal
            await job.plan_call(token_ids=prompt.context_ids[:PRECHECK_TOKENS], precheck=True)
        if statistics is None:                        # the plan first: its strategy needs nothing of the prefill
            job.outcome = await job.plan_call(token_ids=prompt.context_ids, load=await self._load(job))
            plan = job.outcome.plan
            store = await self._open_store(job, req, plan, prompt.num_tokens + checked.max_new_tokens)
        job.request, job.max_tokens = req, prompt.num_tokens + checked.max_new_tokens
        loop = asyncio.get_running_loop()

        def emit(kind: str, payload) -> None:                 # called from the engine thread
            loop.call_soon_threadsafe(job.events.put_nowait, (kind, payload))

        try:
            ratio = plan.budget_ratio if plan is not None and plan.budget_reason else \
                _budget_ratio(req.budget, prompt.num_tokens)
            return self.engine.sequence(prompt, plan, sampling, emit=emit, cancelled=job.stop.is_set, store=store,
                                        ratio=ratio, job_id=job_id, tenant=job.claim.tenant,
                                        statistics=statistics)
        except Exception:
            if store is not None:
                await asyncio.to_thread(store.release)
            raise

    async def _pump(self, job: Job) -> None:
        """The job's events, in order, into its event log. An event that cannot be written loses
        the job here (its entry stays un-acked for a re-claim); the queue still drains, so its
        end is never waited on forever."""
        planning = None                               # the plan its own prefill's statistics asked for
        while True:
            kind, payload = await job.events.get()
            try:
                if kind == "context":                 # its context is prefilled: plan it from what that gathered
                    planning = asyncio.create_task(self._plan_after(job, payload))
                    job.tasks.append(planning)
                    continue
                if kind == "delta" and planning is not None:
                    try:                              # the first token waits for the plan: a job its plan
                        await asyncio.shield(planning)    # refuses streams no text before its error
                    except asyncio.CancelledError:
                        if not planning.cancelled():  # this pump is cancelled, not the planning
                            raise
                    planning = None
                    if job.failed:
                        continue
                if kind == "progress":
                    ev = pb.JobEvent(progress=pb.Progress(phase="prefill", done=payload[0], total=payload[1]))
                else:
                    job.tokens += len(payload[1])
                    text, ids, lps = payload
                    ev = pb.JobEvent(delta=pb.TokenDelta(text=text, token_ids=ids,
                                                         logprobs=token_logprobs(self.lm.tokenizer, zip(ids, lps))))
                ev.job_id, ev.attempt = job.claim.job_id, job.claim.attempt
                if not job.lost:
                    await self.backend.append_event(job.claim.job_id, ev.SerializeToString())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job %s: its events cannot be written; dropping this run", job.claim.job_id)
                job.lost = True
                job.stop.set()
            finally:
                job.events.task_done()

    async def _plan_after(self, job: Job, stats) -> None:
        """The plan of a job whose statistics its own prefill gathered; then the engine compresses it."""
        try:
            msg = await asyncio.to_thread(statistics.to_proto, stats)
            job.outcome = await job.plan_call(stats=msg, load=await self._load(job))
            job.stats = msg
        except asyncio.CancelledError:
            raise
        except Exception as e:                        # refused, or the planner failed: the job fails, says why
            (log.info if isinstance(e, InvalidRequest) else log.warning)(    # a refusal is the job's answer
                "job %s: no plan for its statistics (%s)", job.claim.job_id, e)
            job.status.error = str(e) if isinstance(e, InvalidRequest) else f"planning failed: {type(e).__name__}: {e}"
            job.status.error_field = e.field if isinstance(e, InvalidRequest) else ""
            job.failed = True
            job.stop.set()
            self._work.set()
            return
        store = await self._open_store(job, job.request, job.outcome.plan, job.max_tokens)
        self.engine.apply_plan(job.seq, job.outcome.plan, store)
        self._work.set()

    def _make_room(self, blocked: list[Sequence]) -> None:
        """Jobs wait for bytes (`blocked`: the engine's dense running jobs that could shrink): ask the
        planner for a lower plan of each planned adaptively at 1.0 above its floor (compress instead
        of preempt) — once per job while the jobs sharing the budget stay as many; it asks again
        when more come."""
        sharing = self._sharing()
        for seq in blocked:
            job = self.jobs.get(seq.job_id)
            if job is None or job.stats is None or job.shrink_asked >= sharing or not _may_shrink(job):
                continue
            job.shrink_asked = sharing
            job.tasks.append(asyncio.create_task(self._shrink(job)))

    async def _shrink(self, job: Job) -> None:
        """A running dense job's plan at the ratio the load now calls for, from the statistics it
        sent; the engine rebuilds its cache under it between steps when it is lower."""
        try:
            outcome = await job.plan_call(stats=job.stats, load=await self._load(job))
        except asyncio.CancelledError:
            raise
        except Exception as e:                        # it goes on dense; the waiting jobs wait
            log.warning("job %s: no plan to shrink it to (%s)", job.claim.job_id, e)
            return
        plan, was = outcome.plan, job.outcome.plan.budget_ratio
        if outcome.degraded or not plan.budget_reason or plan.budget_ratio >= was:
            log.info("job %s: not shrunk: the load's ratio is %g (%s), it runs at %g", job.claim.job_id,
                     plan.budget_ratio, plan.budget_reason or "degraded", was)
            return
        self.engine.shrink(job.seq, plan)
        self._work.set()

    def _sharing(self) -> int:
        """Jobs sharing the KV budget: this executor's, or the queue's waiting and running jobs when
        it counted more (one executor: the same)."""
        return max(len(self.jobs), self._depth)

    async def _load(self, job: Job) -> planner_pb2.KVLoad:
        """The KV memory an adaptive budget plans for: the budget, what other jobs have not reserved
        (this job's own reservation counts as free), and the jobs sharing it — this executor's,
        or the queue's waiting and running jobs when it counted more (one executor: the same)."""
        with contextlib.suppress(QueueUnavailable):
            self._depth = await self.backend.depth()
        budget = self.engine.budget
        own = budget.held(job.seq.seq_id) if job.seq is not None else 0
        return planner_pb2.KVLoad(budget_bytes=budget.total, free_bytes=budget.free + own,
                                  jobs=self._sharing(), itemsize=self.engine.storage_dtype.itemsize,
                                  chunk=self.engine.chunk)

    async def _heartbeat(self, job: Job) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
            try:
                if job.lost or not await self.backend.heartbeat(job.claim, self.executor_id):
                    job.lost = True
                    job.stop.set()
                    self._work.set()
                    return
                if await self.backend.is_cancelled(job.claim.job_id):
                    job.stop.set()
                job.status.generated_tokens = job.tokens
                await self.backend.set_status(job.claim.job_id, job.status.SerializeToString())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job %s: heartbeat failed; retrying", job.claim.job_id)

    async def _complete(self, job: Job) -> None:
        """The engine ended the job's sequence: its result, or its cancellation, or nothing (lost)."""
        seq = job.seq
        await job.events.join()
        if job.lost:
            log.warning("job %s: dropping this run (%s)", job.claim.job_id,
                        "executor shutting down" if self._stopping.is_set() else "taken over by another executor")
            return await self._close(job, None)
        if seq.finish_reason == "cancelled":
            return await self._close(job, pb.FAILED if job.failed else pb.CANCELLED)
        if seq.finish_reason == "failed":
            job.status.error = job.status.error or "the engine step running it failed"
            return await self._close(job, pb.FAILED)
        try:
            run = run_result(seq)
            outcome = job.outcome or PlanOutcome(seq.plan, False)      # ended at its first token, before its plan
            result = job_result(run, seq, outcome, self.executor_id, self.engine.storage_dtype,
                                job.status.submitted_at)
        except Exception as e:           # a defect: the job ends FAILED with why, never left running unseen
            log.exception("job %s: its result could not be built", job.claim.job_id)
            job.status.error = f"its result could not be built ({type(e).__name__}: {e})"
            return await self._close(job, pb.FAILED)
        job.status.result.CopyFrom(result)
        job.status.generated_tokens = result.generated_tokens
        await self.backend.append_event(job.claim.job_id, pb.JobEvent(job_id=job.claim.job_id, attempt=job.claim.attempt,
                                                                      result=result).SerializeToString())
        observe_finished(run, result)
        await self._close(job, pb.DONE, publish=False)

    def _fail_running(self) -> list[Sequence]:
        """After a failed step: every admitted sequence ends failed (their caches are suspect)."""
        for seq in list(self.engine.scheduler.running):
            self.engine.scheduler.abort(seq, "failed")
        return self.engine.scheduler.postprocess([], [])

    async def _close(self, job: Job, state: int | None, publish: bool = True) -> None:
        """End the job here: its tasks stop, its store is released, its state written (None: lost, nothing)."""
        for t in job.tasks:
            t.cancel()
        self.jobs.pop(job.claim.job_id, None)
        seq = job.seq
        if seq is not None and seq.store is not None and not seq.own_store:
            await asyncio.to_thread(seq.store.release)    # finished, failed or cancelled: the store drops the rows
        if state is not None:
            await self._end(job, state, publish)

    async def _open_store(self, job: Job, req: pb.GenerateRequest, plan, max_tokens: int):
        """The job's cachestore handle when its plan offloads; an unreachable cachestore gives a
        failed handle (the job runs on its low-bit copy, degraded) — never a failed job."""
        if not plan.offload.enabled or self.cachestore is None:
            return None
        lm = self.lm
        try:
            return await asyncio.to_thread(
                self.cachestore.open, job.claim.tenant or req.tenant or "default", job.claim.job_id, lm.num_layers,
                lm.num_kv_heads, lm.head_dim, self.engine.storage_dtype, max_tokens, plan.offload.candidates,
                job.claim.attempt)
        except StoreUnavailable as e:
            log.warning("job %s: cachestore unavailable (%s); running on the low-bit copy, degraded", job.claim.job_id, e)
            return Unavailable(str(e))

    async def _publish_status(self, job: Job) -> None:
        await self.backend.set_status(job.claim.job_id, job.status.SerializeToString())
        await self.backend.append_event(job.claim.job_id, pb.JobEvent(
            job_id=job.claim.job_id, attempt=job.claim.attempt, status=job.status).SerializeToString())

    async def _end(self, job: Job, state: int, publish: bool = True) -> None:
        status = job.status
        status.state = state
        if publish:
            await self._publish_status(job)
        else:
            await self.backend.set_status(job.claim.job_id, status.SerializeToString())
        await self.backend.finish(job.claim, self.cfg.job_ttl_s)
        if state == pb.FAILED and status.error_field:           # bad input found once queued: a refusal
            REFUSED.labels(status.error_field).inc()
        else:
            strategy = status.result.strategy or (job.outcome.plan.strategy if job.outcome else "") or \
                (job.request.strategy if job.request is not None else "")
            JOBS.labels(pb.JobState.Name(state), strategy, str(status.result.degraded).lower()).inc()
        log.info("job %s: %s%s", job.claim.job_id, pb.JobState.Name(state), f" ({status.error})" if status.error else "")


def _may_shrink(job: Job) -> bool:
    """Planned adaptively at 1.0 because memory was free, with a floor below it."""
    plan = job.outcome.plan if job.outcome is not None else None
    return plan is not None and plan.budget_reason == "fits" and job.request.budget.adaptive.floor_ratio < 1.0


def _budget_ratio(budget, prompt_tokens: int) -> float | None:
    """The job's budget as a reserve ratio (what an offload part is fitted to); None: unset."""
    kind = budget.WhichOneof("kind")
    if kind == "reserve_ratio":
        return budget.reserve_ratio
    if kind == "kv_tokens" and prompt_tokens:
        return budget.kv_tokens / prompt_tokens
    return None
