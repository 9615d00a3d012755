"""`quant` cache layer (KIVI): low-bit K and V with a full-precision recent tail.

Per KV group, K is quantized per channel (each run of g consecutive stored tokens shares one
scale/zero per channel) and V per token (each run of g_v consecutive channels of a token shares
one; g_v = gcd(g, D), i.e. g when the head dim allows it), codes packed into uint8
(`kernels.quantize_pack`), scales and zeros fp16. Keys are the post-RoPE rows the model hands
over (KIVI quantizes post-RoPE keys per channel). The newest tokens stay in the storage dtype:
whenever the tail reaches `residual + g` rows its oldest g are quantized, so it always holds
the `residual` newest tokens (fewer before there are that many) and never `residual + g`.

The layer stacks under eviction: it is an `EvictedLayer` whose groups are `QuantGroup`s, so it
keeps exactly the tokens an evicted layer with the same plan keeps, and quantizes them right
after the attention of the context's last chunk (the dense copy dropped). Without an eviction
part it keeps every token (`KEEP_ALL`) and quantizes the whole prompt at that point. Codebook
and quant do not stack (yet): such a plan is refused.

Shapes: U stored tokens of a group, Q = n·g of them quantized, R = U - Q in the tail; D head dim."""
from __future__ import annotations

import math

import numpy as np
import torch

from executor.layers.evicted import EvictedLayer
from executor.layers.base import LayerContext, UnsupportedPlan
from kernels import lowbit_scores, quant_attend, quantize_pack, unpack_dequantize
from kernels import tail_append as tails
from kernels.quant_decode import QuantRows
from kvcore import cost
from kvplan.plan import LayerPlan, Quant

LAYER_BITS = (2, 4, 8)      # what a plan may ask of a layer (the kernels also do 1 bit, for SpeCache)


def value_group(group_size: int, head_dim: int) -> int:
    """Channels sharing a V scale: the plan's group size where it divides the head dim, else the
    largest divisor of both (a head dim of 16 with g = 32 -> 16)."""
    return math.gcd(group_size, head_dim)


def check_quant(quant: Quant, head_dim: int) -> str | None:
    """Why a layer cannot run this quant part with this head dim, or None."""
    if quant.bits not in LAYER_BITS:
        return f"quant bits {quant.bits} not supported (have {LAYER_BITS})"
    per = 8 // quant.bits
    if quant.group_size < 1 or quant.group_size % 8:
        return f"quant group_size must be a positive multiple of 8, got {quant.group_size}"
    if quant.residual < 0:
        return f"quant residual must be >= 0, got {quant.residual}"
    if value_group(quant.group_size, head_dim) % per:
        return (f"quant: head dim {head_dim} has no channel group that is a multiple of {per} and divides "
                f"group_size {quant.group_size}")
    return None


