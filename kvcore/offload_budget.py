"""SpeCache's offload part fitted to a job's budget: the key and value group sizes, the recent
window and the prefetch width (the plan fixes the bits) chosen so that the bytes an offload
layer holds stay within the job's reserve ratio over the whole job. The planner fits the part
when it plans; the engine refits it to the job's own length when it admits it.

Per layer and KV head an offload layer holds pages of the pool (`kvcore.plan_cost.offload_pages`):
the low-bit copy (quant pages of key groups of 32 rows, the newest `recent_window` rows and the
rows past the last whole page dense), its sinks and `top_k` prefetch slots as exact coded rows,
and a skip page. The ratio is against the K+V of every token in the storage dtype.

Candidates: the plan's key group (32 tokens in the presets), value groups of 64 or 32 channels,
windows from the plan's down by halves to 0, prefetch widths from the plan's down to 32. The one
chosen fits the budget after the prompt and at the job's last token and is the first by: wider
prefetch, longer window, larger value group. Two floors, never lowered: keys per 32 tokens (the
keys' group is what 2-bit answers hinge on: 64-token key groups lose needles that 32-token groups
find) and 32 prefetched rows (SpeCache without them is plain KIVI). When even the floor does not
fit — short prompts, where the window and the prefetch buffer weigh most — the floor is used and
the job reports the ratio it really held. The measurements behind both floors are in
docs/benchmarks.md (SpeCache)."""
from __future__ import annotations

import dataclasses
import itertools

from kvcore.blocks import Layout
from kvcore.plan_cost import offload_pages
from kvcore.plan import OffloadPlan

VALUE_GROUPS = (64, 32)
TOP_KS = (48, 32)          # below the plan's own; 32 is the floor


def resident_bytes(off: OffloadPlan, tokens: int, heads: int, head_dim: int, itemsize: int = 2,
                   after: list[int] | None = None) -> int:
    """Bytes one offload layer's pages hold with `tokens` tokens (at its worst step while `after`
    rows join, when given): its low-bit copy, sinks, prefetch slots and skip page (`kvcore.plan_cost`)."""
    lay = Layout(head_dim, itemsize)
    return heads * offload_pages(lay, off, tokens, after or []) * lay.page_bytes


def ratio(off: OffloadPlan, prompt_tokens: int, new_tokens: int, head_dim: int, itemsize: int = 2) -> float:
    """The largest resident / full ratio over the job (after the prompt; at its last token)."""
    worst = 0.0
    for tokens, after in ((prompt_tokens, []), (prompt_tokens, [1] * max(new_tokens - 1, 0))):
        full = (tokens + sum(after)) * 2 * head_dim * itemsize
        worst = max(worst, resident_bytes(off, tokens, 1, head_dim, itemsize, after) / max(full, 1))
    return worst


def fit(off: OffloadPlan, budget: float | None, prompt_tokens: int, new_tokens: int, head_dim: int,
        itemsize: int = 2) -> OffloadPlan:
    """The plan's offload part with groups, window and top_k chosen to fit `budget` (a reserve
    ratio; None: the plan's values as they are)."""
    if budget is None or not off.enabled:
        return off
    windows = sorted({off.recent_window} | {off.recent_window >> i for i in range(1, 8)}, reverse=True)
    top_ks = sorted({off.top_k} | {k for k in TOP_KS if k < off.top_k}, reverse=True)
    options = [dataclasses.replace(off, value_group_size=gv, recent_window=r, top_k=k)
               for gv, r, k in itertools.product(VALUE_GROUPS, windows, top_ks)]
    ratios = [ratio(o, prompt_tokens, new_tokens, head_dim, itemsize) for o in options]
    fits = [o for o, x in zip(options, ratios) if x <= budget]
    if not fits:                        # the floor: the cheapest, and of those the first by the same order
        fits = [o for o, x in zip(options, ratios) if x == min(ratios)]
    return max(fits, key=lambda o: (o.top_k, o.recent_window, o.value_group_size))
