"""`codebook` cache layer (SpindleKV) — the codebook saves first, eviction takes only what the
codebook cannot: the layer's eviction budget is read as a BYTE budget (the dense fp16 bytes of
that many tokens on the native KV heads), and the layer keeps the most tokens whose stored
form fits it. Per KV group, K and V are each stored as codebook indices + magnitudes (+
positions, for keys) over a unit-vector codebook (pre-RoPE K, V), or as dense rows.

Which parts the layer codes (none, V, K, or both) is the form that loses least for the bytes:
for each, the tokens that fit the budget in that form, then the relative error of the
observation window's attention output over them (evicted tokens missing, coded rows rebuilt)
against the exact output over the whole context. Evicting and coding are priced in one unit,
so a codebook whose θ is too loose for a layer (keys of a small model, often) is not used
even where it would hold more tokens. A part is coded only where that is also smaller.

A codebook is only built for a tensor that could pay for itself (spec §2.11, "auto"): a
sampled share of vectors with a neighbour above θ (`kernels.mergeable_share`) must exceed
the per-row cost of the coded form (index + magnitude [+ position]) over a dense row's bytes.
In the deep layers of a small model almost nothing merges, so they skip the O(N²) build and
keep exact rows.

Without an eviction part the layer keeps every token and codes each part where that holds
fewer bytes."""
from __future__ import annotations

import dataclasses

import torch

from executor.attention import group_attention
from kvcore.attention import causal_attention
from executor.layers.candidate import Candidate, CodedPart, first_rank
from executor.layers.evicted import EvictedLayer, Kept
from executor.layers.groups import CodebookGroup, CodedRows, DenseGroup, dense_bytes
from kernels import build_codebook, mergeable_share, reconstruct
from kernels.rope_reconstruct import unrotate_rope
from kvcore.cost import POS_BYTES, index_dtype_bytes

CANDIDATES = 2    # the codebook may keep at most this many times the tokens of the dense budget
MODES = ((), ("v",), ("k",), ("k", "v"))   # which parts a layer may code: it takes the least predicted error


