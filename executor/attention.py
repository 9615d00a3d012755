"""Attention in the executor: every layer of a `PlannedCache` answers attention itself
(`layer.attend`): full layers run dense causal attention; compressed layers attend over their
kept (or reconstructed) tokens, padding nothing between steps. The cache in use is set per
forward with `using(cache)`: it becomes the handler of the one attention function kvplan
registers (`kvcore.attention`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from kvcore import attention as dispatch


@contextlib.contextmanager
def using(cache):
    """Each layer of this forward attends through `cache.layers[layer_idx]`."""
    with dispatch.using(lambda module, q, k, v, scaling: cache.layers[module.layer_idx].attend(q, k, v, scaling)):
        yield cache


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float) -> torch.Tensor:
    """q: [h_n, Tq, D], the query heads of one KV head, over its k, v [U, D]; mask [h_n, Tq, U]
    bool (True = seen) or None -> [h_n, Tq, D]. The GQA form of SDPA (one KV head, h_n query
    heads): several times faster on CPU than broadcasting a batch of one."""
    out = F.scaled_dot_product_attention(q[None], k[None, None], v[None, None], scale=scaling, enable_gqa=True,
                                         attn_mask=None if mask is None else mask[None])
    return out[0]


def register() -> str:
    return dispatch.register()
