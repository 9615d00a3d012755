"""The planned KV cache: a transformers `Cache` whose layer kinds come from the plan, and the
byte accounting every job reports (bytes the tensors really hold vs the full fp16 cache)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from executor.layers import LAYER_KINDS
from kvplan.plan import CompressionPlan


class UnsupportedPlan(ValueError):
    pass


@dataclass(frozen=True)
class LayerBytes:
    layer: int
    kind: str
    kept_tokens: int      # tokens held per KV head
    kv_bytes: int         # bytes of every tensor the layer holds
    full_kv_bytes: int    # K and V of every token seen, all KV heads, in the storage dtype


class PlannedCache(Cache):
    def __init__(self, plan: CompressionPlan, num_layers: int, num_kv_heads: int, head_dim: int,
                 storage_dtype: torch.dtype):
        if len(plan.layers) != num_layers:
            raise UnsupportedPlan(f"plan {plan.plan_id} has {len(plan.layers)} layers, the model {num_layers}")
        layers = []
        for lp in plan.layers:
            kind = LAYER_KINDS.get(lp.kind)
            if kind is None:
                raise UnsupportedPlan(f"layer {lp.layer}: kind {lp.kind!r} is not implemented (have {sorted(LAYER_KINDS)})")
            layers.append(kind(lp, storage_dtype))
        super().__init__(layers=layers)
        self.plan = plan
        self.storage_dtype = storage_dtype
        self.row_bytes = num_kv_heads * head_dim * torch.empty((), dtype=storage_dtype).element_size()

    def layer_bytes(self) -> list[LayerBytes]:
        """Per layer: bytes of the tensors it holds, against K+V of every token seen in fp16 (batch 1)."""
        return [
            LayerBytes(i, layer.kind, layer.kept_tokens(), sum(t.nbytes for t in layer.tensors()),
                       2 * layer.tokens_seen * self.row_bytes)
            for i, layer in enumerate(self.layers)
        ]
