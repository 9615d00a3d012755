"""Eviction: which context rows each stored head keeps — SnapKV (the observation window's
attention), H2O (attention accumulated over the prefill), StreamingLLM (none: sinks and window) —
with KVCrush's representatives of the dropped rows, sinks, the copy span and the window
(`kvcore.scoring`). In GQA `mean` mode a KV head keeps one set (the group's mean ranking) as dense
pages; in `repeat` mode each query head keeps its own, and its KV group stores the union once as
exact coded rows whose head byte says which query heads see each (never h_n copies). Rows fed
after the context (`later`) join every head.

Shapes: H query heads, H_kv KV heads, h_n = H / H_kv, W window queries, C context rows, D head dim."""
from __future__ import annotations

import torch

from executor.presses import kvcrush
from executor.presses.context import PressContext
from kernels.paged_decode import CodedRows
from kvcore import scoring
from kvcore.plan import Eviction, LayerPlan

KEEP_ALL = Eviction(keep_tokens=1 << 62, window=0, scorer="streaming_llm", gqa_mode="mean")


def head_scores(lp: LayerPlan, q: torch.Tensor, k: torch.Tensor, scaling: float,
                acc: torch.Tensor | None) -> torch.Tensor | None:
    """The scorer's raw attention per query head: q [H, W, D], k [H_kv, C, D] -> [H, C] or None."""
    ev = lp.eviction
    if ev.scorer == "snapkv":
        return scoring.window_scores(q[:, -max(1, min(ev.window, q.shape[1])):], k, scaling)
    return acc[:, :k.shape[1]] if ev.scorer == "h2o" and acc is not None else None


def planned_keep(lp: LayerPlan, c: int) -> int:
    ev = lp.eviction
    return ev.keep_tokens if ev.keep_tokens is not None else int((ev.keep_ratio or 1.0) * c)


def kept_rows(lp: LayerPlan, q: torch.Tensor, k: torch.Tensor, scaling: float, acc: torch.Tensor | None,
              num_query_heads: int) -> torch.Tensor:
    """q [H, W, D] the context's last queries, k [H_kv, C, D] its keys (post-RoPE) -> [heads, n]
    sorted rows each stored head keeps (every head the same count): heads = H_kv (`mean`) or H
    (`repeat`)."""
    ev, (hk, c, _) = lp.eviction, k.shape
    heads = num_query_heads if ev.gqa_mode == "repeat" else hk
    raw = head_scores(lp, q, k, scaling, acc)                                       # [H, C] or None
    ranked = None if raw is None else scoring.ranking(raw, ev, hk)                  # [heads, C]
    keep = planned_keep(lp, c)
    if ranked is None and keep < c:          # nothing ranks the context: sinks + window only
        keep = 0
    if ev.kvcrush is not None and ranked is not None:
        return kvcrush.select(ranked, raw, c, keep, ev).rows
    return scoring.select(ranked, c, keep, ev.window, ev.sink_tokens, heads, k.device)


def union(rows: torch.Tensor, hk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [H, n] each query head's kept rows -> per KV group the union, padded to the largest
    group's count U: idx [H_kv, U] (sorted; padding repeats the last), heads [H_kv, U] uint8 (bit
    j: query head j of the group keeps it; 0 on padding), live [H_kv, U] bool."""
    h, n = rows.shape
    hn = h // hk
    groups = [torch.unique(rows[g * hn:(g + 1) * hn]) for g in range(hk)]
    u = max(len(x) for x in groups)
    idx = torch.zeros(hk, u, dtype=torch.long, device=rows.device)
    heads = torch.zeros(hk, u, dtype=torch.uint8, device=rows.device)
    live = torch.zeros(hk, u, dtype=torch.bool, device=rows.device)
    for g, uniq in enumerate(groups):
        idx[g, :len(uniq)] = uniq
        idx[g, len(uniq):] = uniq[-1] if len(uniq) else 0
        live[g, :len(uniq)] = True
        at = torch.searchsorted(uniq, rows[g * hn:(g + 1) * hn])                  # [h_n, n] into the union
        for j in range(hn):
            heads[g, at[j]] |= 1 << j
    return idx, heads, live


def select(lp: LayerPlan, ctx: PressContext, q, k, v, acc) -> tuple:
    """-> ("dense", k, v) kept rows per KV head [H_kv, n, D], or ("coded", CodedRows) of each
    group's union (`repeat`)."""
    rows = kept_rows(lp, q, k, ctx.scaling, acc, ctx.num_query_heads)
    if lp.eviction.gqa_mode != "repeat" or ctx.group == 1:
        idx = rows[..., None].expand(-1, -1, k.shape[-1])
        return "dense", k.gather(1, idx), v.gather(1, idx)
    idx, heads, live = union(rows, k.shape[0])
    at = idx[..., None].expand(-1, -1, k.shape[-1])
    coded = CodedRows.exact(k.gather(1, at).to(ctx.tables.dtype), v.gather(1, at).to(ctx.tables.dtype),
                            heads.cpu())
    ref = torch.where(live.cpu(), coded.ref_k, -1).to(torch.int32)
    return "coded", CodedRows(ref, coded.ref_v, coded.pos, coded.mag_k, coded.mag_v, coded.heads,
                              coded.k_entries, coded.v_entries)


def full(ctx: PressContext, seq, layer: int, lp: LayerPlan, q, k, v, later_k=None, later_v=None) -> None:
    """A full layer keeps every row: nothing to do where its rows are already in its dense pages."""
    if later_k is not None:                  # a rebuild: the context and the later rows, as they were
        ctx.tables.store_dense(layer, seq.cache.slot, torch.cat([k, later_k], 1), torch.cat([v, later_v], 1))


def press(ctx: PressContext, seq, layer: int, lp: LayerPlan, q, k, v, later_k=None, later_v=None) -> None:
    """An evicted layer: its kept rows (then the later ones) as dense pages, or coded (`repeat`)."""
    slot = seq.cache.slot
    form = select(lp, ctx, q, k, v, seq.acc.get(layer))
    if form[0] == "dense":
        kk, vv = form[1], form[2]
        if later_k is not None:
            kk, vv = torch.cat([kk, later_k], 1), torch.cat([vv, later_v], 1)
        ctx.tables.store_dense(layer, slot, kk, vv)
    else:
        ctx.tables.store_coded(layer, slot, form[1], later_k, later_v)
