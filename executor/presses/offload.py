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
    quantized = int(tables.quant_rows(layer, torch.tensor([slot]))[0])
    sinks = min(off.sink_tokens, quantized)
    tables.store_coded(layer, slot, _slots(off, sinks, kk[:, :sinks], vv[:, :sinks]), replace=False)
    seq.offload_state[layer] = {"sinks": sinks, "fetched": None}
    _skip(tables, layer, slot, sinks, None)


def _skip(tables, layer: int, slot: int, sinks: int, idx: torch.Tensor | None) -> None:
    """The skip page: the sinks and the prefetched rows idx [H_kv, k] (positions) of the low-bit copy."""
    _skips(tables, layer, torch.tensor([slot]), torch.tensor([sinks]), None if idx is None else idx[None])


def _skips(tables, layer: int, slots: torch.Tensor, sinks: torch.Tensor, idx: torch.Tensor | None) -> None:
    """Each sequence's skip page, in one write: slots, sinks [S]; its sinks and its prefetched rows
    idx [S, H_kv, k] (positions) of its low-bit copy (those past its quant rows not marked)."""
    q = tables.quant_rows(layer, slots)                                                      # [S]
    width = max(int(q.max()), 1)
    rows = (torch.arange(width) < sinks[:, None]).repeat_interleave(tables.H, 0)
    rows = rows.view(len(slots), tables.H, width)                                            # [S, H_kv, longest Q]
    if idx is not None:
        idx = idx.long().cpu()
        top = (q - 1).clamp_min(0)[:, None, None]
        rows.scatter_(2, torch.minimum(idx, top), idx < q[:, None, None])
    tables.set_skips(layer, slots, rows)


def place(ctx: PressContext, seqs: list, layer: int, steps: list[int]) -> None:
    """Before a decode step's attention: each sequence's rows prefetched for its step (if they came
    within its wait) into its slots, exact — their entries in one write for all, the slots' fields
    (the same every step) only when their count changes — and the skip pages marking them and the
    sinks, in one write."""
    got = [(seq, seq.store.take(layer, step, seq.prefetch_wait_s)) for seq, step in zip(seqs, steps)]
    got = [(seq, f) for seq, f in got if f is not None]
    if not got:
        return
    tables = ctx.tables
    for seq, f in got:
        st = seq.offload_state[layer]
        if st.get("slots") != f.idx.shape[1]:
            tables.write_coded(layer, seq.cache.slot, st["sinks"], _fetched_slots(tables.H, st["sinks"], f.idx.shape[1]))
            st["slots"] = f.idx.shape[1]
        st["fetched"] = f.idx
    for kk in sorted({f.idx.shape[1] for _, f in got}):
        part = [(seq, f) for seq, f in got if f.idx.shape[1] == kk]
        slots = torch.tensor([seq.cache.slot for seq, _ in part])                              # [S]
        sinks = torch.tensor([seq.offload_state[layer]["sinks"] for seq, _ in part])           # [S]
        tables.write_entries(layer, slots, sinks, torch.stack([f.k for _, f in part]), torch.stack([f.v for _, f in part]))
        _skips(tables, layer, slots, sinks, torch.stack([f.idx for _, f in part]))


def _fetched_slots(hk: int, sinks: int, kk: int) -> CodedRows:
    """The fields of coded slots [sinks, sinks + kk), each its own exact entry (the entries apart)."""
    idx = torch.arange(sinks, sinks + kk, dtype=torch.int32).expand(hk, kk).contiguous()
    one = torch.ones(hk, kk, dtype=torch.float16)
    none = torch.zeros(hk, 0, 1)
    return CodedRows(idx, idx.clone(), torch.full((hk, kk), -1, dtype=torch.int32), one, one.clone(),
                     torch.full((hk, kk), ALL_HEADS, dtype=torch.uint8), none, none)


