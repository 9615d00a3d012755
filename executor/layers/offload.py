"""`offload` cache layer (SpeCache): the full-precision K/V lives in the cachestore; the layer
holds a low-bit copy (`LowBitKV`), the sink rows, and a buffer of `top_k` exact rows per KV
head prefetched for the current decode step.

    context chunks      dense causal attention (as `full`)
    context's last one  exact attention, then every row goes to the store, the low-bit copy is
                        built and the dense copy dropped
    later prefill       (the question, or any multi-token call) exact attention over the rows
                        read back from the store for this one call (transient, one layer at a
                        time); the new rows are offloaded and quantized
    "predecode"         one token over the low-bit copy: its attention picks the first top-k
                        and prefetches it; nothing is stored (the token is fed again next step)
    "spec" step t       the real token (position N) and the speculative one (N+1) attend over
                        the low-bit copy with the rows prefetched for step t put in place of
                        theirs; the speculative row's attention, averaged over each KV group,
                        picks the rows for step t+1, prefetched right away: its top rerank·k
                        over the low-bit keys, narrowed on the prefetch thread to the k its
                        query attends to most over their exact keys (`rerank` 1: the top-k of
                        the low-bit scores, as published); only the real token's K/V is stored
A layer whose store has failed (`store.failed`) goes on with its low-bit copy alone.

Shapes: H query heads, H_kv KV heads, h_n = H / H_kv, Tq new tokens, Q quantized rows, D head dim."""
from __future__ import annotations

import torch

from kvcore.attention import causal_attention
from executor.layers.base import LayerContext, Phase
from executor.layers.full import FullLayer
from executor.layers.lowbit import LowBitKV
from kvcore import cost
from kvplan.plan import LayerPlan


