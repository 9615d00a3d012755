"""`auto`: the plan that fits the budget with the least predicted loss, layer by layer.

From one probe of the prompt (`planner.probe`, with losses) every layer gets a table of storage
forms — keep a share f of its context tokens per KV head (SnapKV selection with copy span;
sinks and window always kept) × store them at b bits (16 = the storage dtype, else KIVI
quantization) — each with its bytes and its predicted relative error of the attention output
(eviction error + quantization error, both measured on the layer's own last queries). The
forms are then chosen jointly: the set of one form per layer whose bytes fit the budget and
whose summed loss is least (`planner.choice`, exact).

Left out for now, with the reason: codebooks (where a codebook loses more than eviction for
the same bytes the codebook layer falls back to eviction itself, and on this model it mostly
does) and MiniCache merging (this model's adjacent layers are far less alike than the paper's,
so merging loses the answers). The measurements: docs/benchmarks.md, "What auto leaves out".

Every plan says what it expects to keep: `predicted_retained_attention` is the mean over
layers of the window attention mass the kept tokens hold, so a client sees a budget that is
too tight before running it."""
from __future__ import annotations

import numpy as np

from kvcore.blocks import BLOCK_ROWS, Layout, quant_shape
from kvcore.cost import dense_row_bytes
from kvcore.plan import CompressionPlan, Eviction, LayerPlan, Quant, full_plan
from planner.budget import fits_full, step_rows
from planner.choice import choose
from kvcore.statistics import POOL, SINKS, SPAN
from kvcore.request import InvalidRequest
from planner.request import PlanInput
from planner.strategy import Strategy

RESIDUAL = 16          # newest tokens a quant layer keeps dense: with a 4-bit page of 48 rows its tail holds
                       # 16-63 rows, the most it held with groups of 32 and 32 kept (KIVI keeps a residual)
# The storage dtype's itemsize (fp16). A plan request does not say the executor's storage dtype
# (only an adaptive budget's load does), so plans price the default's.
STORAGE_BYTES = 2


def lifetime_bytes(kept: float, bits: int, head_dim: int, added: np.ndarray) -> np.ndarray:
    """Bytes one KV head holds after each step of the job (`planner.budget`: the budget holds
    between steps, as it is measured), as the executor's pool stores it (`kvcore.blocks`): its
    `kept` prompt tokens plus the rows added so far, in whole dense pages, or (a quant layer) in
    KIVI groups of a page each (`kvcore.blocks.quant_shape`) with at least RESIDUAL newest rows dense. (Within a step a quant
    layer briefly holds a new group beside the rows it came from; the executor reserves that
    too: `kvcore.plan_cost`.) added: [S + 1] rows added after each step (0 first) -> [S + 1]."""
    lay = Layout(head_dim, STORAGE_BYTES)
    rows = int(kept) + added.astype(np.int64)
    if bits == 16:
        return lay.dense_stream_bytes(rows).astype(np.float64)
    return lay.quant_stream_held(rows, bits, RESIDUAL).astype(np.float64)


def strategy(d):
    """The Strategy of an `auto` definition (`planner.strategies.PLANNERS["auto"]`): probes in
    GQA `repeat` mode (the losses use each KV group's mean)."""
    return Strategy(d.name, d.version or "1", d.description, plan, probe_mode="repeat", definition=d, probe_losses=True)


def plan(inp: PlanInput, plan_id: str) -> CompressionPlan:
    m, hk, d = inp.model.num_layers, inp.model.num_kv_heads, inp.model.head_dim
    l, r = inp.prompt_tokens, inp.target_ratio
    if l == 0 or fits_full(inp, BLOCK_ROWS):
        return full_plan(m, plan_id, strategy=inp.strategy, fingerprint=inp.model.fingerprint, budget_met=True,
                         prompt_tokens=l)
    if inp.probe is None:
        raise InvalidRequest("token_ids", f"strategy {inp.strategy!r} probes the prompt: send token_ids")
    stats = inp.probe(losses=True)
    lo = stats.losses
    window = min(stats.window, l)
    sinks = min(SINKS, l - window)
    n_ctx = l - window - sinks
    kept = sinks + window + np.rint(lo.fractions * n_ctx)                                   # [F] tokens per KV head
    options = [(fi, bi) for bi in range(len(lo.bits)) for fi in range(len(lo.fractions))]
    loss = np.array([[lo.evict[i, fi] + lo.quant[i, bi] for fi, bi in options] for i in range(m)])   # [m, O]
    # The budget holds at every step of the job: at step j the cache may hold r·(l + a_j) dense
    # rows per head (kv_tokens N: N rows), so an option costs its bytes at its worst step less
    # what the rows added by then bring (summing each layer's worst step is an upper bound).
    added, _ = step_rows(inp)                                                                # [S + 1]
    row = dense_row_bytes(d, STORAGE_BYTES)
    rate, base = (r, r * l) if inp.reserve_ratio is not None else (0.0, float(inp.kv_tokens))
    by_step = np.stack([hk * lifetime_bytes(kept[fi], int(lo.bits[bi]), d, added)
                        for fi, bi in options])                                             # [O, S + 1]
    cost = np.array([(by_step - hk * rate * added * row).max(1)] * m)                       # [m, O]
    budget = m * hk * base * row
    got = choose(loss, cost, budget)
    layers, retained = [], []
    for i, o in enumerate(got.option):
        fi, bi = options[o]
        keep = int(kept[fi]) - sinks - window
        bits = int(lo.bits[bi])
        ev = None if keep >= n_ctx else Eviction(keep_tokens=keep, window=window, pool_kernel=POOL, scorer="snapkv",
                                                  gqa_mode="mean", sink_tokens=sinks, span_tokens=SPAN)
        layers.append(LayerPlan(layer=i, eviction=ev,
                                quant=None if bits == 16 else Quant(bits=bits, group_size=quant_shape(bits, d)[0],
                                                                         residual=RESIDUAL)))
        retained.append(lo.retained[i, fi])
    worst = (by_step[got.option].sum(0)
             / (m * hk * (l + added) * row)).max()                                          # the job's most, as a ratio
    return CompressionPlan(plan_id=plan_id, strategy=inp.strategy, layers=tuple(layers),
                           model_fingerprint=inp.model.fingerprint,
                           predicted_reserve_ratio=float(worst),
                           predicted_retained_attention=float(np.mean(retained)),
                           budget_met=bool(got.bytes <= budget * (1 + 1e-9)), budget_floor_tokens=sinks + window)
