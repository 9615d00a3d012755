"""SpeCache: a layer's full-precision rows go to the cachestore; the pool keeps a low-bit copy (the
plan's width, key groups of 32 rows: `kvcore.blocks` q1s / q2s), the newest rows dense, and beside
them coded slots of exact rows: the sinks, then `top_k` rows prefetched for the current decode
step, each skipped in the low-bit copy while its exact row is there (a skip page).

    press      at the context's end: put every row to the store, the low-bit copy, the sinks
    place      before a decode step's attention: the rows prefetched for it into their slots
               (exact), the skip page marking them and the sinks
    select     after it: the speculative row's attention over the low-bit copy (group mean)
               picks the next step's rows — its top rerank·k, narrowed on the prefetch thread
               to the k its query attends to most over their exact keys (`rerank` 1: the
               published top-k) — and starts their prefetch
A store that has failed (`store.failed`) leaves the layer on its low-bit copy alone.

Shapes: H_kv KV heads, h_n query heads a group, C context rows, Q low-bit rows, D head dim."""
from __future__ import annotations

import torch

from executor.presses.context import PressContext, UnsupportedPlan
from kernels import lowbit_scores
from kernels.paged_decode import ALL_HEADS, CodedRows
from kvcore.plan import LayerPlan, OffloadPlan

KEY_GROUP = 32          # the low-bit copy's key group (rows a channel's scale spans)


def form(ctx: PressContext, off: OffloadPlan) -> int:
    """The pool's quant form of an offload part's low-bit copy."""
    if off.group_size != KEY_GROUP:
        raise UnsupportedPlan(f"offload group_size {off.group_size}: the pool keeps SpeCache's keys in groups of "
                              f"{KEY_GROUP} rows")
    lay = ctx.tables.layout
    return lay.form_id(off.low_bits, KEY_GROUP, min(off.value_group_size, lay.head_dim))


def _slots(off: OffloadPlan, sinks: int, k: torch.Tensor, v: torch.Tensor) -> CodedRows:
    """The coded slots: `sinks` exact rows of k, v [H_kv, S, D], then top_k empty ones."""
    hk, _, d = k.shape
    m = sinks + off.top_k
    ref = torch.full((hk, m), -1, dtype=torch.int32)
    ref[:, :sinks] = torch.arange(sinks, dtype=torch.int32)
    ent_k = torch.zeros(hk, m, d, dtype=k.dtype)
    ent_v = torch.zeros(hk, m, d, dtype=v.dtype)
    ent_k[:, :sinks], ent_v[:, :sinks] = k.cpu(), v.cpu()
    idx = torch.arange(m, dtype=torch.int32).expand(hk, m).contiguous()
    one = torch.ones(hk, m, dtype=torch.float16)
    return CodedRows(ref, idx, torch.full((hk, m), -1, dtype=torch.int32), one, one.clone(),
                     torch.full((hk, m), ALL_HEADS, dtype=torch.uint8), ent_k, ent_v)


def press(ctx: PressContext, seq, layer: int, lp: LayerPlan, q, k, v, later_k=None, later_v=None) -> None:
    """Every row to the store; the low-bit copy of them and the exact sinks in the pool."""
    if later_k is not None:
        raise UnsupportedPlan("an offload plan is not rebuilt from a dense cache (a shrink or a late plan)")
    off, tables, slot = seq.plan.offload, ctx.tables, seq.cache.slot
    fid = form(ctx, off)
    kk, vv = k.to(tables.dtype), v.to(tables.dtype)
    seq.store.put(layer, kk, vv)
    tables.store_quant(layer, slot, kk, vv, fid, off.recent_window)
    quantized = int(tables.qn[layer, slot, 0]) * tables.layout.quant_forms[fid].rows
    sinks = min(off.sink_tokens, quantized)
    tables.store_coded(layer, slot, _slots(off, sinks, kk[:, :sinks], vv[:, :sinks]), replace=False)
    seq.offload_state[layer] = {"sinks": sinks, "fetched": None}
    _skip(tables, layer, slot, sinks, None)


def _skip(tables, layer: int, slot: int, sinks: int, idx: torch.Tensor | None) -> None:
    """The skip page: the sinks and the prefetched rows idx [H_kv, k] (positions) of the low-bit copy."""
    fid = int(tables.qform[layer, slot])
    q = int(tables.qn[layer, slot, 0]) * tables.layout.quant_forms[fid].rows
    rows = torch.zeros(tables.H, q, dtype=torch.bool)
    rows[:, :sinks] = True
    if idx is not None:
        rows.scatter_(1, idx.long().clamp_max(max(q - 1, 0)).cpu(), idx.long().cpu() < q)
    tables.set_skip(layer, slot, rows)


