"""The `compose` planner: one definition's parts laid over the layers of one job.

Budget reading (the executor's contract): `Eviction.keep_tokens` is context tokens kept per
stored head, excluding the `sink_tokens` first and the `window` last prompt tokens, which are
always kept. A job's budget of r·l tokens (or kv_tokens N, i.e. r = N/l) is that whole
per-head count: sinks + window + keep_tokens, on average over layers, less what the rows the
job adds after its prompt will hold (`planner.budget`: a question prefilled after compression,
the generated tokens, their stores' spare rows), but never less than the window (a budget
below it keeps the window, and the predicted ratio says so). A budget that holds the whole
cache at every step (r >= 1, or kv_tokens for the prompt and every added row:
`planner.budget.fits_full`) gives the full plan; a layer that would evict nothing gets no Eviction.

Allocations (`allocation`) split the context budget over layers: `uniform` and `pyramid`
(planner/allocation.py) from the budget alone; `xkv` (planner/xkv.py) splits the same total as
`uniform` to maximise the probe's retained window attention: it calls `inp.probe()`, or plans
from `inp.layer_shares` (a profile's averaged shares) without probing.

In a layer with a codebook the executor reads the same count as a BYTE budget (the dense fp16
bytes of that many tokens on the native KV heads): the codebook saves first, eviction takes only
what the codebook cannot. Merged pairs (MiniCache: layers s, s+1; s+2, s+3; ... from
`start_layer`) carry only the merge, on the pair's upper layer; quant goes on every other layer
without a codebook.

`predicted_reserve_ratio` = mean over layers of held/l, counted against the native h_kv-head
cache: kept/l for eviction (in "repeat" mode the executor stores each KV group's union of kept
tokens plus a per-head mask; kept/l is the planner's estimate of that); codebook layers
hold their byte budget exactly; quant layers their kept rows at (bits + 32/g)/16 of fp16 past the
residual tail; a merged pair one layer's directions plus magnitudes and the retained rows of both.
`predicted_retained_attention` (probed plans only) = mean over layers of the window attention the
kept tokens receive, window and sinks included.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import numpy as np

from kvcore import offload_budget
from kvcore.plan import Codebook, CompressionPlan, Eviction, LayerPlan, Merge, OffloadPlan, full_plan
from planner import xkv
from planner.allocation import ALLOCATIONS, uniform_keep_counts
from kvcore.blocks import BLOCK_ROWS, Layout, quant_shape
from kvcore.plan_cost import coded_pages
from planner.budget import context_ratio, fits_full, holds, row_cost
from planner.definition import Definition
from kvcore.request import InvalidRequest
from planner.request import PlanInput


@dataclass(frozen=True)
class Budgets:
    keep: np.ndarray                   # [m] context tokens kept per stored head (sinks, window excluded)
    sinks: int
    window: int
    retained: float | None = None      # predicted share of window attention kept; None: not probed


@dataclass(frozen=True)
class Composed:
    d: Definition

    @property
    def probe_mode(self) -> str | None:
        """The GQA mode its probe scores heads in, or None: it plans without probing."""
        if self.d.eviction and self.d.allocation == "xkv":
            return self.d.eviction.gqa_mode
        return "repeat" if self.d.merge and self.d.merge.min_cos is not None else None

    def plan(self, inp: PlanInput, plan_id: str) -> CompressionPlan:
        d, l, m = self.d, inp.prompt_tokens, inp.model.num_layers
        if l == 0 or fits_full(inp, BLOCK_ROWS) or not (d.eviction or d.codebook or d.merge or d.quant or d.offload):
            return full_plan(m, plan_id, strategy=inp.strategy, fingerprint=inp.model.fingerprint,
                             budget_met=l == 0 or fits_full(inp, BLOCK_ROWS), prompt_tokens=l)
        # A codebook layer's pages (fields, entries, each rounded to whole pages) are not linear in its
        # kept rows: plan at the budget, then, while the coded layers overrun it, at a budget
        # scaled down by the overrun (a few rounds: held is nearly linear in the budget).
        # XKV's shares are learned once, from the round whose plan is returned.
        scale, lay = 1.0, Layout(inp.model.head_dim)
        r = max(context_ratio(inp, self.added_row_cost(inp), self.block(inp)), 1e-9)
        pairs = _gated(merge_pairs(d.merge.start_layer, m), d.merge, inp) if d.merge else {}   # {upper: lower}
        shares: list = []
        rounds = dataclasses.replace(inp, learn=shares.append) if inp.learn is not None else inp
        for _ in range(8):
            layers, held, b = self._layers(rounds, scale, lay, pairs)
            over = np.mean(held) / l / r
            if not (d.codebook and b) or over <= 1 + 1e-9:
                break
            scale /= over + 1e-3      # a hair under: an allocation with ties moves in steps
        if shares:
            inp.learn(shares[-1])
        offload = self._offload(inp)
        plain = [i for i, lp in enumerate(layers) if lp.kind == "full" and i not in pairs.values()] if offload.enabled else []
        met = holds(np.mean([x for i, x in enumerate(held) if i not in plain] or [0.0]) / l, inp,
                    self.added_row_cost(inp), self.block(inp))
        if offload.enabled:          # the part fitted to the budget (kvcore.offload_budget); plain layers hold that
            share = offload_budget.ratio(offload, l, 0, inp.model.head_dim)
            held = [l * share if i in plain else x for i, x in enumerate(held)]
            fitted = offload_budget.fit(offload, inp.target_ratio, l, inp.new_tokens, inp.model.head_dim)
            met = met and offload_budget.ratio(fitted, l, inp.new_tokens, inp.model.head_dim) <= inp.target_ratio + 1e-9
        return CompressionPlan(
            plan_id=plan_id, strategy=inp.strategy, layers=tuple(layers), model_fingerprint=inp.model.fingerprint,
            offload=offload,
            predicted_reserve_ratio=float(np.mean(held) / l),
            predicted_retained_attention=1.0 if b is None or b.retained is None else b.retained,
            budget_met=bool(met), budget_floor_tokens=min(l, b.sinks + b.window) if b else l,
        )

    def _layers(self, inp: PlanInput, scale: float, lay: Layout, pairs: dict[int, int]):
        """-> (layer plans, held [m] token units, budgets) with the eviction budget scaled by
        `scale`; `pairs`: the merged layers {upper: lower}."""
        d, l, m = self.d, inp.prompt_tokens, inp.model.num_layers
        b = self.budgets(inp, scale) if d.eviction else None
        layers, held = [], []
        for i in range(m):
            if i in pairs or i in pairs.values():
                mg = d.merge
                layers.append(LayerPlan(layer=i, merge=Merge(pairs[i], mg.t, mg.retention_k, mg.retention_v))
                              if i in pairs else LayerPlan(layer=i))
                held.append(l * merged_share(mg, inp.model.num_kv_heads * inp.model.head_dim))
                continue
            cb = Codebook(d.codebook.theta_k, d.codebook.theta_v) if d.codebook and d.codebook.on(i) else None
            ev = self._eviction(int(b.keep[i]), b.sinks, b.window, l) if b else None
            layers.append(LayerPlan(layer=i, eviction=ev, codebook=cb, quant=None if cb else d.quant))
            held.append(_held(layers[-1], l, lay))
        return layers, held, b

    def _offload(self, inp: PlanInput) -> OffloadPlan:
        """The plan's offload part, fitted to the budget after the prompt (`kvcore.offload_budget`;
        the engine refits it to the job's length)."""
        o = self.d.offload
        if o is None:
            return OffloadPlan()
        part = OffloadPlan(enabled=True, **dataclasses.asdict(o))
        return offload_budget.fit(part, inp.target_ratio, inp.prompt_tokens, 0, inp.model.head_dim)

    def budgets(self, inp: PlanInput, scale: float = 1.0) -> Budgets:
        e, l, m = self.d.eviction, inp.prompt_tokens, inp.model.num_layers
        r = scale * context_ratio(inp, self.added_row_cost(inp), self.block(inp))   # the prompt's share once added rows are paid
        budget = min(l, math.floor(r * l + 1e-9))             # kept tokens per stored head, layer average
        sinks = min(e.sink_tokens, budget)
        window = budget - sinks if e.window is None else e.window
        if self.d.allocation == "xkv":
            return _xkv(inp, r, sinks, window)
        return Budgets(ALLOCATIONS[self.d.allocation](r, l, sinks + window, m), sinks, window)

    def block(self, inp: PlanInput) -> int:
        """Rows of the dense pages the executor's pool stores the rows a job adds in (every layer)."""
        return BLOCK_ROWS

    def added_row_cost(self, inp: PlanInput) -> float:
        """What a row the job adds after its prompt costs against a dense row (`planner.budget`):
        one dense row, whatever the layer's form (added rows are kept exact)."""
        return row_cost(inp.model.head_dim)

    def _eviction(self, keep: int, sinks: int, window: int, l: int) -> Eviction | None:
        if sinks + window + keep >= l:   # nothing would be evicted: no scoring, no index
            return None
        e = self.d.eviction
        return Eviction(keep_tokens=keep, window=window, pool_kernel=e.pool_kernel, scorer=e.scorer,
                        gqa_mode=e.gqa_mode, sink_tokens=sinks, span_tokens=e.span_tokens, kvcrush=self.d.kvcrush)