class CodebookLayer(EvictedLayer):
    kind = "codebook"

    def make_group(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor):
        """Every token kept: k, v [U, D] (post-RoPE keys), pos [U], weight [U]."""
        cand = self._candidate(k, v, pos, weight, torch.zeros(len(pos), dtype=torch.long, device=pos.device))
        return self._group(cand, 1, ("k", "v"))

    def compress_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        """q: [H, Tq, D] the context's last chunk; k, v: [H_kv, T, D] the whole context."""
        scores = self.scores(q, k, scaling)
        if self.plan.eviction is None or scores is None:
            return super().compress_context(q, k, v, scaling)
        ev, (hk, t, d) = self.eviction, k.shape
        window = min(ev.window, t)
        sinks = min(ev.sink_tokens, t - window)
        span = t - window - sinks
        keep = max(0, min(self.planned_keep(t), span))
        budget = hk * dense_bytes(sinks + window + keep, d, self.storage_dtype)
        k_max = min(span, CANDIDATES * max(keep, 1))
        heads = self.stored_heads
        hn = heads // hk
        dev = k.device
        fixed = torch.cat([torch.arange(sinks, device=dev), torch.arange(t - window, t, device=dev)])
        top = scores[:, sinks:t - window].topk(k_max, dim=-1).indices + sinks            # [heads, k_max], best first
        tokens = torch.cat([fixed.expand(heads, -1), top], dim=1)                        # [heads, f + k_max]
        ranks = torch.cat([torch.full((heads, len(fixed)), -1, device=dev),
                           torch.arange(k_max, device=dev).expand(heads, -1)], dim=1)

        cands = []
        for g in range(hk):
            toks, rk = tokens[g * hn:(g + 1) * hn], ranks[g * hn:(g + 1) * hn]                # [h_n, f + k_max]
            uniq, inv = torch.unique(toks.flatten(), return_inverse=True)                  # [U] sorted positions
            min_rank = torch.empty(len(uniq), dtype=rk.dtype, device=dev).scatter_reduce(
                0, inv, rk.flatten(), "amin", include_self=False)                         # [U] every token has a rank
            weight = torch.bincount(inv, minlength=len(uniq)).float()
            head_rank = torch.full((hn, len(uniq)), k_max, device=dev).scatter_(1, inv.view(hn, -1), rk)  # [h_n, U]
            cands.append(dataclasses.replace(self._candidate(k[g, uniq], v[g, uniq], uniq, weight, min_rank),
                                             head_rank=head_rank))
        ks = torch.arange(k_max + 1, device=dev)
        q_win = q[:, -max(1, min(ev.window, q.shape[1])):].float()                        # [H, W, D]
        exact = causal_attention(q_win[None], k[None].float(), v[None].float(), scaling)[0].transpose(0, 1)  # [H, W, D]

        best = None
        for parts in MODES:
            if parts and not all(any(c.parts[p].codable for c in cands) for p in parts):
                continue                                        # nothing to code: same as a smaller mode
            size = sum(c.bytes(ks, parts) + (hn * c.rows(ks) if hn > 1 else 0) for c in cands)   # + head masks
            fits = torch.nonzero(size <= budget).flatten()
            k_star = int(fits.max()) if len(fits) else 0
            err = self._predicted_error(q_win, exact, cands, k_star, parts, scaling, t)
            if best is None or err < best[0]:
                best = (err, k_star, parts)
        self.predicted_error, k_star, parts = best

        rows = torch.cat([fixed.expand(heads, -1), top[:, :k_star]], dim=1).sort(dim=1).values
        groups = [self._group(c, k_star, parts) for c in cands]
        self.compress(Kept(rows, self.repeat), k, v, groups)

    def _predicted_error(self, q_win: torch.Tensor, exact: torch.Tensor, cands: list[Candidate], k_star: int,
                         parts: tuple[str, ...], scaling: float, t: int) -> float:
        """Relative squared error of the observation window's attention output (q_win [H, W, D]
        at the last W of t positions, exact [H, W, D]) when each group keeps its tokens ranked below k_star, in the form a
        layer coding `parts` would store them: evicted tokens and codebook error alike, in one
        unit, so bytes go to whichever loses less."""
        hq = q_win.shape[0] // len(cands)
        w = q_win.shape[1]
        err = 0.0
        for g, c in enumerate(cands):
            coded = c.coded_parts(k_star, parts)
            kk = c.parts["k"].rebuilt if "k" in coded else c.k.float()                     # [U, D] post-RoPE
            vv = c.parts["v"].rebuilt if "v" in coded else c.v.float()                     # [U, D]
            kept = c.head_rank < k_star                                                     # [h_n, U]
            kept = kept.repeat_interleave(hq // kept.shape[0], dim=0)                      # [hq, U]
            causal = c.pos[None, :] <= torch.arange(t - w, t, device=c.pos.device)[:, None]  # [W, U]
            mask = kept[:, None, :] & causal[None]                                         # [hq, W, U]
            out = group_attention(q_win[g * hq:(g + 1) * hq], kk, vv, mask, scaling)        # [hq, W, D]
            err += float((out - exact[g * hq:(g + 1) * hq]).pow(2).sum())
        return err / max(float(exact.pow(2).sum()), 1e-12)

    def _candidate(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor,
                   min_rank: torch.Tensor) -> Candidate:
        """A group's candidate tokens (k, v [U, D], pos [U], weight [U]; min_rank [U] = the
        smallest eviction rank k that keeps each), with codebooks over them where one could pay."""
        cb, elem, d = self.plan.codebook, self.storage_dtype.itemsize, k.shape[1]
        row_index = index_dtype_bytes(len(pos))                      # the widest index these rows could need
        parts = {}
        for name, x, theta, extra in (("k", unrotate_rope(k.float(), pos, *self.ctx.rope), cb.theta_k, POS_BYTES),
                                      ("v", v.float(), cb.theta_v, 0)):
            per_row = (row_index + elem + extra) / (d * elem)        # coded row overhead / dense row
            if mergeable_share(x, theta) <= per_row:
                parts[name] = CodedPart(name, theta, extra, None)
                continue
            codes = build_codebook(x, theta, weight)
            rope = (pos, *self.ctx.rope) if name == "k" else ()
            rebuilt = reconstruct(codes[0].to(self.storage_dtype), codes[1], codes[2].to(self.storage_dtype), *rope)
            parts[name] = CodedPart(name, theta, extra, codes, first_rank(codes[1], min_rank), rebuilt)
        return Candidate(pos, k, v, weight, min_rank, parts, elem)

    def _group(self, cand: Candidate, k_star: int, allowed: tuple[str, ...]):
        """The token store of one group keeping its tokens first kept at k < k_star."""
        sel = cand.kept(k_star)
        stored = {}
        for name in cand.coded_parts(k_star, allowed):
            part = cand.parts[name]
            c, ref, mag = part.codes
            stored[name] = CodedRows(c, ref[sel], mag[sel], part.theta, self.storage_dtype)
        if not stored:
            return DenseGroup(cand.k[sel], cand.v[sel], cand.pos[sel], self.storage_dtype)
        return CodebookGroup(stored.get("k", cand.k[sel]), stored.get("v", cand.v[sel]),
                             cand.pos[sel], self.storage_dtype, self.ctx.rope)
