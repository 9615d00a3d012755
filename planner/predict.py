"""What any plan is predicted to keep of a probed prompt's attention — the same yardstick for
every strategy, probing or not, so plans can be ranked before they run.

Per layer, the kept tokens are the ones the executor would keep (sinks, window, and each stored
head's top `keep_tokens` by the window scores of the plan's GQA mode; StreamingLLM: sinks and
window only), and the layer's retained attention is the share of the window's attention mass
they hold, averaged over the stored heads. Layers without eviction (full, quant, merge,
codebook without eviction) keep every token: 1.0. The plan's figure is the mean over layers.
Pooling and the copy span are left out: they decide among near-equal tokens, not the mass."""
from __future__ import annotations

import numpy as np

from kvplan.plan import CompressionPlan
from planner.probe import ProbeStats


def retained_attention(plan: CompressionPlan, stats: ProbeStats, num_kv_heads: int) -> float:
    """stats.window_scores: [m, H, T] per query head (a `repeat`-mode probe) -> mean over layers."""
    scores = stats.window_scores                                                            # [m, H, T]
    m, h, t = scores.shape
    out = []
    for lp in plan.layers:
        ev = lp.eviction
        if ev is None:
            out.append(1.0)
            continue
        s = scores[lp.layer]                                                                # [H, T]
        if ev.gqa_mode != "repeat":
            s = s.reshape(num_kv_heads, h // num_kv_heads, t).mean(1)                       # [H_kv, T]
        window = min(ev.window, t)
        sinks = min(ev.sink_tokens, t - window)
        ctx = s[:, sinks:t - window]                                                        # [heads, n_ctx]
        keep = 0 if ev.scorer == "streaming_llm" else max(0, min(ev.keep_tokens or 0, ctx.shape[1]))
        fixed = s[:, :sinks].sum(-1) + s[:, t - window:].sum(-1)                            # [heads]
        top = -np.sort(-ctx, axis=-1)[:, :keep].sum(-1) if keep else 0.0
        out.append(float(np.mean((fixed + top) / np.maximum(s.sum(-1), 1e-30))))
    return float(np.mean(out))
