"""The probe engine: a mini-prefill of the executor's model that writes no KV cache and stops
right after the last layer's attention (no final MLP, no norm, no LM head), collecting per layer
the statistics strategies plan from (`kvcore.statistics`: window attention, similar-row shares,
adjacent-layer angles, storage-form losses). The executor's own prefill collects the same at the
context's end, so a job it sends statistics with needs no probe; this engine serves `kvplan plan`,
profiles, benches and requests that come without them.

The model runs its own layers (`model.model(...)`: embeddings, norms, projections, q/k norms,
MLPs — whatever its architecture has), its attention set to kvplan's (`kvcore.attention`), whose
handler for a probe's forward is `_Collector`. To see keys before RoPE exactly, a hook hands each
attention module the identity rotation (cos 1, sin 0) while a probe runs; the collector applies
the model's own `apply_rotary_pos_emb` with the real cos/sin, gathers the layer's statistics,
and attends causally. After the last layer's statistics it stops the forward. Only the residual
stream [T, hidden] and the previous layer's pre-RoPE K/V live across layers; window scores are
[H, W, T] logits per layer, never a T x T matrix.

Setting a model's attention to kvplan's changes nothing for other forwards: with no handler it is
plain causal attention, the executor's when it steps (a context variable per thread)."""
from __future__ import annotations

import sys
import threading
import time
from contextvars import ContextVar

import torch

from kvcore import attention
from kvcore.statistics import ERROR_QUERIES, LayerStatistics, ProbeStats
from kvcore.request import InvalidRequest

_rope: ContextVar[dict | None] = ContextVar("kvplan_probe_rope", default=None)   # layer -> (cos, sin), a probe's
_HOOKED = "_kvplan_probe_hooked"


def once(run, token_ids: list[int], on_probe=None):
    """One job's lazy probe of its token ids: `probe(gqa_mode=..., losses=...)` calls
    `run(token_ids, gqa_mode=..., losses=...)` (a `Prober.probe`) at most once per GQA mode (a
    result with losses serves a later call without them); `on_probe()` is called after each probe
    that ran (one refused before its prefill is not counted). -> the callable"""
    done: dict[str, ProbeStats] = {}

    def probe(gqa_mode: str = "repeat", losses: bool = False) -> ProbeStats:
        got = done.get(gqa_mode)
        if got is None or (losses and got.losses is None):
            got = done[gqa_mode] = run(token_ids, gqa_mode=gqa_mode, losses=losses)
            if on_probe is not None:
                on_probe()
        return got
    return probe


def in_mode(probe, gqa_mode: str):
    """`probe` (from `once`) with the GQA mode a strategy probes in fixed: what `PlanInput.probe` takes."""
    return lambda **kw: probe(**{"gqa_mode": gqa_mode, **kw})


def check_tokens(token_ids: list[int], max_context: int, vocab_size: int) -> None:
    """A probe's token ids fit the model (InvalidRequest naming `token_ids` otherwise): checked
    before the prefill, so a prompt past the context or an id past the vocabulary costs nothing."""
    if len(token_ids) > max_context:
        raise InvalidRequest("token_ids", f"{len(token_ids)} ids exceed the model's context of {max_context} tokens")
    lo, hi = min(token_ids), max(token_ids)
    if lo < 0 or hi >= vocab_size:
        raise InvalidRequest("token_ids", f"must be in [0, {vocab_size}) (the model's vocabulary), got [{lo}, {hi}]")


class Prober:
    """Runs probes on the model of `model_cfg` (loaded on first use, once, thread-safe)."""

    def __init__(self, model_cfg=None, lm=None, window: int = 32, pool_kernel: int = 7, sample: int = 256):
        self.model_cfg, self.lm = model_cfg, lm
        self.window, self.pool_kernel, self.sample = window, pool_kernel, sample
        self._lock = threading.Lock()

    def model(self):
        with self._lock:
            if self.lm is None:
                from kvcore.model import load
                self.lm = load(self.model_cfg)
            return self.lm

    @torch.inference_mode()
    def probe(self, token_ids: list[int], gqa_mode: str = "repeat", losses: bool = False) -> ProbeStats:
        """token_ids: the prompt as the executor will prefill it -> statistics for every layer
        (`losses`: also what storage forms would lose, for `auto`)."""
        if not token_ids:
            raise ValueError("token_ids: the probe needs the prompt's tokens, got none")
        start = time.perf_counter()
        lm = self.model()
        check_tokens(token_ids, lm.max_context, lm.model.config.vocab_size)
        layers = _prepare(lm.model)
        stats = LayerStatistics(gqa_mode, losses, self.window, self.pool_kernel, self.sample)
        t = len(token_ids)
        collect = _Collector(stats, len(layers), max(min(self.window, t), min(ERROR_QUERIES, t)))
        token = _rope.set({})
        try:
            with attention.using(collect):
                lm.model.model(input_ids=torch.tensor([token_ids], device=lm.device), use_cache=False)
        except _Done:
            pass
        finally:
            _rope.reset(token)
        if collect.layers != len(layers):
            raise RuntimeError(f"the probe saw {collect.layers} of the model's {len(layers)} attention layers")
        return stats.result(time.perf_counter() - start)


class _Done(Exception):
    """The last layer's statistics are in: the rest of the forward is not needed."""


class _Collector:
    """The attention handler of a probe's forward: per layer, in order, the statistics of its
    queries and keys (RoPE applied as the model applies it) and causal attention over them."""

    def __init__(self, stats: LayerStatistics, num_layers: int, last_queries: int):
        self.stats, self.num_layers, self.last_queries, self.layers = stats, num_layers, last_queries, 0

    def __call__(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q: [1, H, T, D], k, v: [1, H_kv, T, D], pre-RoPE (the hook's identity rotation) -> [1, T, H, D]."""
        cos, sin = _rope.get()[module.layer_idx]
        q_rot, k_rot = _rotary(module)(q, k, cos, sin)
        t = k.shape[-2]
        self.stats.add(q_rot[0, :, t - self.last_queries:], k_rot[0], k[0], v[0], scaling)
        self.layers += 1
        if self.layers == self.num_layers:
            raise _Done()
        return attention.causal_attention(q_rot, k_rot, v, scaling)


def _rotary(module):
    """The `apply_rotary_pos_emb` of the module's own modeling file."""
    fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise NotImplementedError(f"{type(module).__name__}: no apply_rotary_pos_emb in {type(module).__module__}; "
                                  "the probe cannot see its keys before RoPE")
    return fn


def _identity_rope(module, args, kwargs):
    """While a probe runs (in this context): keep the layer's (cos, sin) for the collector and hand
    the module the identity rotation, so its attention receives pre-RoPE queries and keys."""
    seen = _rope.get()
    if seen is None:
        return None
    if "position_embeddings" not in kwargs:
        raise NotImplementedError(f"{type(module).__name__} takes no position_embeddings: the probe cannot see "
                                  "its keys before RoPE")
    cos, sin = kwargs["position_embeddings"]
    seen[module.layer_idx] = (cos, sin)
    return args, {**kwargs, "position_embeddings": (torch.ones_like(cos), torch.zeros_like(sin))}


def _prepare(model) -> list:
    """The model's attention set to kvplan's and its attention modules hooked (once) -> the
    decoder layers."""
    if model.config._attn_implementation != attention.NAME:
        model.set_attn_implementation(attention.register())
    if not getattr(model, _HOOKED, False):
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(_identity_rope, with_kwargs=True)
        setattr(model, _HOOKED, True)
    return model.model.layers
