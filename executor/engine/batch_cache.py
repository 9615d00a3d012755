"""The cache a batched forward runs over: the step's rows of many sequences packed into one
[1, N] input, each sequence's rows a contiguous segment. Dense layers (projections, MLP, norms,
the LM head) see all N rows at once; at every attention layer this cache routes each segment's
new K/V to its own sequence's cache layer and each segment's queries to that layer's `attend`
(full, evicted, codebook, quant, merged or offloaded: whatever its plan made it), and packs the
outputs back. Like nano-vllm's varlen attention, with a per-sequence layout instead of a block
table.

Shapes: N packed rows; segment i spans [a_i, b_i); H query heads, H_kv KV heads, D head dim."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kernels import dense_decode, quant_decode


def _dense(form: tuple, operands: list, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """operands: (k, v [T_i, D] fp16, mask [h, T_i] or None) per group; q [G, h, D] -> [G, h, D].
    The groups' layers checked them (`decode_groups`): the kernel itself."""
    ks, vs, masks = zip(*operands)
    return dense_decode.attend_groups_cpu(q, list(ks), list(vs), None if all(m is None for m in masks)
                                          else list(masks), scaling)


def _quant(form: tuple, operands: list, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """operands: (QuantRows, k_tail, v_tail [R_i, D] fp16, mask [h, U_i] or None) per group."""
    rows, kt, vt, masks = zip(*operands)
    return quant_decode.attend_groups_cpu(list(rows), q, list(kt), list(vt),
                                          None if all(m is None for m in masks) else list(masks), scaling)


DECODE_KERNELS = {"dense": _dense, "quant": _quant}     # a DecodeGroups form's first word -> its kernel


class _Route(DynamicLayer):
    """One model layer across the step's sequences."""

    def __init__(self, index: int, caches: list, spans: list[tuple[int, int]]):
        super().__init__()
        self.index, self.caches, self.spans = index, caches, spans
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [1, H_kv, N, D] -> ([per segment K], [per segment V]): what each
        sequence's layer returned for its rows."""
        if len(self.caches) == 1:
            k, v = self.caches[0].layers[self.index].update(key_states, value_states)
            return [k], [v]
        ks, vs = [], []
        for cache, (a, b) in zip(self.caches, self.spans):
            k, v = cache.layers[self.index].update(key_states[:, :, a:b], value_states[:, :, a:b])
            ks.append(k), vs.append(v)
        return ks, vs

    def attend(self, q: torch.Tensor, ks: list, vs: list, scaling: float) -> torch.Tensor:
        """q: [1, H, N, D] -> [1, N, H, D], each segment attended by its own sequence's layer — the
        decode rows of layers alike in form (`CacheLayer.decode_groups`) by one kernel call for
        all of them, the same arithmetic per group as a call of their own."""
        if len(self.caches) == 1:
            return self.caches[0].layers[self.index].attend(q, ks[0], vs[0], scaling)
        layers = [cache.layers[self.index] for cache in self.caches]
        forms: dict[tuple, list] = {}
        for i, (layer, (a, b)) in enumerate(zip(layers, self.spans)):
            dg = layer.decode_groups() if b - a == 1 else None
            if dg is not None:
                forms.setdefault(dg.form, []).append((i, dg))
        _, h, n, d = q.shape
        out = q.new_empty(n, h, d)                                                              # [N, H, D]
        alone = [True] * len(layers)
        for form, items in forms.items():
            if len(items) == 1:
                continue                                  # alone in its form: its own call, the same arithmetic
            at = torch.tensor([self.spans[i][0] for i, _ in items], device=q.device)
            rows = q[0].index_select(1, at).transpose(0, 1)                                     # [S, H, D]
            s, groups = len(items), len(items[0][1].operands)
            res = DECODE_KERNELS[form[0]](form, [op for _, dg in items for op in dg.operands],
                                          rows.reshape(s * groups, h // groups, d), scaling)   # [S·G, h_n, D]
            out.index_copy_(0, at, res.view(s, h, d).to(q.dtype))
            for i, _ in items:
                alone[i] = False
        for i, (layer, (a, b)) in enumerate(zip(layers, self.spans)):
            if alone[i]:
                out[a:b] = layer.attend(q[:, :, a:b], ks[i], vs[i], scaling)[0]
        return out[None]

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0              # unused: every layer masks itself


class BatchCache(Cache):
    def __init__(self, caches: list, spans: list[tuple[int, int]], num_layers: int):
        """caches: each segment's `PlannedCache`; spans: its [a, b) rows of the packed input."""
        super().__init__(layers=[_Route(i, caches, spans) for i in range(num_layers)])
