"""The planned KV cache: a transformers `Cache` whose layer kinds come from the plan, and the
byte accounting every job reports (bytes the tensors really hold vs the full fp16 cache)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from executor.layers import LAYER_KINDS
from executor.layers.base import CacheState, LayerContext, UnsupportedPlan
from kvplan.plan import CompressionPlan

__all__ = ["LayerBytes", "PlannedCache", "UnsupportedPlan"]    # UnsupportedPlan: `executor.layers.base`


@dataclass(frozen=True)
class LayerBytes:
    layer: int
    kind: str
    kept_tokens: int      # tokens held per stored head
    kv_bytes: int         # bytes of every tensor the layer holds
    full_kv_bytes: int    # K and V of every token seen, all KV heads, in the storage dtype


class PlannedCache(Cache):
    def __init__(self, plan: CompressionPlan, num_layers: int, num_kv_heads: int, head_dim: int,
                 storage_dtype: torch.dtype, num_query_heads: int | None = None,
                 rope: tuple[torch.Tensor, float] | None = None, store=None):
        """store: the job's `cachestore.handle.JobHandle` when the plan offloads (its `offload`
        part, fitted to the job by `kvcore.offload_budget`): its plain layers become `offload`."""
        if len(plan.layers) != num_layers:
            raise UnsupportedPlan(f"plan {plan.plan_id} has {len(plan.layers)} layers, the model {num_layers}")
        self.state = CacheState()
        ctx = LayerContext(storage_dtype, num_kv_heads, num_query_heads or num_kv_heads, head_dim,
                           rope if rope is not None else (torch.ones(head_dim // 2), 1.0), self.state,
                           plan.offload if plan.offload.enabled else None, store)
        if plan.offload.enabled and store is None:
            raise UnsupportedPlan(f"plan {plan.plan_id} offloads, but no cachestore handle was given")
        lower = _merge_partners(plan)           # lower layer -> upper layer of each merged pair
        layers = []
        for i, lp in enumerate(plan.layers):
            name = "merge" if i in lower else lp.kind
            if name == "full" and plan.offload.enabled:
                name = "offload"
            kind = LAYER_KINDS.get(name)
            if kind is None:
                raise UnsupportedPlan(f"layer {lp.layer}: kind {name!r} is not implemented (have {sorted(LAYER_KINDS)})")
            layers.append(kind(lp, ctx))
        for j, i in lower.items():              # a merged pair shares one store, held by its upper layer
            layers[i].pair(layers[j])
        super().__init__(layers=layers)
        self.plan = plan
        self.storage_dtype = storage_dtype
        self.store = store
        self.row_bytes = num_kv_heads * head_dim * torch.empty((), dtype=storage_dtype).element_size()

    @property
    def max_window(self) -> int:
        """The longest observation window of any layer: the context's last chunk must hold it."""
        return max((lp.eviction.window for lp in self.plan.layers if lp.eviction), default=0)

    def compress(self, queries: list[torch.Tensor], scaling: float) -> None:
        """Compress every layer's dense context as the plan says, after its last chunk ran under
        phase "stats": queries [m] of [H, W, D], each layer's last queries (`FullLayer.gather`)."""
        for layer, q in zip(self.layers, queries):
            layer.compress_now(q, scaling)

    def kv_bytes(self) -> int:
        """Bytes every tensor of every layer holds now."""
        return sum(t.nbytes for layer in self.layers for t in layer.tensors())

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes the cache holds at any step while `adds` (row counts: the question's chunks,
        then a row per decode step) join it: each layer's own bound (`kvcore.cost`), summed."""
        return sum(layer.bytes_bound(adds) for layer in self.layers)

    def layer_bytes(self) -> list[LayerBytes]:
        """Per layer: bytes of the tensors it holds, against K+V of every token seen in fp16 (batch 1)."""
        return [
            LayerBytes(i, _kind(layer), layer.kept_tokens(), sum(t.nbytes for t in layer.tensors()),
                       2 * layer.tokens_seen * self.row_bytes)
            for i, layer in enumerate(self.layers)
        ]


def _merge_partners(plan: CompressionPlan) -> dict[int, int]:
    """{lower: upper} of the plan's merged pairs. A pair is declared by its upper layer
    (`merge.with_layer` = an earlier layer, which runs first in a forward); the lower layer
    carries no part. Merging does not stack with eviction, codebooks or quantization."""
    lower: dict[int, int] = {}
    for i, lp in enumerate(plan.layers):
        if not lp.merge:
            continue
        j = lp.merge.with_layer
        stacked = [p for p in ("eviction", "codebook", "quant") if getattr(lp, p) is not None]
        if stacked:
            raise UnsupportedPlan(f"layer {i}: merge cannot stack with {' / '.join(stacked)} on the same layer")
        if not 0 <= j < i:
            raise UnsupportedPlan(f"layer {i}: merge.with_layer = {j} must name an earlier layer (the pair's lower)")
        if j in lower or plan.layers[j].merge or j in lower.values():
            raise UnsupportedPlan(f"layer {j} is in more than one merged pair")
        if plan.layers[j].kind != "full":
            raise UnsupportedPlan(f"layer {j}, the lower layer of merged pair ({j}, {i}), must carry no part: merge "
                                  f"cannot stack with {plan.layers[j].kind}")
        lower[j] = i
    return lower


def _kind(layer) -> str:
    """The kind a layer ended up as: a codebook layer none of whose groups were worth coding is
    reported as `evicted`."""
    groups = getattr(layer, "groups", None)
    if layer.kind == "codebook" and groups is not None and not any(g.coded for g in groups):
        return "evicted"
    return layer.kind