def place(ctx: PressContext, seq, layer: int, step: int) -> None:
    """The rows prefetched for `step` (if they came within the sequence's wait) into their slots."""
    st, tables, slot = seq.offload_state[layer], ctx.tables, seq.cache.slot
    fetched = seq.store.take(layer, step, seq.prefetch_wait_s)
    if fetched is None:
        return
    sinks, kk = st["sinks"], fetched.idx.shape[1]
    hk = tables.H
    idx = torch.arange(sinks, sinks + kk, dtype=torch.int32).expand(hk, kk).contiguous()
    one = torch.ones(hk, kk, dtype=torch.float16)
    rows = CodedRows(idx, idx.clone(), torch.full((hk, kk), -1, dtype=torch.int32), one, one.clone(),
                     torch.full((hk, kk), ALL_HEADS, dtype=torch.uint8), fetched.k.cpu(), fetched.v.cpu())
    tables.write_coded(layer, slot, sinks, rows, entries_at=sinks)
    st["fetched"] = fetched.idx
    _skip(tables, layer, slot, sinks, fetched.idx)


def lowbit_keys(tables, layer: int, slot: int):
    """The low-bit copy's keys as `kernels.lowbit_scores` reads them: codes [H_kv, n, D, g_k·b/8],
    scale and zero [H_kv, n, D] (n key groups), and the bits."""
    lay, fid = tables.layout, int(tables.qform[layer, slot])
    f = lay.quant_forms[fid]
    n = int(tables.qn[layer, slot, 0])
    parts = lay.form_parts(fid)
    pages = tables.pool.page_view()[tables.qtable[layer, slot, :, :n].long().reshape(-1).to(tables.pool.arena.device)]
    sub, d, kgb = f.rows // f.key_group, lay.head_dim, f.key_group * f.bits // 8
    h = tables.H
    a, m = parts["kc"]
    codes = pages[:, a:a + m].reshape(h, n, d, sub, kgb).permute(0, 1, 3, 2, 4).reshape(h, n * sub, d, kgb)
    scale = pages[:, parts["ks"][0]:parts["ks"][0] + parts["ks"][1]].contiguous().view(torch.float16).view(h, n * sub, d)
    zero = pages[:, parts["kz"][0]:parts["kz"][0] + parts["kz"][1]].contiguous().view(torch.float16).view(h, n * sub, d)
    return codes.contiguous(), scale, zero, f.bits


def select(ctx: PressContext, seq, layer: int, q: torch.Tensor, lse: torch.Tensor, step: int) -> None:
    """q [H_kv, h_n, D] the speculative row's queries, lse [H_kv, h_n] their attention's log-sum-exp:
    prefetch for `step` the rows of the low-bit copy it attends to most (sinks excepted)."""
    st, off, tables, slot = seq.offload_state[layer], seq.plan.offload, ctx.tables, seq.cache.slot
    if seq.store.failed or not int(tables.qn[layer, slot, 0]):
        return
    codes, scale, zero, bits = lowbit_keys(tables, layer, slot)
    scores = lowbit_scores(q.float(), codes, scale, zero, bits) * ctx.scaling                # [H_kv, h_n, Q]
    probs = torch.exp(scores - lse[..., None].to(scores.device)).mean(1)                     # [H_kv, Q] group mean
    s, qn = st["sinks"], probs.shape[1]
    kk = min(off.top_k, qn - s)
    if kk <= 0:
        return
    wide = min(kk * max(off.rerank, 1), qn - s)
    idx = probs[:, s:].topk(wide, dim=-1).indices + s                                        # [H_kv, wide]
    seq.store.prefetch(layer, step, idx, (q * ctx.scaling).contiguous(), kk)
    if seq.recall is not None and st["fetched"] is not None:
        seq.recall.append(_recall(seq, layer, q, st, ctx.scaling, qn))


def _recall(seq, layer: int, q: torch.Tensor, st: dict, scaling: float, qn: int) -> tuple[float, float]:
    """How much of the oracle top-k (this row's attention over the exact keys) the last prefetch
    brought: (share of its rows, share of its attention mass)."""
    rows = seq.store.read(layer)
    if rows is None:
        return float("nan"), float("nan")
    keys = rows[0].to(q.device, torch.float32)                                               # [H_kv, N, D]
    probs = torch.softmax(torch.einsum("ghd,gld->ghl", q.float(), keys) * scaling, dim=-1).mean(1)
    s, fetched = st["sinks"], st["fetched"].to(q.device)
    cand = probs[:, s:qn]
    oracle = cand.topk(min(fetched.shape[1], cand.shape[1]), dim=-1)
    hit = (oracle.indices.unsqueeze(-1) + s == fetched.unsqueeze(-2)).any(-1)
    mass = (oracle.values * hit).sum() / oracle.values.sum().clamp_min(1e-30)
    return float(hit.float().mean()), float(mass)
