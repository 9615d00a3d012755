"""What any plan is predicted to keep of a probed prompt's attention — the same yardstick for
every strategy, probing or not, so plans can be ranked before they run.

Per layer, the kept tokens are the ones the executor would keep (sinks, window, and each stored
head's top `keep_tokens` by the window scores of the plan's GQA mode; StreamingLLM: sinks and
window only), and the layer's retained attention is the share of the window's attention mass
they hold, averaged over the stored heads. Layers without eviction (full, quant, merge,
codebook without eviction) keep every token: 1.0. The plan's figure is the mean over layers.
Pooling and the copy span are left out: they decide among near-equal tokens, not the mass.

`copy_retained_attention` asks more of a kept token: an answer read from the context is copied
token by token from where the window's attention lands, so a token's attention only counts for
the share of it and the `COPY` tokens after it that are kept (the same argument as the
executor's copy span, `kvcore.scoring.spread`). Its kept tokens are the executor's own
selection (pooling, copy span, GQA mode; KVCrush's representatives are counted as more
top-ranked tokens, and a codebook layer's byte budget as that many tokens). A plan that keeps the attended tokens but drops what
follows them — attention-score eviction on this small model — scores low here even where its
retained mass is high."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from kvcore import scoring
from kvcore.plan import CompressionPlan, Eviction
from kvcore.statistics import ProbeStats
from kvcore.request import InvalidRequest
from planner.request import ModelShape

COPY = 16   # tokens after an attended one that a copied answer may run over


def retained_attention(plan: CompressionPlan, stats: ProbeStats, num_kv_heads: int) -> float:
    """stats.window_scores: [m, H, T] per query head (a `repeat`-mode probe) -> mean over layers."""
    def layer(ev: Eviction, s: np.ndarray) -> float:                                     # s: [H, T]
        h, t = s.shape
        if ev.gqa_mode != "repeat":
            s = s.reshape(num_kv_heads, h // num_kv_heads, t).mean(1)                       # [H_kv, T]
        window = min(ev.window, t)
        sinks = min(ev.sink_tokens, t - window)
        ctx = s[:, sinks:t - window]                                                        # [heads, n_ctx]
        keep = 0 if ev.scorer == "streaming_llm" else max(0, min(ev.keep_tokens or 0, ctx.shape[1]))
        fixed = s[:, :sinks].sum(-1) + s[:, t - window:].sum(-1)                            # [heads]
        top = -np.sort(-ctx, axis=-1)[:, :keep].sum(-1) if keep else 0.0
        return float(np.mean((fixed + top) / np.maximum(s.sum(-1), 1e-30)))
    return _mean_over_layers(plan, stats, layer)


def copy_retained_attention(plan: CompressionPlan, stats: ProbeStats, num_kv_heads: int, copy: int = COPY) -> float:
    """stats.window_scores: [m, H, T] per query head (a `repeat`-mode probe) -> mean over layers
    of sum_j w_j · (share of tokens j..j+copy the layer keeps) / sum_j w_j, per stored head."""
    def layer(ev: Eviction, raw: np.ndarray) -> float:                                   # raw: [H, T]
        s = torch.from_numpy(np.asarray(raw, dtype=np.float32))
        t = s.shape[1]
        rank = None if ev.scorer == "streaming_llm" else scoring.ranking(s, ev, num_kv_heads)  # [heads, T]
        if ev.gqa_mode != "repeat":
            s = scoring.group_mean(s, num_kv_heads)                                         # [H_kv, T]
        heads = s.shape[0]
        rows = scoring.select(rank, t, 0 if rank is None else ev.keep_tokens or 0, ev.window, ev.sink_tokens, heads)
        kept = torch.zeros(heads, t + copy).scatter_(1, rows, 1.0)                         # [heads, T + copy]
        kept[:, t:] = 1.0                                                                   # past the prompt: nothing to miss
        run = torch.nn.functional.pad(kept.cumsum(-1), (1, 0))                              # [heads, T + copy + 1]
        cover = (run[:, copy + 1:copy + 1 + t] - run[:, :t]) / (copy + 1)                   # [heads, T] share of j..j+copy kept
        return float(((s * cover).sum(-1) / s.sum(-1).clamp_min(1e-30)).mean())
    return _mean_over_layers(plan, stats, layer)


def annotate(plan: CompressionPlan, stats: ProbeStats, num_kv_heads: int) -> CompressionPlan:
    """The plan with both figures computed here from a `repeat`-mode probe of its prompt (what a
    `predict` request gets, whatever the strategy)."""
    return dataclasses.replace(plan, predicted_retained_attention=retained_attention(plan, stats, num_kv_heads),
                               predicted_copy_retained_attention=copy_retained_attention(plan, stats, num_kv_heads))


def from_probe(plan: CompressionPlan, probe, model: ModelShape) -> CompressionPlan:
    """`annotate` from the job's lazy probe (`planner.probe.once`), run in `repeat` mode; the
    probed model must have the plan's shape (else InvalidRequest on `model`)."""
    stats = probe(gqa_mode="repeat")
    got = stats.window_scores.shape[:2]
    if tuple(got) != (model.num_layers, model.num_query_heads):
        raise InvalidRequest("model", f"the planner's model has {got[0]} layers x {got[1]} query heads, "
                                      f"the request says {model.num_layers} x {model.num_query_heads}")
    return annotate(plan, stats, model.num_kv_heads)


def _mean_over_layers(plan: CompressionPlan, stats: ProbeStats, layer: Callable[[Eviction, np.ndarray], float]) -> float:
    """Mean over the plan's layers of `layer(eviction, window_scores [H, T])`; a layer without
    eviction keeps every token: 1.0."""
    return float(np.mean([1.0 if lp.eviction is None else layer(lp.eviction, stats.window_scores[lp.layer])
                          for lp in plan.layers]))
