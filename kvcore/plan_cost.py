"""A plan's bytes over a job, from the plan alone: what the engine reserves before the job runs, and
what a plan states as `predicted_kv_bytes`. Every layer's streams are pages of the pool
(`kvcore.blocks`), so a plan's bytes are whole pages:

    full / evicted      dense pages of the kept rows and the rows added after them
    quant               quant pages of the form at its width and a dense tail, at its worst step
                        (a step's new page allocated before the dense pages it empties are freed)
    repeat / codebook   the kept rows as coded rows (a coded page per `coded_rows`, an entry per
                        row and part at most: the union of a group's query heads, every part
                        exact, bounds any codebook), the added rows dense
    merge               per layer of a pair a coded page per `coded_rows` context rows, the
                        retained rows and the added ones dense; the upper layer also the shared
                        directions (an entry per row and part)
    offload             SpeCache's low-bit copy (quant pages of its form, the window dense), its
                        sinks and prefetch slots (coded rows and their entries), a skip page

    plan_bytes       the most the compressed cache holds at any step after the context's last chunk
    prefill_bytes    what the prefill holds at its peak: every layer's dense context, plus one
                     layer's compressed form built as its dense pages are given back

Shapes are counts; one sequence."""
from __future__ import annotations

import math

import numpy as np

from kvcore import cost
from kvcore.blocks import Layout, ceil_div
from kvcore.plan import CompressionPlan, LayerPlan, OffloadPlan

OFFLOAD_KEY_GROUP = 32       # SpeCache's low-bit keys per channel scale (`executor.presses.offload`)


def plan_bytes(plan: CompressionPlan, num_kv_heads: int, num_query_heads: int, head_dim: int, context: int,
               suffix: int, new_tokens: int, itemsize: int, chunk: int) -> int:
    _, after = cost.job_adds(context, suffix, new_tokens, chunk)
    lay = Layout(head_dim, itemsize)
    lower = {lp.merge.with_layer: lp.merge for lp in plan.layers if lp.merge is not None}
    hn = num_query_heads // num_kv_heads
    added = sum(after)
    pages = 0
    for i, lp in enumerate(plan.layers):
        if i in lower:
            pages += _merged(lay, lower[i], context, added, upper=False)
        elif lp.merge is not None:
            pages += _merged(lay, lp.merge, context, added, upper=True)
        elif plan.offload.enabled and lp.kind == "full":
            pages += offload_pages(lay, plan.offload, context, after)
        else:
            pages += _layer(lay, lp, context, after, hn)
    return int(num_kv_heads * pages * lay.page_bytes)


def prefill_bytes(plan: CompressionPlan, num_kv_heads: int, head_dim: int, context: int, itemsize: int) -> int:
    compresses = plan.offload.enabled or any(lp.kind != "full" for lp in plan.layers)
    layers = len(plan.layers) + (1 if compresses else 0)
    lay = Layout(head_dim, itemsize)
    return int(layers * num_kv_heads * lay.dense_pages(0, context) * lay.page_bytes)


def kept_per_head(lp: LayerPlan, context: int) -> int:
    """Prompt tokens one stored head keeps: sinks, the top of the scored span, the window."""
    ev = lp.eviction
    if ev is None:
        return context
    window = min(ev.window, context)
    sinks = min(ev.sink_tokens, context - window)
    keep = ev.keep_tokens if ev.keep_tokens is not None else int((ev.keep_ratio or 1.0) * context)
    return sinks + window + max(0, min(keep, context - window - sinks))


def coded_pages(lay: Layout, rows: int, entries: int) -> int:
    """Pages of `rows` coded rows over `entries` entries of each part (K and V)."""
    return int(ceil_div(rows, lay.coded_rows) + 2 * ceil_div(entries, lay.entry_rows))


def _layer(lay: Layout, lp: LayerPlan, context: int, after: list[int], hn: int) -> int:
    """Most pages one KV head's stream of a layer holds after its context (full, evicted, quant,
    per-query-head eviction, codebook)."""
    kept = kept_per_head(lp, context)
    added = sum(after)
    repeat = lp.eviction is not None and lp.eviction.gqa_mode == "repeat" and hn > 1
    if lp.codebook is not None or repeat:
        union = min(context, hn * kept) if repeat else kept
        return coded_pages(lay, union, union) + int(lay.dense_pages(0, added))
    if lp.quant is None:
        return int(lay.dense_pages(0, kept + added))
    return _quant(lay, lay.group_rows(lp.quant.bits), lp.quant.residual, kept, after)


def _quant(lay: Layout, g: int, residual: int, kept: int, after: list[int]) -> int:
    worst = int(lay.quant_pages_held(kept, g, residual))
    if after:
        before = kept + np.cumsum([0, *after[:-1]])
        worst = max(worst, int(lay.quant_pages_during(before, np.asarray(after), g, residual).max()))
    return worst


def _merged(lay: Layout, mg, context: int, added: int, upper: bool) -> int:
    """One KV head's stream of a merged pair's layer: coded rows over the context, the retained
    rows (for K or for V) and the added ones dense; the upper layer holds the shared directions."""
    retained = min(context, math.ceil(mg.retention_k * context) + math.ceil(mg.retention_v * context))
    pages = int(ceil_div(context, lay.coded_rows) + lay.dense_pages(0, retained + added))
    return pages + (int(2 * ceil_div(context, lay.entry_rows)) if upper else 0)


def offload_form(lay: Layout, off: OffloadPlan) -> int:
    """The quant form id of an offload part's low-bit copy (ValueError where the pool has none)."""
    if off.group_size != OFFLOAD_KEY_GROUP:
        raise ValueError(f"offload group_size {off.group_size}: the pool keeps SpeCache's keys in groups of "
                         f"{OFFLOAD_KEY_GROUP} rows")
    return lay.form_id(off.low_bits, OFFLOAD_KEY_GROUP, min(off.value_group_size, lay.head_dim))


def offload_pages(lay: Layout, off: OffloadPlan, context: int, after: list[int]) -> int:
    """Most pages one KV head's stream of an offload layer holds after its context: its low-bit
    copy at its worst step, its sinks' and prefetch slots' coded rows and entries, a skip page."""
    g = lay.quant_forms[offload_form(lay, off)].rows
    slots = off.sink_tokens + off.top_k
    return _quant(lay, g, off.recent_window, context, after) + coded_pages(lay, slots, slots) + 1
