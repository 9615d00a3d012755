"""The one attention function kvplan registers with transformers ("kvplan").

Every layer of a `PlannedCache` answers attention itself (`layer.attend`): full layers run
dense causal attention; compressed layers attend over their kept (or reconstructed) tokens,
padding nothing between steps. The cache in use is set per forward with `using(cache)`.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

NAME = "kvplan"
_current: ContextVar = ContextVar("kvplan_cache", default=None)


@contextlib.contextmanager
def using(cache):
    token = _current.set(cache)
    try:
        yield cache
    finally:
        _current.reset(token)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     visible_prefix: int = 0) -> torch.Tensor:
    """q: [1, H, Tq, D] (the last Tq positions); k, v: [1, H or H_kv, T, D] -> [1, Tq, H, D].

    The first `visible_prefix` keys are seen by every query; the rest are causal, the queries
    being the last Tq of them."""
    tq, t = q.shape[-2], k.shape[-2]
    gqa = k.shape[1] != q.shape[1]
    if tq == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa)
    elif tq == t and visible_prefix == 0:
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling, is_causal=True, enable_gqa=gqa)
    else:
        cols = torch.arange(t)
        rows = torch.arange(tq)[:, None] + (t - tq)
        mask = (cols[None, :] <= rows) | (cols[None, :] < visible_prefix)          # [Tq, T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float) -> torch.Tensor:
    """q: [h_n, Tq, D], the query heads of one KV head, over its k, v [U, D]; mask [h_n, Tq, U]
    bool (True = seen) or None -> [h_n, Tq, D]. The GQA form of SDPA (one KV head, h_n query
    heads): several times faster on CPU than broadcasting a batch of one."""
    out = F.scaled_dot_product_attention(q[None], k[None, None], v[None, None], scale=scaling, enable_gqa=True,
                                         attn_mask=None if mask is None else mask[None])
    return out[0]


def kvplan_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """query: [1, H, Tq, D] post-RoPE; key/value: what the layer's `update` returned."""
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = _current.get()
    if cache is None:                            # no planned cache (e.g. a plain forward)
        return causal_attention(query, key, value, scaling), None
    return cache.layers[module.layer_idx].attend(query, key, value, scaling), None


def register() -> str:
    AttentionInterface.register(NAME, kvplan_attention)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)   # layers mask themselves
    return NAME
