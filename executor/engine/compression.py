"""Compression as a transform on the pool: a pooled layer's dense context in, the rows its plan
keeps written back as blocks of their storage form, the context's blocks freed.

    kept_rows   eviction (SnapKV window / H2O accumulated / StreamingLLM none; KVCrush
                representatives; sinks, copy span, window) -> per KV head the kept rows
    compress    kept rows (all rows without eviction) -> dense blocks, or KIVI groups and a
                dense tail (`BlockTables.store_dense` / `store_quant`)
    gather      a dense layer's statistics for a plan that comes after the context
                (`kvcore.statistics.LayerStatistics`), and its last queries kept to compress later

Per sequence and layer, once a job (or at a shrink): plain torch, no batching needed.
Shapes: H query heads, H_kv KV heads, W window queries, T context rows, D head dim."""
from __future__ import annotations

import time

import torch

from executor import kvcrush
from executor.engine.block_tables import BlockTables
from kernels.rope_reconstruct import unrotate_rope
from kvcore import scoring
from kvplan.plan import LayerPlan


def head_scores(lp: LayerPlan, q: torch.Tensor, k: torch.Tensor, scaling: float,
                acc: torch.Tensor | None) -> torch.Tensor | None:
    """The scorer's raw attention per query head: q [H, W, D], k [H_kv, T, D] -> [H, T] or None."""
    ev = lp.eviction
    if ev.scorer == "snapkv":
        return scoring.window_scores(q[:, -max(1, min(ev.window, q.shape[1])):], k, scaling)
    return acc if ev.scorer == "h2o" else None


def kept_rows(lp: LayerPlan, q: torch.Tensor, k: torch.Tensor, scaling: float, acc: torch.Tensor | None
              ) -> torch.Tensor:
    """q [H, W, D] the context's last queries, k [H_kv, T, D] its keys (post-RoPE) -> [H_kv, n]
    sorted rows each KV head keeps (every head the same count)."""
    ev, (hk, t, _) = lp.eviction, k.shape
    raw = head_scores(lp, q, k, scaling, acc)                                       # [H, T] or None
    ranked = None if raw is None else scoring.ranking(raw, ev, hk)                  # [H_kv, T]
    keep = ev.keep_tokens if ev.keep_tokens is not None else int((ev.keep_ratio or 1.0) * t)
    if ranked is None and keep < t:          # nothing ranks the context: sinks + window only
        keep = 0
    if ev.kvcrush is not None and ranked is not None:
        return kvcrush.select(ranked, raw, t, keep, ev).rows
    return scoring.select(ranked, t, keep, ev.window, ev.sink_tokens, hk, k.device)


def compress(tables: BlockTables, layer: int, slot: int, lp: LayerPlan, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, scaling: float, acc: torch.Tensor | None = None, later: int = 0) -> None:
    """The layer's streams become what `lp` keeps of k, v [H_kv, T, D] (post-RoPE keys): the
    first T - `later` rows are the context, ranked with its last queries q [H, W, D]; the
    `later` rows after it (fed since: a shrink) join every head."""
    if lp.eviction is None and lp.quant is None:
        return
    if lp.eviction is not None:
        c = k.shape[1] - later
        rows = kept_rows(lp, q, k[:, :c], scaling, acc)                                # [H_kv, n]
        if later:
            rows = torch.cat([rows, torch.arange(c, c + later, device=rows.device).expand(rows.shape[0], -1)], 1)
        idx = rows[..., None].expand(-1, -1, k.shape[-1])
        k, v = k.gather(1, idx), v.gather(1, idx)
    if lp.quant is not None:
        tables.store_quant(layer, slot, k, v, lp.quant.bits, lp.quant.residual)
    else:
        tables.store_dense(layer, slot, k, v)


def gather(stats, queries: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           rope: tuple[torch.Tensor, float]) -> None:
    """The context's last chunk of a layer before any plan: q [H, Tq, D] its queries, k, v
    [H_kv, T, D] the whole context (post-RoPE keys, compute dtype) -> its statistics added to
    `stats`, its last queries appended to `queries` (`compress` uses them once the plan comes)."""
    t0 = time.perf_counter()
    keep = stats.keep_queries
    k_pre = unrotate_rope(k.float(), torch.arange(k.shape[1], device=k.device), *rope)
    stats.add(q[:, -keep:], k, k_pre, v, scaling)
    queries.append(q[:, -keep:].clone())
    stats.spent_s += time.perf_counter() - t0
