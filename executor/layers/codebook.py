"""`codebook` cache layer (SpindleKV) — the codebook saves first, eviction takes only what the
codebook cannot: the layer's eviction budget is read as a BYTE budget (the dense fp16 bytes of
that many tokens on the native KV heads), and the layer keeps the most tokens whose stored
form fits it. Per KV group the stored form is whichever is smaller: codebook indices +
magnitudes + positions over unit-vector codebooks (pre-RoPE K, V), or dense rows.

Without an eviction part the layer keeps every token and codes each group where that holds
fewer bytes."""
from __future__ import annotations

import torch

from executor.layers.evicted import EvictedLayer, Kept
from executor.layers.groups import CodebookGroup, DenseGroup, dense_bytes, index_bytes, nbytes
from kernels import build_codebook
from kernels.rope_reconstruct import unrotate_rope

CANDIDATES = 2    # the codebook may keep at most this many times the tokens of the dense budget
BIG = 1 << 40


class CodebookLayer(EvictedLayer):
    kind = "codebook"

    def make_group(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor):
        cb = self.plan.codebook
        coded = CodebookGroup.build(k, v, pos, self.storage_dtype, self.ctx.rope, cb.theta_k, cb.theta_v, weight)
        dense = dense_bytes(k.shape[0], k.shape[1], self.storage_dtype)
        return coded if nbytes(coded) < dense else DenseGroup(k, v, pos, self.storage_dtype)

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
        fixed = torch.cat([torch.arange(sinks), torch.arange(t - window, t)])
        top = scores[:, sinks:t - window].topk(k_max, dim=-1).indices + sinks            # [heads, k_max], best first
        tokens = torch.cat([fixed.expand(heads, -1), top], dim=1)                        # [heads, f + k_max]
        ranks = torch.cat([torch.full((heads, len(fixed)), -1), torch.arange(k_max).expand(heads, -1)], dim=1)

        cands, size = [], torch.zeros(k_max + 1, dtype=torch.long)
        ks = torch.arange(k_max + 1)
        for g in range(hk):
            toks, rk = tokens[g * hn:(g + 1) * hn].flatten(), ranks[g * hn:(g + 1) * hn].flatten()
            uniq, inv = torch.unique(toks, return_inverse=True)                            # [U] sorted positions
            min_rank = torch.full((len(uniq),), BIG).scatter_reduce(0, inv, rk, "amin")  # [U] first k keeping it
            weight = torch.bincount(inv, minlength=len(uniq)).float()
            cand = self._candidate(k[g, uniq], v[g, uniq], uniq, weight, min_rank)
            size += torch.minimum(cand["coded"](ks), cand["dense"](ks))
            cands.append(cand)
        n_rows = len(fixed) + ks
        if hn > 1:                                                                         # per-head index
            size += heads * n_rows * index_bytes(torch.tensor(max(len(c["uniq"]) for c in cands)))
        fits = torch.nonzero(size <= budget).flatten()
        k_star = int(fits.max()) if len(fits) else 0

        rows = torch.cat([fixed.expand(heads, -1), top[:, :k_star]], dim=1).sort(dim=1).values
        groups = [self._group(c, k_star) for c in cands]
        self.compress(Kept(rows, self.repeat), k, v, groups)

    def _candidate(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor,
                   min_rank: torch.Tensor) -> dict:
        """Codebooks over a group's candidate tokens, and its bytes as a function of k."""
        cb, elem, d = self.plan.codebook, self.storage_dtype.itemsize, k.shape[1]
        k_pre = unrotate_rope(k.float(), pos, *self.ctx.rope)
        codes_k = build_codebook(k_pre, cb.theta_k, weight)
        codes_v = build_codebook(v.float(), cb.theta_v, weight)
        sorted_rank = min_rank.sort().values
        entry_k = torch.full((len(codes_k[0]),), BIG).scatter_reduce(0, codes_k[1], min_rank, "amin").sort().values
        entry_v = torch.full((len(codes_v[0]),), BIG).scatter_reduce(0, codes_v[1], min_rank, "amin").sort().values

        def count(sorted_values, ks):           # how many values are < k, for each k
            return torch.searchsorted(sorted_values, ks)

        def coded(ks):
            u, ek, ev = count(sorted_rank, ks), count(entry_k, ks), count(entry_v, ks)
            return (ek + ev) * d * elem + u * (index_bytes(ek) + index_bytes(ev) + 2 * elem + 4)

        def dense(ks):
            return dense_bytes(count(sorted_rank, ks), d, self.storage_dtype)

        return dict(uniq=pos, k=k, v=v, codes_k=codes_k, codes_v=codes_v, min_rank=min_rank,
                    coded=coded, dense=dense)

    def _group(self, cand: dict, k_star: int):
        """The token store of one group keeping its tokens first kept at k < k_star."""
        sel = cand["min_rank"] < k_star
        ks = torch.tensor([k_star])
        if int(cand["coded"](ks)) >= int(cand["dense"](ks)):
            return DenseGroup(cand["k"][sel], cand["v"][sel], cand["uniq"][sel], self.storage_dtype)
        (ck, rk, mk), (cv, rv, mv) = cand["codes_k"], cand["codes_v"]
        cb = self.plan.codebook
        return CodebookGroup((ck, rk[sel], mk[sel]), (cv, rv[sel], mv[sel]), cand["uniq"][sel],
                             self.storage_dtype, self.ctx.rope, cb.theta_k, cb.theta_v)
