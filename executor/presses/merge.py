"""MiniCache: one layer pair's context merged across layers (spec minicache.md §2). The pair is
declared by its upper layer's plan, `Merge(with_layer=lower, t, retention_k, retention_v)`; the
lower layer's plan carries no part, and its own press leaves its dense context for the upper's,
which runs after it in the same forward and merges both.

Rows are tokens with all KV heads concatenated (W = H_kv·D); K and V merge independently: SLERP of
the two layers' rows gives a unit direction and both layers' magnitudes (`kernels.slerp_merge`).
Keys merge post-RoPE, as cached (both layers turn a position by the same rotation, so the angles
are the same pre- or post-RoPE). In the pool each layer's streams are coded rows over entries the
pair shares (the directions, per KV head the head's D channels; owned by the upper layer): row r
of a layer is its magnitude times direction r. The rows MiniCache retains — per K and V the
⌈share·N⌉ most distinct by angular distance (`retention_rule` "distinct", the paper's prose; or
"similar", Eq. 4 as printed) — are kept exact, in each layer's dense pages, for both K and V (a row
retained for K or for V), and absent from its coded rows. Rows fed later stay dense in each layer.

Shapes: H_kv KV heads, D head dim, W = H_kv·D, N context rows, M retained rows."""
from __future__ import annotations

import math

import torch

from executor.presses.context import PressContext, UnsupportedPlan
from kernels import slerp_merge
from kernels.paged_decode import ALL_HEADS, CodedRows
from kvcore.plan import LayerPlan

RETENTION_RULES = ("distinct", "similar")
RULE = "distinct"


def retained(d: torch.Tensor, share: float, rule: str = RULE) -> torch.Tensor:
    """d [N] angular distances Ω/π -> the ⌈share·N⌉ rows retained [M] int64 ascending: the largest
    distances ("distinct") or the smallest ("similar")."""
    if rule not in RETENTION_RULES:
        raise ValueError(f"retention rule {rule!r} is not one of {RETENTION_RULES}")
    m = min(d.shape[0], math.ceil(share * d.shape[0] - 1e-9))
    return torch.argsort(d, descending=rule == "distinct", stable=True)[:m].sort().values


def lower(ctx: PressContext, seq, layer: int, lp: LayerPlan, q, k, v, later_k=None, later_v=None) -> None:
    """The lower layer of a pair keeps its dense context until its upper layer merges both."""
    if later_k is not None:                  # a rebuild: its rows as they were, for the upper to merge
        ctx.tables.store_dense(layer, seq.cache.slot, torch.cat([k, later_k], 1), torch.cat([v, later_v], 1))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[H_kv, N, D] -> [N, H_kv·D]: one row per token, its heads concatenated."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def press(ctx: PressContext, seq, layer: int, lp: LayerPlan, q, k, v, later_k=None, later_v=None) -> None:
    """The upper layer: both layers' contexts (the lower's from its dense pages) merged into shared
    directions, each layer's magnitudes and retained rows, then each layer's later rows dense."""
    mg, tables, slot = lp.merge, ctx.tables, seq.cache.slot
    lo = mg.with_layer
    if not 0 <= lo < layer:
        raise UnsupportedPlan(f"layer {layer}: merge.with_layer = {lo} must name an earlier layer")
    hk, n, d = k.shape
    k_lo, v_lo = (x.to(k.dtype) for x in tables.dense(lo, slot))                      # [H_kv, N + L', D]
    n_later = k_lo.shape[1] - n
    lo_later = (k_lo[:, n:], v_lo[:, n:]) if n_later > 0 else (None, None)
    k_lo, v_lo = k_lo[:, :n], v_lo[:, :n]
    dtype = tables.dtype
    dirs, mags, keep = {}, {}, torch.zeros(n, dtype=torch.bool)
    for name, x_lo, x_hi, share in (("k", k_lo, k, mg.retention_k), ("v", v_lo, v, mg.retention_v)):
        e, m0, m1, omega = slerp_merge(_rows(x_lo).to(dtype), _rows(x_hi).to(dtype), mg.t, dtype)   # [N, W], [N] ×3
        dirs[name] = e.view(n, hk, d).transpose(0, 1)                                   # [H_kv, N, D]
        mags[name] = (m0.half(), m1.half())
        keep[retained(omega / math.pi, share).cpu()] = True
    ref = torch.where(keep, -1, torch.arange(n, dtype=torch.int32)).to(torch.int32).expand(hk, n).contiguous()
    heads = torch.full((hk, n), ALL_HEADS, dtype=torch.uint8)
    none = torch.full((hk, n), -1, dtype=torch.int32)
    idx = keep.nonzero()[:, 0]
    for which, at, (xk, xv), (lk, lv) in ((1, layer, (k, v), (later_k, later_v)), (0, lo, (k_lo, v_lo), lo_later)):
        coded = CodedRows(ref, torch.arange(n, dtype=torch.int32).expand(hk, n).contiguous(), none,
                          mags["k"][which].cpu().expand(hk, n).contiguous(), mags["v"][which].cpu().expand(hk, n).contiguous(),
                          heads, dirs["k"].cpu(), dirs["v"].cpu())
        exact_k, exact_v = xk[:, idx.to(xk.device)], xv[:, idx.to(xv.device)]          # [H_kv, M, D]
        if lk is not None:
            exact_k, exact_v = torch.cat([exact_k, lk], 1), torch.cat([exact_v, lv], 1)
        tables.store_coded(at, slot, coded, exact_k, exact_v, entries=which == 1)     # the directions once: the upper's
    tables.share_entries(lo, layer, slot)