class OffloadLayer(FullLayer):
    kind = "offload"
    fused_decode = False     # decodes through its own attention (`FullLayer._decodes_stored`)

    def __init__(self, plan: LayerPlan, ctx: LayerContext):
        super().__init__(plan, ctx)
        if ctx.offload is None or ctx.store is None:
            raise ValueError("an offload layer needs the plan's offload part and a store handle")
        self.off, self.store = ctx.offload, ctx.store
        self.low: LowBitKV | None = None
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None          # [H_kv, Tq, D] each

    @property
    def compressed(self) -> bool:
        return self.low is not None

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens_seen + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [1, H_kv, Tq, D] post-RoPE. After compression the rows are kept
        aside for `attend`, which decides what is stored."""
        if not self.compressed:
            return super().update(key_states, value_states)
        self._new = (key_states[0], value_states[0])
        return key_states, value_states

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  phase: Phase) -> torch.Tensor:
        """q: [1, H, Tq, D] -> [1, Tq, H, D]: dense before the context's end; then speculative
        decode (PREDECODE, SPEC) over the low-bit copy and the prefetched rows, or exact."""
        if not self.compressed:
            return causal_attention(q, k, v, scaling)
        if phase.speculative:
            return self._speculate(q, scaling, commit=phase is Phase.SPEC)
        return self._exact(q, scaling)

    def end_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        self.compress_now(q, scaling)

    # -- prefill ---------------------------------------------------------------------------------
    def compress_now(self, q: torch.Tensor, scaling: float) -> None:
        if not self.compressed:
            self._offload_context()

    def _offload_context(self) -> None:
        k, v = self.keys[0], self.values[0]                                   # [H_kv, T, D] storage dtype
        self.store.put(self.plan.layer, k, v)
        s = min(self.off.sink_tokens, k.shape[1])
        self.sink_k, self.sink_v = k[:, :s].clone(), v[:, :s].clone()        # [H_kv, S, D]
        self.low = LowBitKV(k, v, self.off.low_bits, self.off.group_size, self.off.recent_window, self.storage_dtype,
                            self.off.value_group_size)
        self.low.seal()
        h, d = k.shape[0], k.shape[2]
        self.buf_k = k.new_zeros(h, self.off.top_k, d)                          # [H_kv, k, D] prefetched rows
        self.buf_v = torch.zeros_like(self.buf_k)
        self.buf_idx = torch.zeros(h, self.off.top_k, dtype=torch.int16 if k.shape[1] < 1 << 15 else torch.int32,
                                   device=k.device)
        self.keys = self.values = None

    def _exact(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Exact attention of the new tokens over every row (read back from the store)."""
        nk, nv = self._new
        rows = self.store.read(self.plan.layer)
        if rows is None:                                                     # store gone: low-bit copy
            rows = self._lowbit(q.dtype)
        k = torch.cat([rows[0].to(q.device, q.dtype), nk.to(q.dtype)], dim=1)     # [H_kv, N + Tq, D] (host rows)
        v = torch.cat([rows[1].to(q.device, q.dtype), nv.to(q.dtype)], dim=1)
        out = causal_attention(q, k[None], v[None], scaling)
        self._commit(nk, nv)
        if nk.shape[1] > 1:
            self.low.seal()
        return out

    # -- decode ----------------------------------------------------------------------------------
    def _lowbit(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [H_kv, N, D] of every stored position: the low-bit copy's rows, the sinks exact."""
        k, v = self.low.rows(dtype)                                          # [H_kv, N, D]
        s = self.sink_k.shape[1]
        k[:, :s], v[:, :s] = self.sink_k, self.sink_v
        return k, v

    def _scores(self, q: torch.Tensor, fetched, new_k: torch.Tensor) -> torch.Tensor:
        """q: [H_kv, R, D] -> q · K [H_kv, R, N + Tq] fp32 over every stored position then the
        new rows new_k [H_kv, Tq, D]: low-bit keys scored from their codes, the sinks' and the
        prefetched rows' scores exact (what `_lowbit`'s K with the prefetched rows put in place
        would score, without dequantizing it)."""
        scores = self.low.key_scores(q)                                      # [H_kv, R, N]
        s = self.sink_k.shape[1]
        if s:
            scores[:, :, :s] = torch.einsum("hrd,hsd->hrs", q.float(), self.sink_k.float())
        if fetched is not None:
            exact = torch.einsum("hrd,hkd->hrk", q.float(), fetched.k.to(q.device).float())      # [H_kv, R, k]
            scores.scatter_(2, fetched.idx.to(q.device).unsqueeze(1).expand(-1, q.shape[1], -1), exact)
        return torch.cat([scores, torch.einsum("hrd,htd->hrt", q.float(), new_k.float())], dim=-1)

    def _values(self, dtype: torch.dtype, fetched, new_v: torch.Tensor) -> torch.Tensor:
        """V [H_kv, N + Tq, D]: `_lowbit`'s values with the prefetched rows put in place, then new_v."""
        v = self.low.values(dtype, new_v)
        s = self.sink_v.shape[1]
        v[:, :s] = self.sink_v
        if fetched is not None:
            idx = fetched.idx.to(v.device).unsqueeze(-1).expand(-1, -1, v.shape[-1])      # [H_kv, k, D]
            v.scatter_(1, idx, fetched.v.to(v.device, dtype))
        return v

    def _speculate(self, q: torch.Tensor, scaling: float, commit: bool) -> torch.Tensor:
        """Mixed attention (Eq. 1) and the next step's top-k from the last query row."""
        state, layer = self.ctx.state, self.plan.layer
        nk, nv = self._new                                                   # [H_kv, Tq, D]
        fetched = self.store.take(layer, state.step, state.wait_s) if commit else None
        if fetched is not None:
            kk = fetched.idx.shape[1]
            self.buf_k[:, :kk], self.buf_v[:, :kk] = fetched.k, fetched.v                 # copied from the host
            self.buf_idx[:, :kk] = fetched.idx.to(self.buf_idx.device, self.buf_idx.dtype)
        hk, tq, d = nk.shape
        qg = q[0].view(hk, -1, tq, d)                                        # [H_kv, h_n, Tq, D]
        logits = self._scores(qg.reshape(hk, -1, d), fetched, nk).view(*qg.shape[:3], -1) * scaling   # [H_kv, h_n, Tq, L = N + Tq]
        v = self._values(q.dtype, fetched, nv)                               # [H_kv, L, D]
        if tq == 2:
            logits[:, :, 0, -1] = float("-inf")                              # the real token cannot see the guess
        probs = torch.softmax(logits.float(), dim=-1)
        out = torch.einsum("ghtl,gld->ghtd", probs.to(q.dtype), v)           # [H_kv, h_n, Tq, D]
        if state.recall is not None and fetched is not None:
            state.recall.append(self._recall(qg[:, :, 0], nk[:, :1], fetched.idx, scaling))
        if commit:
            self._commit(nk[:, :1], nv[:, :1])
        self._select(probs[:, :, -1].mean(1), qg[:, :, -1] * scaling, state.step + 1)   # after the commit
        return out.reshape(-1, tq, d).transpose(0, 1)[None].contiguous()

    def _select(self, scores: torch.Tensor, query: torch.Tensor, step: int) -> None:
        """scores: [H_kv, L] a query's attention over the low-bit copy (group mean); query:
        [H_kv, h_n, D] that query, pre-scaled. Prefetch for `step` the top-k of the positions
        with a low-bit key or value at the next step (sinks excepted): SpeCache's top-k of the
        low-bit scores when `rerank` <= 1, else their top rerank·k, which the prefetch thread
        narrows to the k of most attention over the exact keys — so a 2-bit key's error costs
        a row only when it pushes the row out of the wider set."""
        s, qn = self.sink_k.shape[1], self.low.quantized
        kk = min(self.off.top_k, qn - s)
        if kk <= 0:
            return
        wide = min(kk * max(self.off.rerank, 1), qn - s)
        idx = scores[:, s:qn].topk(wide, dim=-1).indices + s                  # [H_kv, wide]
        self.store.prefetch(self.plan.layer, step, idx, query.contiguous(), kk)   # re-ranked when wide > k

    def _recall(self, q0: torch.Tensor, k0: torch.Tensor, fetched: torch.Tensor, scaling: float) -> tuple[float, float]:
        """How much of the oracle top-k (the real token's attention over the exact keys) the
        speculative prefetch brought: (share of its rows, share of its attention mass).
        q0: [H_kv, h_n, D]; k0: [H_kv, 1, D]; fetched: [H_kv, k]."""
        rows = self.store.read(self.plan.layer)
        if rows is None:
            return float("nan"), float("nan")
        keys = torch.cat([rows[0].to(q0.device, q0.dtype), k0.to(q0.dtype)], dim=1)    # [H_kv, N + 1, D]
        probs = torch.softmax(torch.einsum("ghd,gld->ghl", q0, keys).float() * scaling, dim=-1).mean(1)
        s, kk = self.sink_k.shape[1], fetched.shape[1]
        cand = probs[:, s:self.low.quantized]                                                # [H_kv, C]
        oracle = cand.topk(kk, dim=-1)
        hit = (oracle.indices.unsqueeze(-1) + s == fetched.unsqueeze(-2)).any(-1)           # [H_kv, k]
        mass = (oracle.values * hit).sum() / oracle.values.sum().clamp_min(1e-30)
        return float(hit.float().mean()), float(mass)

    def _commit(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new rows k, v [H_kv, T, D]: offloaded and appended to the low-bit copy."""
        k, v = k.to(self.storage_dtype), v.to(self.storage_dtype)
        self.store.put(self.plan.layer, k, v)
        self.low.append(k, v)
        self.tokens_seen += k.shape[1]

    # -- accounting ------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        if not self.compressed:
            return super().tensors()
        return self.low.tensors() + [self.sink_k, self.sink_v, self.buf_k, self.buf_v, self.buf_idx]

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows join in turn: the low-bit copy's bound
        (`kvcore.cost.lowbit_bytes`, a padded key group per multi-row call) and the fixed sink
        rows and prefetch buffer."""
        if not self.compressed:
            return super().bytes_bound(adds)
        low, (h, _, d) = self.low, self.sink_k.shape
        now = low.k_rows + low.tail
        seals = len(low.pads) + sum(1 for m in adds if m > 1)
        bound = max(cost.lowbit_bytes(t, h, d, low.bits, low.group, low.residual, low.residual + low.group - 1,
                                      low.v_group, seals, self.storage_dtype.itemsize)
                    for t in (now, now + sum(adds)))
        fixed = [self.sink_k, self.sink_v, self.buf_k, self.buf_v, self.buf_idx]
        return max(bound, sum(t.nbytes for t in low.tensors())) + sum(t.nbytes for t in fixed)

    def kept_tokens(self) -> int:
        return self.tokens_seen
