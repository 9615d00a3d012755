"""`full` cache layer: every token's K/V, stored in the storage dtype (fp16 by default, as on a GPU
deployment) and handed to attention in the compute dtype."""
from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicLayer

from executor.layers.base import LayerContext, Phase
from kernels import dense_decode
from kvcore.attention import causal_attention, routed
from kernels.rope_reconstruct import unrotate_rope
from kvcore import cost
from kvplan.plan import LayerPlan


class FullLayer(DynamicLayer):
    """Dense K/V in preallocated storage: a call's rows are written in place, the storage grows
    `cost.ROW_CHUNK` rows at a time past the used rows when they do not fit (a prefill chunk
    grows it by the chunk), never a copy of every row at every step. Spare rows are held, so
    `tensors()` counts them. `keys` / `values` are views of the used rows [B, H_kv, T, D]."""
    kind = "full"

    def __init__(self, plan: LayerPlan, ctx: LayerContext):
        super().__init__()
        self.plan, self.ctx = plan, ctx
        self.storage_dtype = ctx.storage_dtype
        self.tokens_seen = 0            # tokens that passed through this layer
        self._k: torch.Tensor | None = None          # [B, H_kv, capacity, D], storage dtype
        self._v: torch.Tensor | None = None
        self.used = 0                                # rows of the storage in use

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[..., :self.used, :]

    @keys.setter
    def keys(self, x: torch.Tensor | None) -> None:      # None drops the dense copy (compression)
        self._k = x
        if x is not None:
            self.used = x.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[..., :self.used, :]

    @values.setter
    def values(self, x: torch.Tensor | None) -> None:
        self._v = x

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device   # compute dtype
        b, h, _, d = key_states.shape
        self.keys = key_states.new_empty(b, h, 0, d, dtype=self.storage_dtype)
        self.values = value_states.new_empty(b, h, 0, d, dtype=self.storage_dtype)
        self.is_initialized = True

    seedable = True   # the prefilled context's K/V is all this layer keeps before compression
    fused_decode = True   # a decode row attends over the stored rows as they are (`kernels.dense_decode`);
                          # layers that attend otherwise once compressed say False

    def seed(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Start from dense K/V already prefilled: [1, H_kv, T, D] in the storage dtype; dtype:
        the compute dtype (`Runner.prefix_of`). Never written in place (the storage is full, so
        the next rows grow a new one): shared safely."""
        self.dtype, self.device = dtype, keys.device
        self.keys, self.values, self.is_initialized = keys, values, True
        self.tokens_seen = keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [B, H_kv, T_new, D] (post-RoPE keys) -> all K/V [B, H_kv, T, D], compute dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m, n = key_states.shape[-2], self.used
        cap = cost.grown(self._k.shape[-2], n, m)
        if cap > self._k.shape[-2]:
            spare = (*self._k.shape[:2], cap - n, self._k.shape[-1])
            self._k = torch.cat([self.keys, self._k.new_empty(spare)], dim=-2)
            self._v = torch.cat([self.values, self._v.new_empty(spare)], dim=-2)
        self._k[..., n:n + m, :] = key_states
        self._v[..., n:n + m, :] = value_states
        self.used += m
        self.tokens_seen += m
        if self.storage_dtype == self.dtype or self._decodes_stored(m):
            return self.keys, self.values
        return self.keys.to(self.dtype), self.values.to(self.dtype)

    def _decodes_stored(self, rows: int) -> bool:
        """One decode row whose attention (`attend`, routed to this layer) reads the fp16 rows
        itself: no float copy of the cache."""
        return (self.fused_decode and rows == 1 and self.ctx.state.phase is Phase.AFTER and routed()
                and dense_decode.handles(self._k))

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q: [1, H, Tq, D]; k, v: what `update` returned -> [1, Tq, H, D]. The one place a layer
        of any kind reads the forward's phase: its own `attention`, then at the context's last
        chunk the plan's statistics (STATS) or the end of its context (COMPRESS: `end_context`)."""
        phase = self.ctx.state.phase
        out = self.attention(q, k, v, scaling, phase)
        if phase is Phase.STATS:
            self.gather(q, k, v, scaling)
        elif phase is Phase.COMPRESS:
            self.end_context(q, k, v, scaling)
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  phase: Phase) -> torch.Tensor:
        """q: [1, H, Tq, D]; k, v: [1, H_kv, T, D] -> [1, Tq, H, D], causal over what it holds (a
        decode row over the storage dtype, as `update` hands it: the fused kernel)."""
        if k.dtype != q.dtype:
            h, d = q.shape[1], q.shape[3]
            return dense_decode.dense_decode(q[0, :, 0].reshape(k.shape[1], -1, d), k[0], v[0], scaling).view(1, 1, h, d)
        return causal_attention(q, k, v, scaling)

    def end_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        """The context's last chunk has attended (q: [1, H, Tq, D] its queries; k, v: [1, H_kv, T, D]
        the whole context): compress as the plan says. A full layer keeps everything."""

    def gather(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        """The context's last chunk, before any plan: add this layer's statistics (q: [1, H, Tq, D]
        the chunk's queries; k, v: [1, H_kv, T, D] the whole context, post-RoPE keys) and keep its
        last queries for the compression the plan brings (`compress_now`)."""
        state = self.ctx.state
        t0 = time.perf_counter()
        keep = state.stats.keep_queries
        k_pre = unrotate_rope(k[0].float(), torch.arange(k.shape[2], device=k.device), *self.ctx.rope)
        state.stats.add(q[0, :, -keep:], k[0], k_pre, v[0], scaling)
        state.queries.append(q[0, :, -keep:].clone())
        state.stats.spent_s += time.perf_counter() - t0

    def compress_now(self, q: torch.Tensor, scaling: float) -> None:
        """Compress the dense context this layer holds as its plan says (q: [H, W, D] the context's
        last queries, kept by `gather`). A full layer keeps everything."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (what `kv_bytes` counts): the whole storage."""
        return [t for t in (self._k, self._v) if t is not None]

    def kept_tokens(self) -> int:
        return self.used if self._k is not None else 0

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes this layer holds at any step while `adds` (row counts) join it in turn."""
        cap = 0 if self._k is None else self._k.shape[-2]
        rows = cost.capacities(cap, self.used, adds)[-1] if adds else cap
        return rows * self.ctx.num_kv_heads * cost.dense_row_bytes(self.ctx.head_dim, self.storage_dtype.itemsize)
