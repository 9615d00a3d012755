"""`codebook` cache layer (SpindleKV) — the codebook saves first, eviction takes only what the
codebook cannot: the layer's eviction budget is read as a BYTE budget (the dense fp16 bytes of
that many tokens on the native KV heads), and the layer keeps the most tokens whose stored
form fits it. Per KV group, K and V are each stored in whichever form is smaller: codebook
indices + magnitudes (+ positions, for keys) over a unit-vector codebook (pre-RoPE K, V), or
dense rows.

A codebook is only built for a tensor that could pay for itself (spec §2.11, "auto"): a
sampled share of vectors with a neighbour above θ (`kernels.mergeable_share`) must exceed
the per-row cost of the coded form (index + magnitude [+ position]) over a dense row's bytes.
In the deep layers of a small model almost nothing merges, so they skip the O(N²) build and
keep exact rows.

Without an eviction part the layer keeps every token and codes each part where that holds
fewer bytes."""
from __future__ import annotations

import torch

from executor.layers.evicted import EvictedLayer, Kept
from executor.layers.groups import CodebookGroup, CodedRows, DenseGroup, dense_bytes, index_bytes
from kernels import build_codebook, mergeable_share
from kernels.rope_reconstruct import unrotate_rope

CANDIDATES = 2    # the codebook may keep at most this many times the tokens of the dense budget
BIG = 1 << 40
POS_BYTES = 4     # int32 position per coded key


class CodebookLayer(EvictedLayer):
    kind = "codebook"

    def make_group(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor):
        """Every token kept: k, v [U, D] (post-RoPE keys), pos [U], weight [U]."""
        cand = self._candidate(k, v, pos, weight, torch.zeros(len(pos), dtype=torch.long))
        return self._group(cand, 1)

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
            size += cand["bytes"](ks)
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
        """A group's candidate tokens (k, v [U, D], pos [U], weight [U]; min_rank [U] = the
        smallest eviction rank k that keeps each): codebooks over them where one could pay, and
        the group's bytes as a function of k (each part in its smaller form)."""
        cb, elem, d = self.plan.codebook, self.storage_dtype.itemsize, k.shape[1]
        sorted_rank = min_rank.sort().values
        row_index = int(index_bytes(torch.tensor(len(pos))))         # the widest index these rows could need
        parts = {}
        for name, x, theta, extra in (("k", unrotate_rope(k.float(), pos, *self.ctx.rope), cb.theta_k, POS_BYTES),
                                      ("v", v.float(), cb.theta_v, 0)):
            per_row = (row_index + elem + extra) / (d * elem)        # coded row overhead / dense row
            codes = build_codebook(x, theta, weight) if mergeable_share(x, theta) > per_row else None
            first = None if codes is None else (
                torch.full((len(codes[0]),), BIG).scatter_reduce(0, codes[1], min_rank, "amin").sort().values)
            parts[name] = dict(codes=codes, first=first, extra=extra, theta=theta)

        def count(sorted_values, ks):           # how many values are < k, for each k
            return torch.searchsorted(sorted_values, ks)

        def part_bytes(part, ks):               # (coded or BIG, dense) bytes of one tensor
            u = count(sorted_rank, ks)
            dense = u * d * elem
            if part["codes"] is None:
                return torch.full_like(dense, BIG), dense
            ent = count(part["first"], ks)
            return ent * d * elem + u * (index_bytes(ent) + elem + part["extra"]), dense

        def total(ks):
            return sum(torch.minimum(*part_bytes(p, ks)) for p in parts.values())

        return dict(uniq=pos, k=k, v=v, weight=weight, min_rank=min_rank, parts=parts,
                    part_bytes=part_bytes, bytes=total)

    def _group(self, cand: dict, k_star: int):
        """The token store of one group keeping its tokens first kept at k < k_star."""
        sel = cand["min_rank"] < k_star
        ks = torch.tensor([k_star])
        stored = {}
        for name, part in cand["parts"].items():
            coded, dense = (int(b) for b in cand["part_bytes"](part, ks))
            if coded < dense:
                c, ref, mag = part["codes"]
                stored[name] = CodedRows(c, ref[sel], mag[sel], part["theta"], self.storage_dtype)
        if not stored:
            return DenseGroup(cand["k"][sel], cand["v"][sel], cand["uniq"][sel], self.storage_dtype)
        return CodebookGroup(stored.get("k", cand["k"][sel]), stored.get("v", cand["v"][sel]),
                             cand["uniq"][sel], self.storage_dtype, self.ctx.rope)