class QuantGroup:
    """One KV group's tokens: the oldest Q quantized (K per channel, V per token), the newest R
    in the storage dtype. Same interface as `DenseGroup`."""
    coded = True

    def __init__(self, k_post: torch.Tensor, v: torch.Tensor, quant: Quant, dtype: torch.dtype):
        """k_post, v: [U, D] kept rows (post-RoPE keys), in stored order."""
        d = k_post.shape[1]
        self.bits, self.group, self.residual = quant.bits, quant.group_size, quant.residual
        self.v_group = value_group(self.group, d)
        dev = k_post.device
        self.k_codes = torch.empty(0, d, self.group * self.bits // 8, dtype=torch.uint8, device=dev)  # [n, D, g·b/8]
        self.k_scale = torch.empty(0, d, dtype=torch.float16, device=dev)                              # [n, D]
        self.k_zero = torch.empty(0, d, dtype=torch.float16, device=dev)                               # [n, D]
        self.v_codes = torch.empty(0, d * self.bits // 8, dtype=torch.uint8, device=dev)              # [Q, D·b/8]
        self.v_scale = torch.empty(0, d // self.v_group, dtype=torch.float16, device=dev)             # [Q, D/g_v]
        self.v_zero = torch.empty(0, d // self.v_group, dtype=torch.float16, device=dev)              # [Q, D/g_v]
        self._rows: QuantRows | None = None           # the quantized rows as the decode kernel reads them
        self._kt = self._vt = None                    # the tail's storage [capacity, D], dtype: `_store`
        self.r = 0                                    # tail rows in use
        self._store(k_post.to(dtype), v.to(dtype))

    @property
    def k_tail(self) -> torch.Tensor:
        return self._kt[:self.r]                      # [R, D]

    @property
    def v_tail(self) -> torch.Tensor:
        return self._vt[:self.r]

    @property
    def quantized_tokens(self) -> int:
        return self.v_codes.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.quantized_tokens + self.r

    def append(self, k_post: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None) -> None:
        """k_post, v: [T_new, D]; pos: [T_new] (unused: keys stay post-RoPE). Rows that fit the
        tail's storage are written in place; past it the storage grows by `cost.TAIL_CHUNK` rows
        (`cost.tail_storage_rows`), and the rows that take the tail to `residual + g` flush whole
        groups and store the rest anew."""
        m, r = k_post.shape[0], self.r
        if r + m > self._kt.shape[0] and r + m < self.residual + self.group:      # no flush: a larger storage
            cap = int(cost.tail_storage_rows(r + m, self.residual, self.group))
            kt, vt = self._kt.new_empty(cap, self._kt.shape[1]), self._vt.new_empty(cap, self._vt.shape[1])
            kt[:r], vt[:r] = self._kt[:r], self._vt[:r]
            self._kt, self._vt = kt, vt
        if r + m <= self._kt.shape[0]:
            self._kt[r:r + m] = k_post
            self._vt[r:r + m] = v
            self.r += m
            return
        dtype = self._kt.dtype
        self._store(torch.cat([self.k_tail, k_post.to(dtype)]), torch.cat([self.v_tail, v.to(dtype)]))

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, D] the whole tail (storage dtype): its oldest whole groups quantized, leaving at
        least `residual` rows (`_flush`), the rest into storage of `cost.quant_tail_rows` rows (its
        rows rounded up to a chunk, at most residual + g - 1)."""
        rest = self._flush(k, v)
        cap = int(cost.quant_tail_rows(self.quantized_tokens + rest, self.residual, self.group))
        self._kt, self._vt = k.new_empty(cap, k.shape[1]), v.new_empty(cap, v.shape[1])
        self._kt[:rest], self._vt[:rest] = k[k.shape[0] - rest:], v[v.shape[0] - rest:]
        self.r = rest

    def _flush(self, k_tail: torch.Tensor, v_tail: torch.Tensor) -> int:
        """Quantize the oldest whole groups of a tail k_tail, v_tail [T, D], leaving at least
        `residual` rows -> the rows left (its last ones)."""
        n = (k_tail.shape[0] - self.residual) // self.group
        if n <= 0:
            return k_tail.shape[0]
        m, d = n * self.group, k_tail.shape[1]
        k = k_tail[:m].reshape(n, self.group, d).transpose(1, 2).reshape(n * d, self.group)     # [n·D, g]
        codes, scale, zero = quantize_pack(k, self.bits, self.group)
        self.k_codes = torch.cat([self.k_codes, codes.view(n, d, -1)])
        self.k_scale = torch.cat([self.k_scale, scale.view(n, d)])
        self.k_zero = torch.cat([self.k_zero, zero.view(n, d)])
        codes, scale, zero = quantize_pack(v_tail[:m], self.bits, self.v_group)                 # [m, D] per token
        self.v_codes = torch.cat([self.v_codes, codes])
        self.v_scale = torch.cat([self.v_scale, scale])
        self.v_zero = torch.cat([self.v_zero, zero])
        self._rows = None
        return k_tail.shape[0] - m

    def quant_rows(self) -> QuantRows:
        """The quantized rows as the decode kernel reads them (made once per flush)."""
        if self._rows is None:
            self._rows = QuantRows(self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                                   self.bits)
        return self._rows

    def materialize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> post-RoPE K, V: [U, D] in `dtype` (dequantized rows, then the tail)."""
        n, d = self.k_codes.shape[0], self.k_tail.shape[1]
        k = unpack_dequantize(self.k_codes.view(n * d, self.k_codes.shape[2]), self.k_scale.view(n * d, 1),
                              self.k_zero.view(n * d, 1), self.bits, self.group, dtype)  # [n·D, g]
        k = k.view(n, d, self.group).transpose(1, 2).reshape(n * self.group, d)             # [Q, D]
        v = unpack_dequantize(self.v_codes, self.v_scale, self.v_zero, self.bits, self.v_group, dtype)   # [Q, D]
        return torch.cat([k, self.k_tail.to(dtype)]), torch.cat([v, self.v_tail.to(dtype)])

    def attend(self, q: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """q: [h_n, Tq, D] the group's query heads; mask: [h_n, Tq, U] bool (True = seen) or None
        -> [h_n, Tq, D] (fp32 math, q's dtype out). A decode row (Tq = 1) takes the fused kernel
        (`kernels.quant_decode`); longer calls the composition below.

        The quantized keys are scored straight from their codes (`kernels.lowbit_scores`: the
        scale folded into the query, the zero into one bias per group; no dequantized K, no
        transpose of the per-channel layout), the tail's exactly; the quantized values are
        dequantized per token (contiguous rows) for the weighted sum."""
        h, tq, d = q.shape
        if tq == 1:                                   # decode: one fused pass over the codes
            out = quant_attend([self.quant_rows()], q[:, 0][None], [self.k_tail], [self.v_tail],
                               None if mask is None else [mask[:, 0]], scaling)
            return out[0, :, None].to(q.dtype)
        rows = q.reshape(1, h * tq, d).float()                                                      # [1, R, D]
        scores = torch.cat([lowbit_scores(rows, self.k_codes[None], self.k_scale[None], self.k_zero[None], self.bits)[0],
                            rows[0] @ self.k_tail.float().T], dim=1).mul_(scaling)                  # [R, U]
        if mask is not None:
            scores = scores.view(h, tq, -1).masked_fill(~mask, float("-inf")).view(h * tq, -1)
        p = scores.softmax(dim=-1)                                                                  # [R, U]
        quantized = self.quantized_tokens
        v = unpack_dequantize(self.v_codes, self.v_scale, self.v_zero, self.bits, self.v_group, torch.float32)  # [Q, D]
        out = torch.addmm(p[:, quantized:] @ self.v_tail.float(), p[:, :quantized], v)             # [R, D]
        return out.view(h, tq, d).to(q.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: the codes, scales and zeros, and the tail's whole storage."""
        return [self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero, self._kt, self._vt]

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows join in turn (`kvcore.cost.quant_bytes`:
        exact, the tail's flushes and its storage included)."""
        steps = self.num_tokens + np.cumsum([0, *adds])
        d = self._kt.shape[1]
        return int(cost.quant_bytes(steps, self.bits, self.group, self.residual, d, self._kt.element_size(),
                                    self.v_group).max())


class QuantLayer(EvictedLayer):
    kind = "quant"

    def __init__(self, plan: LayerPlan, ctx: LayerContext):
        if plan.codebook is not None:
            raise UnsupportedPlan(f"layer {plan.layer}: codebook + quant do not stack yet; plan one of them")
        why = check_quant(plan.quant, ctx.head_dim)
        if why is not None:
            raise UnsupportedPlan(f"layer {plan.layer}: {why}")
        super().__init__(plan, ctx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [1, H_kv, T_new, D] (post-RoPE keys): after compression, each group's
        rows join its tail: where no tail reaches residual + g (most decode steps), by
        one call for all groups (`kernels.tail_append`: in place, or a tail grown by a chunk); else
        converted to the storage dtype once and appended group by group (`QuantGroup.append`)."""
        if not self.compressed:
            return super().update(key_states, value_states)
        groups, t = self.groups, key_states.shape[2]
        if self.masks is not None:
            for g, group in enumerate(groups):
                self._grow_mask(g, group.num_tokens, t)
        limit = self.plan.quant.residual + self.plan.quant.group_size          # a tail reaching it flushes
        kts, rows = [group._kt for group in groups], [group.r for group in groups]
        if max(rows) + t < limit and tails.handles(key_states, kts):              # no flush: one call
            kts, vts = tails.append_tails(key_states[0], value_states[0], kts, [group._vt for group in groups],
                                          rows, cost.TAIL_CHUNK, limit - 1)   # grown as `cost.tail_storage_rows`
            for group, kt, vt in zip(groups, kts, vts):
                group._kt, group._vt, group.r = kt, vt, group.r + t
        else:
            k, v = key_states[0].to(self.storage_dtype), value_states[0].to(self.storage_dtype)  # [H_kv, T_new, D]
            for g, group in enumerate(groups):
                group.append(k[g], v[g])
        self.tokens_seen += t
        return key_states, value_states

    def _attend_groups(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """q: [1, H, Tq, D] -> [1, Tq, H, D]. A decode row attends over every group's codes in one
        kernel call (`kernels.quant_attend`); longer calls group by group."""
        if q.shape[2] != 1:
            return super()._attend_groups(q, scaling)
        hk = len(self.groups)
        masks = None if self.masks is None else [m[:, :g.num_tokens] for m, g in zip(self.masks, self.groups)]
        out = quant_attend([g.quant_rows() for g in self.groups], q[0, :, 0].view(hk, -1, q.shape[-1]),
                           [g.k_tail for g in self.groups], [g.v_tail for g in self.groups], masks, scaling)
        return out.view(1, 1, -1, q.shape[-1]).to(q.dtype)

    def make_group(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor) -> QuantGroup:
        """k, v: [U, D] a group's kept tokens (post-RoPE keys); pos, weight: [U] (unused)."""
        return QuantGroup(k, v, self.plan.quant, self.storage_dtype)
