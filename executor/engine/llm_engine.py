"""The engine: many jobs decoding together under one KV byte budget (continuous batching).

    step() = schedule -> run -> postprocess

`sequence()` makes a job's `Sequence` (its cache shaped by its plan, its prefill parts, its
reservation); `add()` hands it to the engine from any thread; one thread calls `step()` while
`has_work()`. After every step the bytes the running sequences' tensors hold are measured
against the budget (`usage`)."""
from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from cachestore.handle import LocalHandle
from executor.engine.kv_budget import KVBudget, Usage
from executor.engine.model_runner import ModelRunner
from executor.engine.scheduler import Scheduler, Segment
from executor.engine.sequence import Phase, Sampling, Sequence, Status, generated_parts, prefill_parts
from executor.engine.shrink import Shrink, dense_plan
from executor.prompt import Prompt
from kvcore import offload_budget, plan_cost
from kvcore.statistics import LayerStatistics
from kvcore.model import LoadedModel
from kvcore.plan import CompressionPlan, full_plan

log = logging.getLogger("kvplan.executor.engine")


@dataclass
class StepStats:
    """What the steps did, by kind ("decode": only decode rows; "mixed": decodes beside a
    prefill part; "prefill": prefill parts only): steps, seconds, tokens generated. Decode
    throughput is the tokens of the steps in which sequences decode over their seconds."""
    steps: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    tokens: Counter = field(default_factory=Counter)
    longest: Counter = field(default_factory=Counter)   # the longest step of each kind, seconds
    most_running: int = 0
    preempted: int = 0                               # sequences preempted for pages (a defect: logged as errors)
    last: tuple[str, float, int] = ("", 0.0, 0)      # the last step's (kind, seconds, tokens)

    def add(self, segments, tokens: int, seconds: float) -> None:
        decodes = sum(1 for seg in segments if seg.decode)
        kind = "prefill" if not decodes else "decode" if decodes == len(segments) else "mixed"
        self.steps[kind] += 1
        self.seconds[kind] += seconds
        self.tokens[kind] += tokens
        self.longest[kind] = max(self.longest[kind], seconds)
        self.most_running = max(self.most_running, decodes)
        self.last = (kind, seconds, tokens)


