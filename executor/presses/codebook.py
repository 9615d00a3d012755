"""SpindleKV: the codebook saves first, eviction takes only what the codebook cannot. The layer's
eviction budget is read as a BYTE budget (the dense fp16 bytes of that many tokens on the native
KV heads), and the layer keeps the most tokens whose stored form fits it. Per KV group, K and V
are each stored as codebook entries + magnitudes (+ positions, for keys: entries are unit vectors
of pre-RoPE keys, turned back by RoPE at each row's position when attended) or as exact rows.

Which parts a layer codes (none, V, K, or both) is the form that loses least for the bytes: for
each, the tokens that fit the budget in that form, then the relative error of the observation
window's attention output over them (evicted tokens missing, coded rows rebuilt) against the
exact output over the whole context. A codebook is only built for a tensor that could pay for
itself (spec §2.11, "auto"): a sampled share of vectors with a neighbour above θ
(`kernels.mergeable_share`) must exceed the per-row cost of the coded form over a dense row.

Stored in the pool as coded rows (`kernels.paged_decode.CodedRows`): each group's kept tokens (the
union of its query heads' in GQA `repeat` mode, a head byte per row saying which see it), a coded
part's rows pointing at its codebook's entries, an exact part's rows at entries of their own. Rows
fed later are dense. Without an eviction part every token is kept and each part coded where that
holds fewer bytes.

Shapes: H query heads, H_kv KV heads, h_n = H / H_kv, W window queries, C context rows, U a group's
candidate rows, D head dim."""
from __future__ import annotations

import dataclasses

import torch

from executor.presses import evict
from executor.presses.candidate import Candidate, CodedPart, first_rank
from executor.presses.context import PressContext
from kernels import build_codebook, mergeable_share, reconstruct
from kernels.paged_decode import ALL_HEADS, CodedRows
from kernels.rope_reconstruct import unrotate_rope
from kvcore import scoring
from kvcore.attention import causal_attention
from kvcore.cost import POS_BYTES
from kvcore.plan import LayerPlan

CANDIDATES = 2    # the codebook may keep at most this many times the tokens of the dense budget
MODES = ((), ("v",), ("k",), ("k", "v"))   # which parts a layer may code: it takes the least predicted error


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float) -> torch.Tensor:
    """q [h_n, W, D] over one group's rows k, v [U, D], mask [h_n, W, U] bool (True: seen) -> [h_n, W, D]."""
    logits = torch.matmul(q, k.T.to(q.dtype)) * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits.float(), dim=-1).to(q.dtype) @ v.to(q.dtype)


def _candidate(ctx: PressContext, cb, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor,
               min_rank: torch.Tensor, itemsize: int) -> Candidate:
    """A group's candidate tokens (k, v [U, D], pos [U], weight [U]; min_rank [U] = the smallest
    eviction rank k that keeps each), with codebooks over them where one could pay."""
    d = k.shape[1]
    parts = {}
    for name, x, theta, extra in (("k", unrotate_rope(k.float(), pos, *ctx.rope), cb.theta_k, POS_BYTES),
                                  ("v", v.float(), cb.theta_v, 0)):
        per_row = (4 + itemsize + extra) / (d * itemsize)            # coded row overhead / dense row
        if mergeable_share(x, theta) <= per_row:
            parts[name] = CodedPart(name, theta, extra, None)
            continue
        codes = build_codebook(x, theta, weight)
        rope = (pos, *ctx.rope) if name == "k" else ()
        rebuilt = reconstruct(codes[0].half(), codes[1], codes[2].half(), *rope)
        parts[name] = CodedPart(name, theta, extra, codes, first_rank(codes[1], min_rank), rebuilt)
    return Candidate(pos, k, v, weight, min_rank, parts, itemsize)


