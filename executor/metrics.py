"""The executor's Prometheus metrics, as vLLM's engine exposes them: jobs running and waiting, the
KV bytes held against the reservations and the budget, time to first token, time per output
token and inter-token gaps (buckets to minutes), jobs ended by state, strategy and degradation,
jobs refused as bad input once queued (apart: a refusal is the client's error, not a failure),
running jobs shrunk to make room."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)

JOBS = Counter("kvplan_executor_jobs_total", "jobs ended, by state, strategy and degraded (refusals: below)",
               ["state", "strategy", "degraded"])
REFUSED = Counter("kvplan_executor_jobs_refused_total", "jobs refused as bad input once queued (tokenized, planned or "
                  "prefilled: a budget the strategy's plan cannot hold), by the request field at fault", ["field"])
DEGRADED = Counter("kvplan_jobs_degraded_total", "jobs that ended degraded (planner or cachestore lost)")
TOKENS = Counter("kvplan_executor_generated_tokens_total", "tokens generated")
RUNNING = Gauge("kvplan_executor_running_sequences", "jobs the engine runs (prefilling or decoding)")
QUEUE_DEPTH = Gauge("kvplan_executor_queue_depth", "jobs in the job queue, waiting or running (all executors)")
WAITING = Gauge("kvplan_executor_waiting_sequences", "planned jobs waiting for KV budget room")
KV_BYTES = Gauge("kvplan_executor_kv_bytes", "bytes the running jobs' KV cache tensors hold")
KV_RESERVED = Gauge("kvplan_executor_kv_reserved_bytes", "bytes reserved for the running jobs")
KV_BUDGET = Gauge("kvplan_executor_kv_budget_bytes", "the executor's KV budget (KVPLAN_KV_BUDGET_BYTES)")
KV_PEAK = Gauge("kvplan_executor_kv_peak_bytes", "most bytes the KV caches held after any step")
TTFT = Histogram("kvplan_executor_ttft_seconds", "submitted -> first token", buckets=_SECONDS)
TPOT = Histogram("kvplan_executor_tpot_seconds", "decode time per output token, per job", buckets=_SECONDS)
ITL = Histogram("kvplan_executor_itl_seconds", "gap between consecutive tokens of a job", buckets=_SECONDS)
QUEUE = Histogram("kvplan_executor_queue_seconds", "planned -> admitted (waiting for KV budget room)",
                  buckets=_SECONDS)
STEPS = Counter("kvplan_executor_steps_total", "engine steps, by kind (decode | mixed | prefill)", ["kind"])
STEP_SECONDS = Counter("kvplan_executor_step_seconds_total", "time in engine steps, by kind", ["kind"])
STEP_TOKENS = Counter("kvplan_executor_step_tokens_total", "tokens generated in engine steps, by kind", ["kind"])
LONGEST_STEP = Gauge("kvplan_executor_step_seconds_max", "the longest engine step of each kind so far", ["kind"])
MOST_RUNNING = Gauge("kvplan_executor_decoding_sequences_peak", "most sequences that decoded in one step")
SHRINKS = Counter("kvplan_executor_shrinks_total", "running jobs' caches shrunk to a lower-ratio plan to make room "
                  "for waiting jobs (compress instead of preempt), by the new ratio", ["ratio"])
PREEMPTED = Gauge("kvplan_executor_preemptions", "sequences the engine preempted because the KV pool had too few free "
                  "pages for a step (a defect of the reservations: each is logged as an error; recomputed, not failed)")
SHRINK_FREED = Counter("kvplan_executor_shrink_freed_bytes_total", "reserved bytes the shrinks gave back to the budget")
PREFILL_S = Histogram("kvplan_executor_prefill_seconds", "prefill time per job", buckets=_SECONDS)


def observe_usage(engine) -> None:
    """After a step: the engine's sequences and bytes."""
    sched, usage = engine.scheduler, engine.usage
    RUNNING.set(len(sched.running))
    WAITING.set(len(sched.waiting))
    KV_BYTES.set(usage.measured)
    KV_RESERVED.set(usage.reserved)
    KV_BUDGET.set(usage.budget)
    KV_PEAK.set(engine.budget.peak_measured)
    kind, seconds, tokens = engine.stats.last
    if kind:
        STEPS.labels(kind).inc()
        STEP_SECONDS.labels(kind).inc(seconds)
        STEP_TOKENS.labels(kind).inc(tokens)
        LONGEST_STEP.labels(kind).set(engine.stats.longest[kind])
    MOST_RUNNING.set(engine.stats.most_running)
    PREEMPTED.set(engine.stats.preempted)
    for s in engine.shrunk:
        SHRINKS.labels(f"{s.ratio:g}").inc()
        SHRINK_FREED.inc(max(s.reserved_before - s.reserved_after, 0))


def observe_finished(run, result) -> None:
    """A job's result (`executor.engine.result.RunResult`, `JobResult`)."""
    TOKENS.inc(result.generated_tokens)
    TTFT.observe(result.ttft_s)
    QUEUE.observe(run.queue_s)
    PREFILL_S.observe(run.prefill_s)
    if len(run.token_ids) > 1:
        TPOT.observe(run.decode_s / (len(run.token_ids) - 1))
    for gap in run.itl_s:
        ITL.observe(gap)
    if result.degraded:
        DEGRADED.inc()