def merge_pairs(start: int | None, m: int) -> dict[int, int]:
    """{upper: lower} of MiniCache's disjoint adjacent pairs (s, s+1), (s+2, s+3), ... below m;
    s = m // 2 by default."""
    s = m // 2 if start is None else start
    return {i + 1: i for i in range(s, m - 1, 2)}


def _gated(pairs: dict[int, int], mg, inp: PlanInput) -> dict[int, int]:
    """The pairs whose layers the probe finds alike enough to merge (`min_cos`; None: all)."""
    if mg.min_cos is None or not pairs:
        return pairs
    if inp.probe is None:
        raise InvalidRequest("token_ids", f"strategy {inp.strategy} probes the prompt to choose merged pairs: "
                                          "send token_ids")
    stats = inp.probe()
    cap = math.acos(mg.min_cos) / math.pi                    # the probe's angles are arccos(cos)/π
    return {u: lo for u, lo in pairs.items() if max(stats.k_angle[lo], stats.v_angle[lo]) <= cap}


def merged_share(mg, w: int) -> float:
    """A merged pair's bytes per layer against one dense layer, w = H_kv·D elements per row: per
    K/V one unit direction + two fp16 magnitudes per token, each retained token's rows of both
    layers + an int32 index; half of it to each layer."""
    gamma = (mg.retention_k + mg.retention_v) / 2
    return (1 + 2 / w + gamma * (2 + 2 / w)) / 2


