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
        """q: [1, H, N, D] -> [1, N, H, D], each segment attended by its own sequence's layer."""
        if len(self.caches) == 1:
            return self.caches[0].layers[self.index].attend(q, ks[0], vs[0], scaling)
        outs = [cache.layers[self.index].attend(q[:, :, a:b], k, v, scaling)
                for cache, (a, b), k, v in zip(self.caches, self.spans, ks, vs)]
        return torch.cat(outs, dim=1)

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0              # unused: every layer masks itself


class BatchCache(Cache):
    def __init__(self, caches: list, spans: list[tuple[int, int]], num_layers: int):
        """caches: each segment's `PlannedCache`; spans: its [a, b) rows of the packed input."""
        super().__init__(layers=[_Route(i, caches, spans) for i in range(num_layers)])