def stop_ids(lm: LoadedModel) -> set[int]:
    ids = {lm.tokenizer.eos_token_id}
    gen = getattr(lm.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {i for i in ids if i is not None}


class LLMEngine:
    def __init__(self, lm: LoadedModel, storage_dtype: torch.dtype, budget: KVBudget, max_batched_tokens: int = 512,
                 max_seqs: int = 64, prefill_chunk: int = 512, prefetch_wait_s: float = 0.0,
                 tenant_weight: Callable[[str], float] | None = None):
        """prefill_chunk: prompt tokens per prefill part (at most max_batched_tokens);
        prefetch_wait_s: how long an offload layer waits for a late prefetch (0: never);
        tenant_weight(tenant): its share of admissions (`executor.fairness`; default 1 each). The KV
        pool is allocated here from the budget (`KVPool`: blocks worth the whole budget, whatever
        their forms); a budget larger than a CPU pool may take is lowered to it."""
        self.lm, self.storage_dtype, self.budget = lm, storage_dtype, budget
        self.chunk = min(prefill_chunk, max_batched_tokens)
        self.prefetch_wait_s = prefetch_wait_s
        self.runner = ModelRunner(lm, storage_dtype, budget.total, max_seqs)
        if self.runner.pool.capacity < budget.total:
            log.info("KV budget %d bytes: lowered to the %d bytes of blocks the pool holds", budget.total,
                     self.runner.pool.capacity)
            budget.total = self.runner.pool.capacity
        self.scheduler = Scheduler(budget, max_batched_tokens, max_seqs, stop_ids(lm), tenant_weight)
        self.inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self.plans: queue.SimpleQueue[tuple] = queue.SimpleQueue()   # (PLANNING sequence, its plan, its store)
        self.shrinks: queue.SimpleQueue[tuple] = queue.SimpleQueue()  # (dense running sequence, its lower plan)
        self.usage = Usage(0, 0, budget.total)
        self.shrunk: list[Shrink] = []          # the shrinks the last step applied (metrics)
        self.stats = StepStats()

    # -- sequences ------------------------------------------------------------------------------
    def fit(self, plan: CompressionPlan, prompt: Prompt, sampling: Sampling, ratio: float | None) -> CompressionPlan:
        """An offload plan's part fitted to the job's reserve ratio (`kvcore.offload_budget`)."""
        if not plan.offload.enabled:
            return plan
        off = offload_budget.fit(plan.offload, ratio, prompt.num_tokens, sampling.max_new_tokens,
                                 self.lm.head_dim, self.storage_dtype.itemsize)
        return dataclasses.replace(plan, offload=off)

    def plan_bytes(self, plan: CompressionPlan, prompt: Prompt, sampling: Sampling) -> int:
        """The most the plan's cache holds at any step after the context (`kvcore.plan_cost`)."""
        lm = self.lm
        return plan_cost.plan_bytes(plan, lm.num_kv_heads, lm.num_query_heads, lm.head_dim, len(prompt.context_ids),
                                    len(prompt.question_ids), sampling.max_new_tokens, self.storage_dtype.itemsize,
                                    self.chunk)

    def reservation(self, plan: CompressionPlan, prompt: Prompt, sampling: Sampling) -> int:
        """Bytes a job reserves before its prefill: the larger of its prefill's peak and its plan's
        worst step over the job."""
        lm, itemsize = self.lm, self.storage_dtype.itemsize
        return max(plan_cost.prefill_bytes(plan, lm.num_kv_heads, lm.head_dim, len(prompt.context_ids), itemsize),
                   self.plan_bytes(plan, prompt, sampling))

    def sequence(self, prompt: Prompt, plan: CompressionPlan, sampling: Sampling, *,
                 emit: Callable[[str, object], None] = lambda kind, x: None,
                 cancelled: Callable[[], bool] = lambda: False, store=None, ratio: float | None = None,
                 prefix=None, measure_recall: bool = False, job_id: str = "", tenant: str = "",
                 statistics: LayerStatistics | None = None) -> Sequence:
        """A job's sequence. Offload plans: `store` is its cachestore handle (None: an in-process
        one, released when it ends) and `ratio` the reserve ratio its offload part is fitted to.
        `prefix`: the prompt's leading chunks already prefilled (`executor.runner.Prefix`).
        `statistics`: the plan comes after the context — its prefill runs dense (reserving what
        the uncompressed job holds), its last chunk gathers these statistics, the sequence emits
        ("context", ProbeStats) and waits in PLANNING for `apply_plan`; `plan` is ignored.
        Raises `OverBudget` when its reservation exceeds the whole budget."""
        if statistics is not None:                   # dense until the context's end, then the plan they ask for
            plan = full_plan(self.lm.num_layers, "before-plan")
        plan = self.fit(plan, prompt, sampling, ratio)
        plan = dataclasses.replace(plan, predicted_kv_bytes=self.plan_bytes(plan, prompt, sampling))
        own = store is None and plan.offload.enabled
        store = LocalHandle() if own else store
        cache = self.runner.new_cache(plan)
        if statistics is not None:
            parts = prefill_parts(prompt, self.chunk, statistics.keep_queries, last=Phase.STATS)
        else:
            parts = prefill_parts(prompt, self.chunk, cache.max_window)
        done = 0
        if prefix is not None and prefix.parts and prefix.seeds(cache, [(p.start, p.start + len(p.ids)) for p in parts]):
            cache.seed = prefix                     # written into its cache when it is admitted (`SeqCache.open`)
            parts, done = parts[len(prefix.parts):], prefix.tokens
        need = self.reservation(plan, prompt, sampling)
        self.budget.check_fits_at_all(need)
        return Sequence(prompt, plan, sampling, cache, parts, self.lm.tokenizer, emit, cancelled, store, job_id,
                        tenant=tenant, planned_after=statistics is not None, reserved=need, done_tokens=done,
                        own_store=own, stats=statistics, queries=[] if statistics is not None else None,
                        recall=[] if plan.offload.enabled and measure_recall else None,
                        prefetch_wait_s=self.prefetch_wait_s)

    def add(self, seq: Sequence) -> None:
        """Hand a sequence to the engine (any thread); it waits until its reservation fits."""
        self.inbox.put(seq)

    def apply_plan(self, seq: Sequence, plan: CompressionPlan, store=None) -> None:
        """Hand a PLANNING sequence its plan (any thread): the next step compresses its cache."""
        self.plans.put((seq, plan, store))

    def _apply_plan(self, seq: Sequence, plan: CompressionPlan, store) -> None:
        """The dense context rebuilt under `plan`, compressed with the queries its last chunk kept:
        the same cache the plan would have made compressing at that chunk."""
        if seq.status is not Status.PLANNING:
            return                                       # ended meanwhile (cancelled, or done at its first token)
        plan = self.fit(plan, seq.prompt, seq.sampling, None)
        plan = dataclasses.replace(plan, predicted_kv_bytes=self.plan_bytes(plan, seq.prompt, seq.sampling))
        if plan.offload.enabled and store is None:
            store, seq.own_store = LocalHandle(), True
        queries = seq.queries
        seq.plan, seq.store = plan, store
        self.runner.rebuild(seq, plan, queries)          # the context only: nothing to append
        seq.queries = queries if dense_plan(plan) else None     # a later shrink compresses with them
        self.scheduler.planned(seq)

    # -- compress instead of preempt ------------------------------------------------------------
    @staticmethod
    def shrinkable(seq: Sequence) -> bool:
        """Whether a shrink could lower this running sequence's cache: its plan came from its own
        prefill's statistics (the context's last queries kept) and every layer is still dense
        (planned at 1.0, while memory was free)."""
        return seq.queries is not None and dense_plan(seq.plan) and seq.status in (Status.PREFILL, Status.DECODE)

    def blocked(self) -> list[Sequence]:
        """The running sequences a shrink could make room with, when a waiting one waits for bytes."""
        if not self.scheduler.blocked():
            return []
        return [seq for seq in list(self.scheduler.running) if self.shrinkable(seq)]

    def shrink(self, seq: Sequence, plan: CompressionPlan) -> None:
        """Hand a dense running sequence a lower-ratio plan of its statistics (any thread): the next
        step rebuilds its cache under it (`executor.engine.shrink`) and lowers its reservation."""
        self.shrinks.put((seq, plan))

    def _shrink(self, seq: Sequence, plan: CompressionPlan) -> None:
        if not self.shrinkable(seq):
            return                                       # ended meanwhile
        if plan.offload.enabled or dense_plan(plan):
            log.info("job %s: not shrunk: its new plan %s (ratio %g)", seq.job_id,
                     "offloads" if plan.offload.enabled else "is still full", plan.budget_ratio)
            return
        plan = dataclasses.replace(plan, predicted_kv_bytes=self.plan_bytes(plan, seq.prompt, seq.sampling))
        before, reserved = seq.kv_bytes(), seq.reserved
        queries, seq.plan, seq.queries = seq.queries, plan, None
        self.runner.rebuild(seq, plan, queries)
        self.scheduler.shrunk(seq)
        seq.shrinks.append(Shrink(plan.budget_ratio, len(seq.generated), before, seq.kv_bytes(), reserved,
                                  seq.reserved))
        self.shrunk.append(seq.shrinks[-1])
        log.info("job %s: shrunk to ratio %g after %d tokens to make room: KV %d -> %d bytes, reserved %d -> %d",
                 seq.job_id, plan.budget_ratio, len(seq.generated), before, seq.kv_bytes(), reserved, seq.reserved)

    def has_work(self) -> bool:
        return (not self.inbox.empty() or not self.plans.empty() or not self.shrinks.empty()
                or not self.scheduler.is_finished())

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One step of every admitted sequence -> those that finished in it."""
        while not self.inbox.empty():
            self.scheduler.add(self.inbox.get())
        while not self.plans.empty():
            self._apply_plan(*self.plans.get())
        self.shrunk = []
        while not self.shrinks.empty():
            self._shrink(*self.shrinks.get())
        t0, self.stats.last = time.perf_counter(), ("", 0.0, 0)
        segments = self._fit(self.scheduler.schedule())
        outputs = self.runner.run(segments) if segments else []
        before = sum(len(seg.seq.generated) for seg in segments)
        finished = self.scheduler.postprocess(segments, outputs)
        if segments:
            self.stats.add(segments, sum(len(seg.seq.generated) for seg in segments) - before,
                           time.perf_counter() - t0)
        for seq in finished:
            if seq.own_store:
                seq.store.release()
        self.usage = self.budget.observe(self.measured())
        return finished

    # -- a step the pool can serve --------------------------------------------------------------
    def _fit(self, segments: list[Segment]) -> list[Segment]:
        """The step's segments once the pool holds the pages they take (`ModelRunner.pages_due`).
        Reservations make this always so; where it is not (a defect of the cost model) the newest
        sequence is preempted — its pages freed, it recomputed later — and the step goes on without
        it: no sequence of the step fails for another's pages."""
        while segments and self.runner.pages_due(segments) > self.runner.pool.free_pages:
            need, victim = self.runner.pages_due(segments), self.scheduler.newest()
            if victim is None or len(self.scheduler.running) == 1:     # nothing else holds pages to wait for
                seq = victim or segments[0].seq
                log.error("job %s: the KV pool cannot serve its step even alone (%d pages due, %d free): failing it",
                          seq.job_id, need, self.runner.pool.free_pages)
                self.scheduler.abort(seq, "failed")
            else:
                seq = victim
                self._preempt(victim, need)
            segments = [s for s in segments if s.seq is not seq]
        return segments

    def _preempt(self, seq: Sequence, need: int) -> None:
        """Give back a running sequence's pages and requeue it to be recomputed: its prompt and the
        tokens it generated so far prefilled again under its plan (nothing is sampled twice)."""
        log.error("job %s: preempted: the KV pool has %d free pages, the step needs %d (a reservation "
                  "under-counted); it is recomputed once there is room", seq.job_id, self.runner.pool.free_pages, need)
        self.scheduler.preempt(seq)
        self.stats.preempted += 1
        seq.preemptions += 1
        if seq.own_store:
            seq.store.release()
            seq.store = LocalHandle()
        cache = self.runner.new_cache(seq.plan)
        seq.cache, seq.queries, seq.guess, seq.stats = cache, None, None, None
        seq.acc, seq.offload_state = {}, {}
        seq.parts = (prefill_parts(seq.prompt, self.chunk, cache.max_window)
                     + generated_parts(seq.prompt, seq.generated, self.chunk))
        seq.done_tokens = 0
        seq.reserved = self.reservation(seq.plan, seq.prompt, seq.sampling)

    def measured(self) -> int:
        """Bytes the running sequences hold: the pool's pages in use."""
        return self.runner.pool.bytes_in_use

    def run_all(self) -> list[Sequence]:
        """Step until every added sequence ended (benches, tests) -> them, in the order they ended."""
        done = []
        while self.has_work():
            done += self.step()
        return done
