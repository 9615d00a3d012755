"""A finished job's `JobResult`: what it generated, the bytes its cache's tensors hold against the
full fp16 cache (per layer), its timings, what an offload plan transferred, and the plan's own
figures (its verdict on the budget, its predicted worst step); an adaptive job's ratio and reason
as first planned, and each shrink of its running cache since; its tokens' log-probabilities when
it asked (`token_logprobs`, also what each streamed delta carries); whether its compression put
the answer at risk (`kv_risk`, `kv_at_risk`: `executor.engine.risk`)."""
from __future__ import annotations

import time

import torch

from executor.engine.result import RunResult
from executor.engine.sequence import Sequence
from protos import executor_pb2 as pb


def job_result(run: RunResult, seq: Sequence, outcome, executor_id: str, storage_dtype: torch.dtype,
               submitted_at: float = 0.0) -> pb.JobResult:
    kv, full, plan = run.kv_bytes, run.full_kv_bytes, seq.plan
    first = seq.t_tokens[0] if seq.t_tokens else seq.t_finished
    ttft = (time.time() - (time.perf_counter() - first)) - submitted_at if submitted_at else run.ttft_s
    result = pb.JobResult(
        text=run.text, strategy=plan.strategy, plan_id=plan.plan_id,
        prompt_tokens=run.prompt_tokens, generated_tokens=len(run.token_ids),
        kv_bytes=kv, full_kv_bytes=full, reserve_ratio=kv / full if full else 0.0,
        prefill_s=run.prefill_s, decode_s=run.decode_s,
        prefill_tokens_per_s=run.prompt_tokens / run.prefill_s if run.prefill_s else 0.0,
        decode_tokens_per_s=run.decode_steps / run.decode_s if run.decode_s else 0.0,
        degraded=outcome.degraded or run.degraded, finish_reason=run.finish_reason, executor_id=executor_id,
        storage_dtype=str(storage_dtype).removeprefix("torch."),
        per_layer=[pb.LayerStats(layer=x.layer, kept_tokens=x.kept_tokens, kv_bytes=x.kv_bytes,
                                 full_kv_bytes=x.full_kv_bytes, kind=x.kind) for x in run.layers],
        offload=_offload_stats(run.offload), budget_floor_tokens=plan.budget_floor_tokens,
        queue_s=run.queue_s, ttft_s=max(ttft, 0.0), kv_reserved_bytes=seq.reserved,
        predicted_kv_bytes=plan.predicted_kv_bytes, budget_ratio=outcome.plan.budget_ratio,
        budget_reason=outcome.plan.budget_reason,
        shrinks=[pb.Shrink(ratio=s.ratio, generated_tokens=s.generated_tokens, kv_bytes_before=s.kv_bytes_before,
                           kv_bytes_after=s.kv_bytes_after, reserved_before=s.reserved_before,
                           reserved_after=s.reserved_after) for s in seq.shrinks],
        logprobs=token_logprobs(seq.tokenizer, zip(seq.generated, seq.logprobs)),
        kv_risk=run.kv_risk, kv_at_risk=run.kv_at_risk)
    if plan.budget_met is not None:
        result.budget_met = plan.budget_met
    return result


def _offload_stats(report: dict | None) -> pb.OffloadStats | None:
    if report is None:
        return None
    part, st = report["part"], report["stats"]
    return pb.OffloadStats(
        transport=report["transport"], low_bits=part["low_bits"], group_size=part["group_size"], top_k=part["top_k"],
        recent_window=part["recent_window"], host_kv_bytes=st["bytes_put"], prefetches=st["prefetches"],
        in_time=st["in_time"], late=st["late"], bytes_fetched=st["bytes_fetched"], stall_s=st["stall_s"],
        error=report["error"], rerank=part["rerank"])


def token_logprobs(tokenizer, entries) -> list[pb.TokenLogprob]:
    """(token id, (its log-probability, top ids, their log-probabilities)) per token — the
    engine's `Output.logprob` beside its token — as protos, each token with its text alone."""
    return [pb.TokenLogprob(token_id=tok, token=_text(tokenizer, tok), logprob=lp,
                            top=[pb.TopLogprob(token_id=t, token=_text(tokenizer, t), logprob=v) for t, v in zip(ids, vals)])
            for tok, (lp, ids, vals) in entries]


def _text(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok])
