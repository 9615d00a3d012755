"""Compress instead of preempt: a running job's dense cache rebuilt under a lower-ratio plan, between
steps, so that jobs waiting for room can be admitted while it goes on decoding.

A job planned at 1.0 (its plan all `full`: memory was free when it started) keeps its context's
last queries (`Sequence.queries`, kept by its statistics pass). When others wait, the planner plans
it again from the same statistics at the ratio the load calls for, and the new cache is what that
plan would have built at the context's end, followed by the same rows since
(`SeqCache.rebuild`): the context's rows compressed with those queries, the question and the
generated rows fed so far joining as any later row does, so no compression code sees generated
rows as context. The text so far is what it is; the tokens after the shrink come from the new
cache. Plans that offload are not shrunk to: an offload layer stores its later rows in its
attention, not in `update`."""
from __future__ import annotations

from dataclasses import dataclass

from kvcore.plan import CompressionPlan


@dataclass(frozen=True)
class Shrink:
    """One shrink of a job's cache (`JobResult.shrinks`)."""
    ratio: float                 # the new plan's budget_ratio
    generated_tokens: int        # tokens generated when it was shrunk
    kv_bytes_before: int         # bytes its cache's tensors held just before
    kv_bytes_after: int          # ... just after
    reserved_before: int         # its reservation before
    reserved_after: int          # ... after: the new cache's worst step over the rest of the job


def dense_plan(plan: CompressionPlan) -> bool:
    """Whether a plan's cache holds every layer's dense K/V: `full` layers only, no offload."""
    return not plan.offload.enabled and all(lp.kind == "full" for lp in plan.layers)
