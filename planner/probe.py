"""The probe engine: a mini-prefill of the executor's model that writes no KV cache and stops
right after the last layer's attention (no final MLP, no norm, no LM head), collecting per
layer the statistics strategies plan from:

- `window_scores` [m, H_e, T]: the attention the last `window` queries (post-RoPE) pay each
  token, summed over the window, avg-pooled (`pool_kernel`) and normalised to sum 1 per
  stored head (query heads in GQA `repeat` mode, KV heads — the group mean — in `mean`);
  computed as [H, W, T] logits per layer, never a T x T matrix;
- `k_similar`, `v_similar` [m]: the share of sampled token pairs whose pre-RoPE keys (values)
  have cosine above 0.9 (0.6) — SpindleKV's observation statistic (spec App. B thresholds),
  from `sample` rows against all T per KV head;
- `k_angle`, `v_angle` [m-1]: the mean angular distance (arccos(cos)/π, in [0, 1]) between the
  same token's pre-RoPE key (value) rows in layer i and i+1, over tokens and KV heads —
  MiniCache's cue for which adjacent layers merge.

Layers run one at a time over the whole prompt; only the residual stream [T, hidden] and the
previous layer's pre-RoPE K/V live across layers."""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

K_SIMILAR, V_SIMILAR = 0.9, 0.6     # the cosine thresholds of SpindleKV's observation plots


@dataclass(frozen=True)
class ProbeStats:
    tokens: int                  # T, the probed prompt's length
    window_scores: np.ndarray    # [m, H_e, T] float32, each row sums to 1
    k_similar: np.ndarray        # [m] share of sampled pre-RoPE key pairs with cosine > 0.9
    v_similar: np.ndarray        # [m] the same for values (> 0.6)
    k_angle: np.ndarray          # [m-1] mean angular distance of layer i and i+1 keys, in [0, 1]
    v_angle: np.ndarray          # [m-1] the same for values
    window: int = 32             # the observation window the scores came from
    seconds: float = 0.0         # wall time of the probe


def window_attention(q_win: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q_win [H, W, D] (the last W positions, post-RoPE), k [H_kv, T, D] post-RoPE -> [H, T]:
    the attention mass the window pays each key, causal inside the window."""
    h, w, _ = q_win.shape
    t = k.shape[1]
    kr = k.repeat_interleave(h // k.shape[0], dim=0)
    logits = torch.einsum("hwd,htd->hwt", q_win, kr) * scaling                              # [H, W, T]
    logits.masked_fill_((torch.arange(t)[None, :] > torch.arange(t - w, t)[:, None])[None], float("-inf"))
    return logits.softmax(-1).sum(1)


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """[H, T] -> [H, T], odd 1-D average pooling, then each row normalised to sum 1."""
    if kernel > 1:
        k = kernel | 1
        scores = F.avg_pool1d(scores[:, None], k, stride=1, padding=k // 2, count_include_pad=False)[:, 0]
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-30)


def similar_share(x: torch.Tensor, theta: float, sample: int, gen: torch.Generator) -> float:
    """x [H_kv, T, D] -> share of (sampled row, other row) pairs with cosine > theta."""
    hk, t, _ = x.shape
    if t < 2:
        return 0.0
    xn = F.normalize(x.float(), dim=-1)
    rows = torch.randperm(t, generator=gen)[:min(sample, t)]                                  # [S]
    cos = torch.einsum("hsd,htd->hst", xn[:, rows], xn)                                       # [H_kv, S, T]
    cos[:, torch.arange(len(rows)), rows] = -2.0                                              # not itself
    return float((cos > theta).float().sum() / (hk * len(rows) * (t - 1)))


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """a, b [H_kv, T, D]: the same tokens in two layers -> mean arccos(cos)/π over rows."""
    cos = F.cosine_similarity(a.float(), b.float(), dim=-1).clamp(-1.0, 1.0)
    return float(torch.arccos(cos).mean() / math.pi)


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
    def probe(self, token_ids: list[int], gqa_mode: str = "repeat") -> ProbeStats:
        """token_ids: the prompt as the executor will prefill it -> statistics for every layer."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if not token_ids:
            raise ValueError("token_ids: the probe needs the prompt's tokens, got none")
        start = time.perf_counter()
        lm = self.model()
        inner = lm.model.model
        hk, hq, d = lm.num_kv_heads, lm.num_query_heads, lm.head_dim
        t = len(token_ids)
        w = min(self.window, t)
        gen = torch.Generator().manual_seed(0)
        ids = torch.tensor([token_ids])
        h = inner.embed_tokens(ids)                                                          # [1, T, hidden]
        cos, sin = inner.rotary_emb(h, torch.arange(t)[None])
        scores, k_sim, v_sim, k_ang, v_ang = [], [], [], [], []
        prev = None
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, t, hq, d).transpose(1, 2)                             # [1, H, T, D]
            k = attn.k_proj(x).view(1, t, hk, d).transpose(1, 2)                             # [1, H_kv, T, D] pre-RoPE
            v = attn.v_proj(x).view(1, t, hk, d).transpose(1, 2)
            q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
            s = window_attention(q_rot[0, :, t - w:].float(), k_rot[0].float(), attn.scaling)  # [H, T]
            if gqa_mode == "mean":
                s = s.view(hk, hq // hk, t).mean(1)
            scores.append(pooled(s, self.pool_kernel))
            k_sim.append(similar_share(k[0], K_SIMILAR, self.sample, gen))
            v_sim.append(similar_share(v[0], V_SIMILAR, self.sample, gen))
            if prev is not None:
                k_ang.append(angle(prev[0], k[0]))
                v_ang.append(angle(prev[1], v[0]))
            prev = (k[0], v[0])
            if i == len(inner.layers) - 1:          # the last attention's statistics are all we need
                break
            o = F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, scale=attn.scaling,
                                               enable_gqa=hq != hk)                            # [1, H, T, D]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(1, t, hq * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return ProbeStats(
            tokens=t, window_scores=torch.stack(scores).numpy().astype(np.float32),
            k_similar=np.array(k_sim, np.float32), v_similar=np.array(v_sim, np.float32),
            k_angle=np.array(k_ang, np.float32), v_angle=np.array(v_ang, np.float32),
            window=w, seconds=time.perf_counter() - start,
        )