def _predicted_error(q_win: torch.Tensor, exact: torch.Tensor, cands: list[Candidate], k_star: int,
                     parts: tuple[str, ...], scaling: float, c: int) -> float:
    """Relative squared error of the observation window's attention output (q_win [H, W, D] at
    the last W of c positions, exact [H, W, D]) when each group keeps its tokens ranked below
    k_star in the form a layer coding `parts` would store them."""
    hq, w = q_win.shape[0] // len(cands), q_win.shape[1]
    err = 0.0
    for g, cand in enumerate(cands):
        coded = cand.coded_parts(k_star, parts)
        kk = cand.parts["k"].rebuilt if "k" in coded else cand.k.float()                  # [U, D] post-RoPE
        vv = cand.parts["v"].rebuilt if "v" in coded else cand.v.float()
        kept = (cand.head_rank < k_star).repeat_interleave(hq // cand.head_rank.shape[0], dim=0)   # [hq, U]
        causal = cand.pos[None, :] <= torch.arange(c - w, c, device=cand.pos.device)[:, None]    # [W, U]
        out = group_attention(q_win[g * hq:(g + 1) * hq], kk, vv, kept[:, None, :] & causal[None], scaling)
        err += float((out - exact[g * hq:(g + 1) * hq]).pow(2).sum())
    return err / max(float(exact.pow(2).sum()), 1e-12)


def _coded(cand: Candidate, k_star: int, allowed: tuple[str, ...], heads: torch.Tensor, dtype) -> dict:
    """One group's stored form keeping its tokens first kept at k < k_star: per part its entries
    [n, D], each row's entry and magnitude [U'], the keys' positions (-1 where keys are exact)."""
    sel = cand.kept(k_star)
    coded = cand.coded_parts(k_star, allowed)
    u = int(sel.sum())
    out = {"heads": heads[sel]}
    for name in ("k", "v"):
        if name in coded:
            c, ref, mag = cand.parts[name].codes
            used, inv = torch.unique(ref[sel], return_inverse=True)
            out[name] = (c[used].to(dtype), inv.to(torch.int32), mag[sel].half())
        else:
            rows = (cand.k if name == "k" else cand.v)[sel].to(dtype)
            out[name] = (rows, torch.arange(u, dtype=torch.int32), torch.ones(u, dtype=torch.float16))
    out["pos"] = cand.pos[sel].to(torch.int32) if "k" in coded else torch.full((u,), -1, dtype=torch.int32)
    return out


def _stack(groups: list[dict], d: int, dtype) -> CodedRows:
    """Each KV group's stored form, padded to the largest group's rows and entries (padding rows
    absent: K entry -1)."""
    m = max(len(g["heads"]) for g in groups)
    nk = max(g["k"][0].shape[0] for g in groups)
    nv = max(g["v"][0].shape[0] for g in groups)
    h = len(groups)
    ref_k = torch.full((h, m), -1, dtype=torch.int32)
    ref_v, pos = torch.zeros(h, m, dtype=torch.int32), torch.full((h, m), -1, dtype=torch.int32)
    mag_k, mag_v = torch.zeros(h, m, dtype=torch.float16), torch.zeros(h, m, dtype=torch.float16)
    heads = torch.zeros(h, m, dtype=torch.uint8)
    ek, ev = torch.zeros(h, nk, d, dtype=dtype), torch.zeros(h, nv, d, dtype=dtype)
    for i, g in enumerate(groups):
        u = len(g["heads"])
        (ck, rk, mk), (cv, rv, mv) = g["k"], g["v"]
        ref_k[i, :u], ref_v[i, :u], pos[i, :u] = rk.cpu(), rv.cpu(), g["pos"].cpu()
        mag_k[i, :u], mag_v[i, :u], heads[i, :u] = mk.cpu(), mv.cpu(), g["heads"].cpu()
        ek[i, :ck.shape[0]], ev[i, :cv.shape[0]] = ck.cpu(), cv.cpu()
    return CodedRows(ref_k, ref_v, pos, mag_k, mag_v, heads, ek, ev)


def press(ctx: PressContext, seq, layer: int, lp: LayerPlan, q, k, v, later_k=None, later_v=None) -> None:
    """The layer's context as SpindleKV stores it, then the later rows dense."""
    ev = lp.eviction or evict.KEEP_ALL
    lp_ev = dataclasses.replace(lp, eviction=ev)
    hk, c, d = k.shape
    dtype, itemsize = ctx.tables.dtype, ctx.tables.layout.itemsize
    repeat = ev.gqa_mode == "repeat" and ctx.group > 1
    heads_n = ctx.num_query_heads if repeat else hk
    hn = heads_n // hk
    raw = evict.head_scores(lp_ev, q, k, ctx.scaling, seq.acc.get(layer)) if lp.eviction is not None else None
    dev = k.device
    groups = []
    if raw is None:                                        # every token kept, each part coded where it pays
        for g in range(hk):
            pos = torch.arange(c, device=dev)
            cand = _candidate(ctx, lp.codebook, k[g], v[g], pos, torch.full((c,), float(hn)),
                              torch.zeros(c, dtype=torch.long, device=dev), itemsize)
            groups.append(_coded(cand, 1, ("k", "v"), torch.full((c,), ALL_HEADS, dtype=torch.uint8), dtype))
    else:
        scores = scoring.ranking(raw, ev, hk)                                      # [heads, C]
        window = min(ev.window, c)
        sinks = min(ev.sink_tokens, c - window)
        span = c - window - sinks
        keep = max(0, min(evict.planned_keep(lp_ev, c), span))
        budget = hk * (sinks + window + keep) * 2 * d * itemsize
        k_max = min(span, CANDIDATES * max(keep, 1))
        fixed = torch.cat([torch.arange(sinks, device=dev), torch.arange(c - window, c, device=dev)])
        top = scores[:, sinks:c - window].topk(k_max, dim=-1).indices + sinks            # [heads, k_max], best first
        tokens = torch.cat([fixed.expand(heads_n, -1), top], dim=1)                      # [heads, f + k_max]
        ranks = torch.cat([torch.full((heads_n, len(fixed)), -1, device=dev),
                           torch.arange(k_max, device=dev).expand(heads_n, -1)], dim=1)
        cands = []
        for g in range(hk):
            toks, rk = tokens[g * hn:(g + 1) * hn], ranks[g * hn:(g + 1) * hn]           # [h_n, f + k_max]
            uniq, inv = torch.unique(toks.flatten(), return_inverse=True)                 # [U] sorted positions
            min_rank = torch.empty(len(uniq), dtype=rk.dtype, device=dev).scatter_reduce(
                0, inv, rk.flatten(), "amin", include_self=False)
            weight = torch.bincount(inv, minlength=len(uniq)).float()
            head_rank = torch.full((hn, len(uniq)), k_max, device=dev).scatter_(1, inv.view(hn, -1), rk)  # [h_n, U]
            cands.append(dataclasses.replace(_candidate(ctx, lp.codebook, k[g, uniq], v[g, uniq], uniq, weight,
                                                        min_rank, itemsize), head_rank=head_rank))
        ks = torch.arange(k_max + 1, device=dev)
        q_win = q[:, -max(1, min(ev.window, q.shape[1])):].float()                        # [H, W, D]
        exact = causal_attention(q_win[None], k[None].float(), v[None].float(), ctx.scaling)[0].transpose(0, 1)
        best = None
        for parts in MODES:
            if parts and not all(any(cd.parts[p].codable for cd in cands) for p in parts):
                continue                                    # nothing to code: same as a smaller mode
            size = sum(cd.bytes(ks, parts) for cd in cands)
            fits = torch.nonzero(size <= budget).flatten()
            k_star = int(fits.max()) if len(fits) else 0
            err = _predicted_error(q_win, exact, cands, k_star, parts, ctx.scaling, c)
            if best is None or err < best[0]:
                best = (err, k_star, parts)
        _, k_star, parts = best
        for cd in cands:
            kept = cd.head_rank < k_star                                                  # [h_n, U] each head's rows
            bits = (kept.to(torch.int32) << torch.arange(hn, device=dev)[:, None]).sum(0)
            heads = bits.to(torch.uint8) if repeat else torch.full_like(bits, ALL_HEADS, dtype=torch.uint8)
            groups.append(_coded(cd, k_star, parts, heads, dtype))
    ctx.tables.store_coded(layer, seq.cache.slot, _stack(groups, d, dtype), later_k, later_v)
