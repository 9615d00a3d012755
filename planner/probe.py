"""The probe engine: a mini-prefill of the executor's model that writes no KV cache and stops
right after the last layer's attention (no final MLP, no norm, no LM head), collecting per layer
the statistics strategies plan from (`kvcore.statistics`: window attention, similar-row shares,
adjacent-layer angles, storage-form losses). The executor's own prefill collects the same at the
context's end, so a job it sends statistics with needs no probe; this engine serves `kvplan plan`,
profiles, benches and requests that come without them.

Layers run one at a time over the whole prompt; only the residual stream [T, hidden] and the
previous layer's pre-RoPE K/V live across layers; window scores are [H, W, T] logits per layer,
never a T x T matrix."""
from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

from kvcore.statistics import ERROR_QUERIES, LayerStatistics, ProbeStats
from planner.request import InvalidRequest


def once(run, token_ids: list[int], on_probe=None):
    """One job's lazy probe of its token ids: `probe(gqa_mode=..., losses=...)` calls
    `run(token_ids, gqa_mode=..., losses=...)` (a `Prober.probe`) at most once per GQA mode (a
    result with losses serves a later call without them); `on_probe()` is called before each
    real probe. -> the callable"""
    done: dict[str, ProbeStats] = {}

    def probe(gqa_mode: str = "repeat", losses: bool = False) -> ProbeStats:
        got = done.get(gqa_mode)
        if got is None or (losses and got.losses is None):
            if on_probe is not None:
                on_probe()
            got = done[gqa_mode] = run(token_ids, gqa_mode=gqa_mode, losses=losses)
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
                from kvplan import model
                self.lm = model.load(self.model_cfg)
            return self.lm

    @torch.inference_mode()
    def probe(self, token_ids: list[int], gqa_mode: str = "repeat", losses: bool = False) -> ProbeStats:
        """token_ids: the prompt as the executor will prefill it -> statistics for every layer
        (`losses`: also what storage forms would lose, for `auto`)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if not token_ids:
            raise ValueError("token_ids: the probe needs the prompt's tokens, got none")
        start = time.perf_counter()
        lm = self.model()
        check_tokens(token_ids, lm.max_context, lm.model.config.vocab_size)
        inner = lm.model.model
        hk, hq, d = lm.num_kv_heads, lm.num_query_heads, lm.head_dim
        t = len(token_ids)
        w = min(self.window, t)
        ids = torch.tensor([token_ids])
        h = inner.embed_tokens(ids)                                                          # [1, T, hidden]
        cos, sin = inner.rotary_emb(h, torch.arange(t)[None])
        stats = LayerStatistics(gqa_mode, losses, self.window, self.pool_kernel, self.sample)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, t, hq, d).transpose(1, 2)                             # [1, H, T, D]
            k = attn.k_proj(x).view(1, t, hk, d).transpose(1, 2)                             # [1, H_kv, T, D] pre-RoPE
            v = attn.v_proj(x).view(1, t, hk, d).transpose(1, 2)
            q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
            stats.add(q_rot[0, :, t - max(w, min(ERROR_QUERIES, t)):], k_rot[0], k[0], v[0], attn.scaling)
            if i == len(inner.layers) - 1:          # the last attention's statistics are all we need
                break
            o = F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, scale=attn.scaling,
                                               enable_gqa=hq != hk)                            # [1, H, T, D]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(1, t, hq * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return stats.result(time.perf_counter() - start)
