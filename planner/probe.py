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
  MiniCache's cue for which adjacent layers merge;
- with `losses=True`, what storage forms would cost the layer (`Losses`): the relative error of
  the last `ERROR_QUERIES` queries' attention output when each KV head keeps only a share of
  the context (SnapKV selection: group-mean window scores, pooled, copy span), and when K/V are
  quantized (KIVI layout, `kernels.quantize_pack`), each against the exact output; plus the
  window attention mass the kept share retains.

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

from executor import scoring        # the executor's own scoring math, so probe and cache select alike
from planner.request import InvalidRequest

K_SIMILAR, V_SIMILAR = 0.9, 0.6     # the cosine thresholds of SpindleKV's observation plots
FRACTIONS = (1.0, 0.75, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05, 0.0)   # context share kept per KV head
BITS = (16, 8, 4, 2)                # 16: the storage dtype, unquantized
QUANT_GROUP = 32                    # KIVI group (tokens for K, channels for V)
ERROR_QUERIES = 8                   # the window's last queries whose output errors are measured
SINKS, SPAN, POOL = 4, 16, 7        # the selection the losses assume (auto's eviction part)


@dataclass(frozen=True)
class Losses:
    """Per layer, the predicted relative output error of storage forms (see the module doc)."""
    fractions: np.ndarray        # [F] context share kept per KV head (sinks and window always kept)
    evict: np.ndarray            # [m, F] output error keeping that share, exact rows
    retained: np.ndarray         # [m, F] window attention mass the kept tokens hold (group mean)
    bits: np.ndarray             # [B] storage bits (16 = unquantized)
    quant: np.ndarray            # [m, B] output error with every token quantized at those bits


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
    losses: Losses | None = None  # storage-form losses, when asked for


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


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """[H, T] -> [H, T], the executor's pooling (`executor.scoring.pool`), each row then
    normalised to sum 1."""
    scores = scoring.pool(scores, kernel)
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-30)


def similar_share(x: torch.Tensor, theta: float, sample: int, gen: torch.Generator) -> float:
    """x [H_kv, T, D] -> share of (row, other row) pairs with cosine > theta, over `sample`
    sampled rows against 4·`sample` sampled rows (every pair when T is that small)."""
    hk, t, _ = x.shape
    if t < 2:
        return 0.0
    xn = F.normalize(x.float(), dim=-1)
    rows = torch.randperm(t, generator=gen)[:min(sample, t)]                                  # [S]
    cols = torch.randperm(t, generator=gen)[:min(4 * sample, t)]                              # [C]
    cos = torch.einsum("hsd,hcd->hsc", xn[:, rows], xn[:, cols])                              # [H_kv, S, C]
    other = rows[:, None] != cols[None, :]                                                    # [S, C] not itself
    return float(((cos > theta) & other).float().sum() / (hk * other.sum()))


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """a, b [H_kv, T, D]: the same tokens in two layers -> mean arccos(cos)/π over rows."""
    cos = F.cosine_similarity(a.float(), b.float(), dim=-1).clamp(-1.0, 1.0)
    return float(torch.arccos(cos).mean() / math.pi)


def _output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [H, Wq, D], k, v [H_kv, T, D], mask [H or 1, Wq, T] bool -> [H, Wq, D]."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None], scale=scaling,
                                          enable_gqa=True)[0]


def _rel(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out - exact).pow(2).sum() / exact.pow(2).sum().clamp_min(1e-30))


def _dequantized(k: torch.Tensor, v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [H_kv, T, D] -> both through KIVI quantization at `bits` (K per channel over groups
    of QUANT_GROUP tokens, V per token over groups of gcd(QUANT_GROUP, D) channels); the last
    T mod QUANT_GROUP tokens stay exact, as a quant layer's full-precision tail does."""
    from kernels import quantize_pack, unpack_dequantize
    hk, t, d = k.shape
    q_t = t - t % QUANT_GROUP
    kq, vq = k.clone(), v.clone()
    if q_t:
        rows = k[:, :q_t].transpose(1, 2).reshape(hk * d, q_t)                                  # [H_kv D, Q]
        kq[:, :q_t] = unpack_dequantize(*quantize_pack(rows, bits, QUANT_GROUP), bits, QUANT_GROUP
                                        ).view(hk, d, q_t).transpose(1, 2)
        g = math.gcd(QUANT_GROUP, d)
        vq[:, :q_t] = unpack_dequantize(*quantize_pack(v[:, :q_t].reshape(-1, d), bits, g), bits, g).view(hk, q_t, d)
    return kq, vq


def layer_losses(q_win: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_mass: torch.Tensor,
                 scaling: float, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer: q_win [H, Wq, D] the last queries, k [H_kv, T, D] post-RoPE, v [H_kv, T, D],
    window_mass [H, T] the window's attention -> (evict [F], retained [F], quant [B])."""
    h, wq, _ = q_win.shape
    hk, t, _ = k.shape
    window = min(window, t)
    sinks = min(SINKS, t - window)
    n_ctx = t - window - sinks
    causal = torch.arange(t)[None, :] <= torch.arange(t - wq, t)[:, None]                  # [Wq, T]
    exact = _output(q_win, k, v, causal[None], scaling)
    mass = scoring.group_mean(window_mass, hk)                                              # [H_kv, T]
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    ranked = scoring.spread(scoring.pool(mass, POOL), SPAN)[:, sinks:t - window]            # [H_kv, n_ctx]
    order = ranked.argsort(dim=-1, descending=True) + sinks                                 # best first
    evict, retained = [], []
    for f in FRACTIONS:
        kept = torch.zeros(hk, t, dtype=torch.bool)
        kept[:, :sinks] = True
        kept[:, t - window:] = True
        kept.scatter_(1, order[:, :round(f * n_ctx)], True)
        mask = kept.repeat_interleave(h // hk, dim=0)[:, None, :] & causal[None]          # [H, Wq, T]
        evict.append(_rel(_output(q_win, k, v, mask, scaling), exact))
        retained.append(float((mass * kept).sum(-1).mean()))
    quant = [0.0 if b == 16 else _rel(_output(q_win, *_dequantized(k, v, b), causal[None], scaling), exact)
             for b in BITS]
    return np.array(evict), np.array(retained), np.array(quant)


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
        gen = torch.Generator().manual_seed(0)
        ids = torch.tensor([token_ids])
        h = inner.embed_tokens(ids)                                                          # [1, T, hidden]
        cos, sin = inner.rotary_emb(h, torch.arange(t)[None])
        scores, k_sim, v_sim, k_ang, v_ang, lost = [], [], [], [], [], []
        prev = None
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, t, hq, d).transpose(1, 2)                             # [1, H, T, D]
            k = attn.k_proj(x).view(1, t, hk, d).transpose(1, 2)                             # [1, H_kv, T, D] pre-RoPE
            v = attn.v_proj(x).view(1, t, hk, d).transpose(1, 2)
            q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
            s = scoring.window_scores(q_rot[0, :, t - w:], k_rot[0], attn.scaling)            # [H, T]
            if losses:
                lost.append(layer_losses(q_rot[0, :, t - min(ERROR_QUERIES, t):].float(), k_rot[0].float(),
                                         v[0].float(), s, attn.scaling, w))
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
            losses=None if not losses else Losses(
                fractions=np.array(FRACTIONS), evict=np.stack([x[0] for x in lost]),
                retained=np.stack([x[1] for x in lost]), bits=np.array(BITS), quant=np.stack([x[2] for x in lost])),
        )
