"""`full` cache layer: every token's K/V, stored in the storage dtype (fp16 by default, as on a GPU
deployment) and handed to attention in the compute dtype."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicLayer

from executor.attention import causal_attention
from kvplan.plan import LayerPlan


@dataclass
class CacheState:
    """Where the job is, shared by the cache's layers; set by the runner.
    phase: "context" (prefilling the part to compress), "compress" (its last chunk: layers
    compress right after their attention), "after" (question and decode); with an offload plan
also "predecode" and "spec" (`executor.layers.offload`)."""
    phase: str = "context"
    context_tokens: int = 0
    step: int = 0                     # decode step of an offload plan ("predecode" is 0)
    wait_s: float = 0.0               # how long an offload layer waits for a late prefetch
    recall: list | None = None        # offload layers append their prefetch recall here when set


@dataclass(frozen=True)
class LayerContext:
    storage_dtype: torch.dtype
    num_kv_heads: int
    num_query_heads: int
    head_dim: int
    rope: tuple[torch.Tensor, float]          # (inv_freq [D/2], attention_scaling)
    state: CacheState = field(default_factory=CacheState)
    offload: object | None = None             # the plan's OffloadPlan, fitted (offload layers)
    store: object | None = None               # cachestore.handle.JobHandle (offload layers)


class FullLayer(DynamicLayer):
    kind = "full"

    def __init__(self, plan: LayerPlan, ctx: LayerContext):
        super().__init__()
        self.plan, self.ctx = plan, ctx
        self.storage_dtype = ctx.storage_dtype
        self.tokens_seen = 0            # tokens that passed through this layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device   # compute dtype
        self.keys = torch.empty(*key_states.shape[:2], 0, key_states.shape[-1], dtype=self.storage_dtype, device=self.device)
        self.values = torch.empty(*value_states.shape[:2], 0, value_states.shape[-1], dtype=self.storage_dtype, device=self.device)
        self.is_initialized = True

    seedable = True   # the prefilled context's K/V is all this layer keeps before compression

    def seed(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Start from dense K/V already prefilled: [1, H_kv, T, D] in the storage dtype; dtype:
        the compute dtype (`Runner.prefix_of`)."""
        self.dtype, self.device = dtype, keys.device
        self.keys, self.values, self.is_initialized = keys, values, True
        self.tokens_seen = keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [B, H_kv, T_new, D] (post-RoPE keys) -> all K/V [B, H_kv, T, D], compute dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states.to(self.storage_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage_dtype)], dim=-2)
        self.tokens_seen += key_states.shape[-2]
        if self.storage_dtype == self.dtype:
            return self.keys, self.values
        return self.keys.to(self.dtype), self.values.to(self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q: [B, H, Tq, D]; k, v: [B, H_kv, T, D] -> [B, Tq, H, D], causal."""
        return causal_attention(q, k, v, scaling)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (what `kv_bytes` counts)."""
        return [t for t in (self.keys, self.values) if t is not None]

    def kept_tokens(self) -> int:
        return self.get_seq_length()
