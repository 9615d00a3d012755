"""The one attention function kvplan registers with transformers ("kvplan"), and who answers it.

A model whose attention implementation is "kvplan" runs its own layers (projections, norms,
RoPE: whatever its architecture does) and hands each layer's post-RoPE queries, keys and values
here; the handler set for this forward (`using`) answers: the executor's planned cache
the planner's probe (`planner.probe`). With no handler, plain causal
attention. The handler is a context variable, so forwards in different threads (an executor
stepping, a probe) never see each other's.

Masks: kvplan registers no attention mask (every handler masks itself), so the handler sees the
whole causal problem; a layer with a sliding window is refused rather than attended wrongly."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

NAME = "kvplan"
# (module, q [1, H, Tq, D], k [1, H_kv, T, D], v [1, H_kv, T, D], scaling) -> [1, Tq, H, D]
Handler = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
_handler: ContextVar[Handler | None] = ContextVar("kvplan_attention", default=None)


@contextlib.contextmanager
def using(handler: Handler) -> Iterator[Handler]:
    """`handler` answers every "kvplan" attention of this context until the block ends."""
    token = _handler.set(handler)
    try:
        yield handler
    finally:
        _handler.reset(token)


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
        cols = torch.arange(t, device=q.device)
        rows = torch.arange(tq, device=q.device)[:, None] + (t - tq)
        mask = (cols[None, :] <= rows) | (cols[None, :] < visible_prefix)          # [Tq, T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def dispatch(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
             sliding_window: int | None = None, **kwargs):
    """transformers' attention interface: query [1, H, Tq, D] post-RoPE; key/value as the layer's
    cache (if any) returned them -> ([1, Tq, H, D], None)."""
    if sliding_window is not None and key.shape[-2] > sliding_window:
        raise NotImplementedError(f"{type(module).__name__} layer {getattr(module, 'layer_idx', '?')}: sliding-window "
                                  f"attention ({sliding_window} tokens) over {key.shape[-2]} tokens is not supported")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    handler = _handler.get()
    if handler is None:
        return causal_attention(query, key, value, scaling), None
    return handler(module, query, key, value, scaling), None


def routed() -> bool:
    """Whether this forward's attention goes through a handler (`using`): each layer attends itself."""
    return _handler.get() is not None


def register() -> str:
    """Register "kvplan" with transformers (idempotent) -> its name, for `set_attn_implementation`."""
    AttentionInterface.register(NAME, dispatch)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)   # handlers mask themselves
    return NAME
