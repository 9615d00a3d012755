"""A plan's bytes over a job, from the plan alone (`kvcore.cost` per storage form): what the
engine reserves before the job runs, and what a plan states as `predicted_kv_bytes`.

    plan_bytes       the most the compressed cache holds at any step after the context's last
                     chunk (question and generated rows included, spare store rows counted);
                     an upper bound where the form depends on the data
    prefill_bytes    what the prefill holds at its peak: every layer's dense context, plus one
                     layer's compressed form built beside its dense copy when the plan compresses

Layers the engine's pool holds (`kvcore.blocks.pooled_layers`) cost whole blocks of their form
(`kvcore.blocks.Layout`): every KV head a stream of dense blocks, or of quant groups and a dense
tail. The rest cost what their cache layers hold (`kvcore.cost`).

Shapes are counts; one sequence."""
from __future__ import annotations

import math

import numpy as np

from kvcore import cost
from kvcore.blocks import Layout, pooled_layers
from kvplan.plan import CompressionPlan, LayerPlan


def plan_bytes(plan: CompressionPlan, num_kv_heads: int, num_query_heads: int, head_dim: int, context: int,
               suffix: int, new_tokens: int, itemsize: int, chunk: int) -> int:
    ctx_adds, after = cost.job_adds(context, suffix, new_tokens, chunk)
    lower = {lp.merge.with_layer for lp in plan.layers if lp.merge is not None}
    shape = (num_kv_heads, num_query_heads, head_dim, itemsize)
    pooled = pooled_layers(plan, num_query_heads, num_kv_heads)
    layout = Layout(head_dim, itemsize)
    total = 0
    for i, lp in enumerate(plan.layers):
        if pooled[i]:
            total += num_kv_heads * _pooled(lp, layout, kept_per_head(lp, context), after)
        elif plan.offload.enabled and lp.kind == "full" and i not in lower:
            total += _offload(plan.offload, shape, context, after)
        elif i in lower:                      # holds only the rows its partner merges next, within a forward
            total += num_kv_heads * cost.dense_row_bytes(head_dim, itemsize) * max(after, default=0)
        elif lp.merge is not None:
            total += _merge(lp, shape, context, after)
        elif lp.eviction is not None or lp.quant is not None or lp.codebook is not None:
            total += _evicted(lp, shape, context, after)
        elif ctx_adds:
            rows = cost.capacities(0, 0, ctx_adds + after)[-1]
            total += num_kv_heads * cost.dense_row_bytes(head_dim, itemsize) * rows
    return int(total)


def prefill_bytes(plan: CompressionPlan, num_kv_heads: int, head_dim: int, context: int, itemsize: int) -> int:
    compresses = plan.offload.enabled or any(lp.kind != "full" for lp in plan.layers)
    layers = len(plan.layers) + (1 if compresses else 0)
    layout = Layout(head_dim, itemsize)
    per_head = max(cost.dense_row_bytes(head_dim, itemsize) * context, int(layout.dense_stream_bytes(context)))
    return layers * num_kv_heads * per_head


def _pooled(lp: LayerPlan, layout: Layout, kept: int, after: list[int]) -> int:
    """Most bytes one KV head's stream of a pooled layer holds after its context: `kept` rows,
    then `after` rows joining in turn (dense blocks, or quant groups and a dense tail)."""
    if lp.quant is None:
        return int(layout.dense_stream_bytes(kept + sum(after)))
    q = lp.quant
    worst = layout.quant_stream_held(kept, q.bits, q.residual)
    if after:
        before = kept + np.cumsum([0, *after[:-1]])
        worst = max(worst, layout.quant_stream_bytes(before, np.asarray(after), q.bits, q.residual).max())
    return int(worst)


def kept_per_head(lp: LayerPlan, context: int) -> int:
    """Prompt tokens one stored head keeps: sinks, the top of the scored span, the window."""
    ev = lp.eviction
    if ev is None:
        return context
    window = min(ev.window, context)
    sinks = min(ev.sink_tokens, context - window)
    keep = ev.keep_tokens if ev.keep_tokens is not None else int((ev.keep_ratio or 1.0) * context)
    return sinks + window + max(0, min(keep, context - window - sinks))


def _evicted(lp: LayerPlan, shape, context: int, after: list[int]) -> int:
    hk, hq, d, itemsize = shape
    hn = hq // hk
    per_head = kept_per_head(lp, context)
    repeat = lp.eviction is not None and lp.eviction.gqa_mode == "repeat" and hn > 1
    u = min(context, hn * per_head) if repeat else per_head              # rows a KV group stores
    added = sum(after)
    if lp.quant is not None:
        q = lp.quant
        steps = u + np.cumsum([0, *after])
        return int(hk * cost.quant_bytes(steps, q.bits, q.group_size, q.residual, d, itemsize).max())
    rows = cost.capacities(u, u, after)[-1] if after else u
    total = hk * rows * cost.dense_row_bytes(d, itemsize)
    if repeat:                                                           # a byte per query head and column
        total += hk * hn * rows
    if lp.codebook is not None:                                          # coded rows' extras, indices widened
        total += hk * (added * cost.coded_row_bytes(d, itemsize) + 2 * 3 * (min(context, 2 * hn * per_head) + added))
    return total


def _merge(lp: LayerPlan, shape, context: int, after: list[int]) -> int:
    """The upper layer of a merged pair holds the pair: per K and V, unit directions [N, W], both
    layers' magnitudes [2, N], the retained rows of both [2, M, W] and their int32 indices;
    every later row counted as retained."""
    hk, _, d, itemsize = shape
    w, added = hk * d, sum(after)
    n = context + added
    total = 0
    for share in (lp.merge.retention_k, lp.merge.retention_v):
        m = math.ceil(share * context) + added
        total += n * w * itemsize + 2 * n * itemsize + m * (4 + 2 * w * itemsize)
    return total


def _offload(off, shape, context: int, after: list[int]) -> int:
    hk, _, d, itemsize = shape
    tokens = context + sum(after)
    seals = 1 + sum(1 for m in after if m > 1)                 # each multi-row call pads a key group
    low = max(cost.lowbit_bytes(t, hk, d, off.low_bits, off.group_size, off.recent_window,
                                off.recent_window + off.group_size - 1, off.value_group_size, seals, itemsize)
              for t in (context, tokens))
    return low + cost.offload_fixed_bytes(off.sink_tokens, off.top_k, hk, d, tokens, itemsize)