def lowbit_keys(tables, layer: int, slots: list[int]):
    """The low-bit copies' keys of sequences of one quant form as `kernels.lowbit_scores` reads
    them, each padded to the longest (n key groups; a shorter one's last are any page's):
    codes [S·H_kv, n, D, g_k·b/8], scale and zero [S·H_kv, n, D], and the bits."""
    lay, fid = tables.layout, int(tables.qform[layer, slots[0]])
    f = lay.quant_forms[fid]
    sl = torch.tensor(slots)
    n = int(tables.qn[layer].index_select(0, sl)[:, 0].max())
    parts = lay.form_parts(fid)
    table = tables.qtable[layer].index_select(0, sl)[:, :, :n]                               # [S, H_kv, n]
    index = table.long().reshape(-1).to(tables.pool.arena.device)
    view = tables.pool.page_view()

    def part(name):                          # the key part `name` of those pages, alone: [S·H_kv·n, bytes]
        a, m = parts[name]
        return view[:, a:a + m].index_select(0, index)
    sub, d, kgb = f.rows // f.key_group, lay.head_dim, f.key_group * f.bits // 8
    h = len(slots) * tables.H
    codes = part("kc").reshape(h, n, d, sub, kgb).permute(0, 1, 3, 2, 4).reshape(h, n * sub, d, kgb)
    scale = part("ks").view(torch.float16).view(h, n * sub, d)
    zero = part("kz").view(torch.float16).view(h, n * sub, d)
    return codes.contiguous(), scale, zero, f.bits


def select(ctx: PressContext, seqs: list, layer: int, q: torch.Tensor, lse: torch.Tensor, steps: list[int]) -> None:
    """q [S, H_kv, h_n, D] the speculative rows' queries, lse [S, H_kv, h_n] their attention's
    log-sum-exp: for each sequence, prefetch for its step the rows of its low-bit copy its row
    attends to most (sinks excepted). Scored in one call per quant form for all the sequences."""
    tables = ctx.tables
    live = [i for i, seq in enumerate(seqs)
            if not seq.store.failed and int(tables.qn[layer, seq.cache.slot, 0])]
    forms: dict[int, list[int]] = {}
    for i in live:
        forms.setdefault(int(tables.qform[layer, seqs[i].cache.slot]), []).append(i)
    for part in forms.values():
        _select_form(ctx, [seqs[i] for i in part], layer, q[part], lse[part], [steps[i] for i in part])


def _select_form(ctx: PressContext, seqs: list, layer: int, q: torch.Tensor, lse: torch.Tensor, steps: list[int]) -> None:
    """`select` for sequences whose low-bit copies share a quant form."""
    tables, s = ctx.tables, len(seqs)
    hk, hn, d = q.shape[1:]
    slots = [seq.cache.slot for seq in seqs]
    codes, scale, zero, bits = lowbit_keys(tables, layer, slots)
    scores = lowbit_scores(q.reshape(s * hk, hn, d).float(), codes, scale, zero, bits) * ctx.scaling  # [S·H_kv, h_n, Q]
    logp = scores.view(s, hk, hn, -1) - lse[..., None].to(scores.device)
    mean = torch.logsumexp(logp, dim=2)                                  # [S, H_kv, Q] log of the group mean (·h_n)
    qn = tables.quant_rows(layer, torch.tensor(slots)).tolist()                              # [S] rows
    sinks = [seq.offload_state[layer]["sinks"] for seq in seqs]
    cols = torch.arange(mean.shape[-1], device=mean.device)
    lo = torch.tensor(sinks, device=mean.device)[:, None, None]
    hi = torch.tensor(qn, device=mean.device)[:, None, None]
    mean = mean.masked_fill((cols < lo) | (cols >= hi), float("-inf"))
    kk = [min(seq.plan.offload.top_k, n - sk) for seq, n, sk in zip(seqs, qn, sinks)]
    wide = [min(k * max(seq.plan.offload.rerank, 1), n - sk) for seq, k, n, sk in zip(seqs, kk, qn, sinks)]
    if max(wide) <= 0:
        return
    top = mean.topk(max(wide), dim=-1).indices                                               # [S, H_kv, W]
    for j, seq in enumerate(seqs):
        if kk[j] <= 0:
            continue
        seq.store.prefetch(layer, steps[j], top[j, :, :wide[j]], (q[j] * ctx.scaling).contiguous(), kk[j])
        st = seq.offload_state[layer]
        if seq.recall is not None and st["fetched"] is not None:
            seq.recall.append(_recall(seq, layer, q[j], st, ctx.scaling, qn[j]))


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