def _held(lp: LayerPlan, l: int, lay: Layout) -> float:
    """Tokens' worth of dense fp16 K/V rows an unmerged layer is predicted to hold (l = full): a
    quant layer's rows a page per group (`kvcore.blocks.quant_shape`: g rows in 16 rows' bytes);
    a codebook layer's pages of fields and of entries, at most an entry a row for K and for V
    (`kvcore.plan_cost.coded_pages`), R rows' worth a page; an evicted layer's kept tokens."""
    ev = lp.eviction
    kept = min(l, ev.sink_tokens + ev.window + ev.keep_tokens) if ev else l
    if lp.quant:
        q = lp.quant
        return min(kept, q.residual) + max(0, kept - q.residual) * BLOCK_ROWS / quant_shape(q.bits)[0]
    if lp.codebook:
        return float(coded_pages(lay, kept, kept) * lay.rows)
    return kept


def _xkv(inp: PlanInput, r: float, sinks: int, window: int) -> Budgets:
    """XKV: the uniform allocation's total context budget (at the prompt's share r), split over
    layers by the probe's window scores (or the profile's shares). Floor 1 per layer where the
    total allows it."""
    l, m = inp.prompt_tokens, inp.model.num_layers
    l_c = max(0, l - sinks - window)
    total = int(uniform_keep_counts(r, l, sinks + window, m).sum())
    floor = 1 if total >= m else 0
    if inp.layer_shares is not None:
        return Budgets(apportion(total, np.asarray(inp.layer_shares), floor, l_c), sinks, window)
    if inp.probe is None:
        raise InvalidRequest("token_ids", f"strategy {inp.strategy} probes the prompt: send token_ids")
    stats = inp.probe()
    ws = np.asarray(stats.window_scores, dtype=np.float64)                                # [m, H_e, T]
    if ws.shape[0] != m:
        raise ValueError(f"the probe saw {ws.shape[0]} layers, the plan is for {m}")
    t = stats.tokens
    ctx = ws[:, :, sinks:max(sinks, t - window)][:, :, :l_c]                             # [m, H_e, T_c]
    alloc = xkv.allocate(list(ctx), total=total, floor=floor)
    mass = ctx.sum(-1).mean(-1)                                                           # [m] context share of attention
    retained = (1.0 - mass) + mass * alloc.retained                                       # [m] window + sinks always kept
    if inp.learn is not None and alloc.keep.sum() > 0:
        inp.learn(alloc.keep / alloc.keep.sum())
    return Budgets(alloc.keep, sinks, window, float(retained.mean()))


def apportion(total: int, shares: np.ndarray, floor: int, cap: int) -> np.ndarray:
    """`total` slots over layers in proportion to `shares` [m], at least `floor` and at most `cap`
    each: the floor first, the rest in proportion to each share's part above it (largest
    remainders, ties to the shallower layer), so the shares of an allocation of the same total
    give that allocation back.  -> [m] int64"""
    m = len(shares)
    base = np.full(m, min(floor, cap), dtype=np.int64)
    extra = max(0, total - int(base.sum()))
    w = np.clip(np.asarray(shares, dtype=np.float64), 0.0, None)
    w = np.clip(w / w.sum() * total - base, 0.0, None) if w.sum() > 0 else np.ones(m)
    raw = w / w.sum() * extra if w.sum() > 0 else np.full(m, extra / m)
    whole = np.floor(raw + 1e-9).astype(np.int64)
    order = np.lexsort((np.arange(m), -(raw - whole)))[: max(0, extra - int(whole.sum()))]
    whole[order] += 1
    return np.minimum(cap, base + whole)
