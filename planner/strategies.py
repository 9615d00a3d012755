"""The strategy registry: a plain dict of named, versioned plan functions.

A strategy is `(PlanInput, plan_id) -> CompressionPlan`; the service only ever looks names up
here. The eviction baselines and SpindleKV are one `EvictionRecipe` each: data (scorer,
allocation, window, sinks, GQA mode, codebook) read by one `plan` function.

Budget reading (the executor's contract): `Eviction.keep_tokens` is context tokens kept per
stored head, excluding the `sink_tokens` first and the `window` last prompt tokens, which are
always kept. A job's budget of r·l tokens (or kv_tokens N, i.e. r = N/l) is that whole
per-head count: sinks + window + keep_tokens, on average over layers, but never less than
the window (a budget below it keeps the window, and the predicted ratio says so). A budget
that holds the whole prompt (r >= 1) gives the full plan; a layer that would evict nothing
gets no Eviction.

In a layer with a codebook the executor reads the same count as a BYTE budget (the dense fp16
bytes of that many tokens on the native KV heads) and keeps as many tokens as their coded form
fits: the codebook saves first, eviction takes only what the codebook cannot.

`predicted_reserve_ratio` = mean over layers of kept/l, counted against the native h_kv-head
cache. In "repeat" mode the executor stores each KV group's union of kept tokens plus a small
per-head index; kept/l is the planner's estimate of that (the union is at most h_n× the
per-head count, the index a few bytes per entry) and is not corrected here; codebook layers
hold their byte budget exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvplan.plan import CompressionPlan, Codebook, Eviction, LayerPlan, full_plan
from planner.allocation import ALLOCATIONS
from planner.request import PlanInput

SCORERS = ("snapkv", "h2o", "streaming_llm")
GQA_MODES = ("repeat", "mean")

@dataclass(frozen=True)
class Strategy:
    name: str
    version: str
    description: str
    plan: Callable[[PlanInput, str], CompressionPlan]   # (input, plan_id) -> plan


@dataclass(frozen=True)
class EvictionRecipe:
    """One eviction strategy as data; `plan` turns a job's budget into per-layer Evictions."""
    scorer: str                       # one of SCORERS
    allocation: str = "uniform"       # key of allocation.ALLOCATIONS
    window: int | None = 32           # last prompt tokens, always kept (the budget cannot go below it);
                                      # None: the window is whatever the budget leaves after the sinks
    sink_tokens: int = 0              # leading prompt tokens always kept
    pool_kernel: int = 1              # 1-D avg-pool over scores (1 = none)
    span_tokens: int = 0              # copy span after pooling (executor.scoring.spread); 0 = off
    gqa_mode: str = "mean"            # one of GQA_MODES
    codebook: Codebook | None = None  # put on every layer (the executor codes where it pays)

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer {self.scorer!r} is not one of {SCORERS}")
        if self.gqa_mode not in GQA_MODES:
            raise ValueError(f"gqa_mode {self.gqa_mode!r} is not one of {GQA_MODES}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {self.allocation!r} is not one of {sorted(ALLOCATIONS)}")
        if (self.window is not None and self.window < 0) or self.sink_tokens < 0 or self.pool_kernel < 1:
            raise ValueError("window and sink_tokens must be >= 0 and pool_kernel >= 1")
        if self.span_tokens < 0:
            raise ValueError("span_tokens must be >= 0")

    def plan(self, inp: PlanInput, plan_id: str) -> CompressionPlan:
        l, m, r = inp.prompt_tokens, inp.model.num_layers, inp.target_ratio
        if l == 0 or r >= 1.0:   # the budget holds the whole prompt: nothing to compress
            return full_plan(m, plan_id, strategy=inp.strategy, fingerprint=inp.model.fingerprint)
        budget = min(l, math.floor(r * l + 1e-9))             # kept tokens per stored head, layer average
        sinks = min(self.sink_tokens, budget)
        window = budget - sinks if self.window is None else self.window
        fixed = sinks + window                                # always kept
        keep = ALLOCATIONS[self.allocation](r, l, fixed, m)   # [m] context tokens per stored head
        layers = tuple(
            LayerPlan(layer=i, eviction=self._eviction(int(k), sinks, window, l), codebook=self.codebook)
            for i, k in enumerate(keep)
        )
        kept = np.minimum(l, fixed + keep)                    # [m] tokens per stored head
        return CompressionPlan(
            plan_id=plan_id, strategy=inp.strategy, layers=layers, model_fingerprint=inp.model.fingerprint,
            predicted_reserve_ratio=float(kept.mean() / l),
        )

    def _eviction(self, keep: int, sinks: int, window: int, l: int) -> Eviction | None:
        if sinks + window + keep >= l:   # nothing would be evicted: no scoring, no index
            return None
        return Eviction(keep_tokens=keep, window=window, pool_kernel=self.pool_kernel, scorer=self.scorer,
                        gqa_mode=self.gqa_mode, sink_tokens=sinks, span_tokens=self.span_tokens)


def _full(inp: PlanInput, plan_id: str) -> CompressionPlan:
    return full_plan(inp.model.num_layers, plan_id, strategy="full", fingerprint=inp.model.fingerprint)


RECIPES: dict[str, EvictionRecipe] = {
    "streaming_llm": EvictionRecipe(scorer="streaming_llm", window=None, sink_tokens=4),
    "h2o": EvictionRecipe(scorer="h2o"),
    "snapkv": EvictionRecipe(scorer="snapkv", pool_kernel=7),
    "pyramidkv": EvictionRecipe(scorer="snapkv", allocation="pyramid", pool_kernel=7),
    # pool 7 as in SnapKV/PyramidKV: a kept token keeps its neighbours (a needle spans tokens)
    "spindlekv_paper": EvictionRecipe(scorer="snapkv", allocation="pyramid", gqa_mode="repeat", pool_kernel=7,
                                      codebook=Codebook(theta_k=0.98, theta_v=0.95)),
    # [ours] + a copy span of 16 tokens after each attended token: enough for a long number, a
    # name or a few words, which decoding copies token by token (scoring.spread says why).
    # Chosen from that argument, not fitted to the bench; the baselines stay as published.
    "spindlekv": EvictionRecipe(scorer="snapkv", allocation="pyramid", gqa_mode="repeat", pool_kernel=7,
                                span_tokens=16, codebook=Codebook(theta_k=0.98, theta_v=0.95)),
}

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in [
        Strategy("full", "1", "uncompressed KV in every layer (the reference)", _full),
        Strategy("streaming_llm", "1", "4 attention sinks + the most recent tokens, same budget in every layer",
                 RECIPES["streaming_llm"].plan),
        Strategy("h2o", "1", "heavy hitters by accumulated attention + 32 recent tokens, uniform per layer",
                 RECIPES["h2o"].plan),
        Strategy("snapkv", "1", "top tokens by pooled observation-window attention (window 32), uniform per layer",
                 RECIPES["snapkv"].plan),
        Strategy("pyramidkv", "1", "SnapKV scoring with a linear pyramid budget, shallow layers keep most",
                 RECIPES["pyramidkv"].plan),
        Strategy("spindlekv", "2", "pyramid byte budgets; cosine codebooks first, then eviction per query head "
                 "(GQA repeat), each attended token keeping the 16 after it (copy span)",
                 RECIPES["spindlekv"].plan),
        Strategy("spindlekv_paper", "1", "SpindleKV as published: spindlekv without the copy span",
                 RECIPES["spindlekv_paper"].plan),
    ]
}
