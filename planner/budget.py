"""A job's budget over its whole life: the reserve ratio (or `kv_tokens`) bounds what the cache
holds after the prompt and at every later token, so the rows a job adds after its compressed
prompt come out of the same budget as the prompt's kept tokens. Those rows — a query_agnostic
question prefilled in one step, then one row per generated token — are stored dense, in stores
that grow ROW_CHUNK rows at a time (`kvcore.cost.held_after`: spare rows are held
and counted), so the prompt gets what is left at the worst step:

    ratio r:     kept <= r·l + min_j (r·a_j − c·h_j)
    kv_tokens N: kept <= N − c·max_j h_j

over the steps j (a_j rows added so far, h_j rows held for them; a_0 = h_0 = 0), with c the
bytes of one added row against a dense fp16 K+V row (`row_cost`). A job that adds nothing
keeps r·l, as before; measured at any token, the job holds at most r of the full cache of
its tokens.

Layers the executor's pool holds (`kvcore.blocks`) store kept and added rows alike in whole
blocks of `block` rows: a stream holds at most block - 1 rows more than it has, so there
h_j = a_j + block - 1 (h_0 = block - 1: the kept rows' last block)."""
from __future__ import annotations

import math

import numpy as np

from kvcore.cost import held_after
from planner.request import PlanInput


CODED_ROW_BYTES = 12   # a codebook layer's added row at worst, past its dense bytes: K and V each a new
                       # entry (their dense size) + an int16 index + an fp16 magnitude, + the key's int32 position


def row_cost(head_dim: int, mask_bytes: int = 0, coded_bytes: int = 0) -> float:
    """One added row's bytes per KV group against a dense fp16 K+V row (4·D bytes): a `repeat`
    layer adds a mask byte per query head of the group, a codebook layer up to an index, a
    magnitude and a position more (when the row extends its codebook)."""
    return 1.0 + (mask_bytes + coded_bytes) / (4 * head_dim)


def added_steps(inp: PlanInput) -> list[int]:
    """The rows each later step of the job adds: the question in one, then one per new token."""
    return ([inp.suffix_tokens] if inp.suffix_tokens > 0 else []) + [1] * inp.new_tokens


def fits_full(inp: PlanInput, block: int = 0) -> bool:
    """Whether the uncompressed cache stays within the job's budget at every step: a reserve
    ratio of 1, or kv_tokens N at least the prompt plus the rows held for what the job adds (a
    dense store grows ROW_CHUNK rows at a time: `kvcore.cost`; pooled, whole blocks)."""
    if inp.reserve_ratio is not None:
        return inp.reserve_ratio >= 1.0
    if block:                                          # the whole prompt and every added row, in whole blocks
        added, _ = step_rows(inp)
        return inp.kv_tokens >= (np.ceil((inp.prompt_tokens + added) / block) * block).max()
    return inp.kv_tokens >= inp.prompt_tokens + max(held_after(added_steps(inp)), default=0)


def context_ratio(inp: PlanInput, cost: float = 1.0, block: int = 0) -> float:
    """The share of the prompt's tokens a plan may keep per stored head (layer average), in whole
    tokens: the job's own ratio when it adds nothing after the prompt (and its rows are not
    pooled)."""
    if not added_steps(inp) and not block:
        return inp.target_ratio
    return math.floor(context_tokens(inp, cost, block) + 1e-9) / max(1, inp.prompt_tokens)


def step_rows(inp: PlanInput, block: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """-> (added, held), each [S + 1]: the rows the job has added after each step and the rows
    its stores hold for them past the kept ones (dense stores: `held_after`, 0 before the first
    step; pooled in blocks of `block` rows: added + block - 1)."""
    steps = added_steps(inp)
    added = np.cumsum([0, *steps], dtype=np.float64)
    if block:
        return added, added + (block - 1)
    return added, np.array([0, *held_after(steps)], dtype=np.float64)


def context_tokens(inp: PlanInput, cost: float = 1.0, block: int = 0) -> float:
    """Prompt tokens per stored head (layer average) the plan may keep; at most the prompt."""
    added, held = step_rows(inp, block)                               # [S + 1] each
    held = cost * held
    l = inp.prompt_tokens
    if inp.reserve_ratio is not None:
        r = inp.reserve_ratio
        return float(np.clip(r * l + np.min(r * added - held), 0.0, l))
    return float(np.clip(inp.kv_tokens - held.max(), 0.0, l))


def holds(held_share: float, inp: PlanInput, cost: float = 1.0, block: int = 0) -> bool:
    """Whether a plan whose prompt part holds `held_share` of the prompt's full cache (dense fp16
    rows per stored head, layer average) stays within the job's budget at every step: at most
    what the budget leaves the prompt once the rows the job adds are paid for (`context_ratio`).
    A plan that cannot (an eviction window and sinks above the budget of a short prompt) is
    still run; it says so in `CompressionPlan.budget_met`."""
    return held_share <= context_ratio(inp, cost, block) + 1e-9
