"""A budget a job's plan cannot hold is refused, with what would fit.

A reserve ratio (or `kv_tokens`) bounds the cache at every step of the job, so each generated
token's row — kept whole — comes out of the same budget as the prompt's kept tokens
(`planner.budget`). A budget too small for a strategy's floor (the sinks and window it always
keeps, or the whole prompt for `full`) once those rows are paid for made a plan that ran
anyway and answered garbage; now the job is refused before it runs (INVALID_ARGUMENT naming the
budget's field), saying what the budget leaves the prompt, the least ratio (or token budget)
this strategy holds on this job, and how many new tokens the asked budget would hold.

    usable(plan, inp)   the plan holds the budget (`budget_met`), and a plan that quantizes
                        (whose bytes can fit while its rows cannot: quantized rows cost less)
                        is left at least its floor in dense rows per KV head
    refusal(...)        the InvalidRequest that says so, with the fits found by bisection over
                        the strategy's own plans (a plan costs milliseconds once probed)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from kvcore.blocks import BLOCK_ROWS
from kvcore.plan import CompressionPlan
from planner.budget import context_tokens
from kvcore.request import InvalidRequest
from planner.request import PlanInput

RATIO_STEP = 100          # the fitting ratio is found in hundredths


def room(inp: PlanInput) -> float:
    """Dense rows per KV head (layer average) the budget leaves the prompt once every row the job
    adds is paid for, stored in the pool's whole blocks."""
    return context_tokens(inp, 1.0, BLOCK_ROWS)


def usable(plan: CompressionPlan, inp: PlanInput) -> bool:
    if plan.budget_met is False:
        return False
    quantizes = any(lp.quant is not None for lp in plan.layers)
    return not quantizes or room(inp) >= min(plan.budget_floor_tokens, inp.prompt_tokens)


def _least(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The least n in [lo, hi] with ok(n), ok monotone (False then True); None: not even hi."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def refusal(plan_at: Callable[[PlanInput], CompressionPlan], inp: PlanInput, plan: CompressionPlan,
            note: str = "") -> InvalidRequest:
    """Why `plan` (of `inp`'s explicit budget) cannot serve the job, and what would; `note`: a
    cause the strategy knows (`planner.precheck.note`), after the why."""
    l, new = inp.prompt_tokens, inp.new_tokens
    by_ratio = inp.reserve_ratio is not None
    field = "budget.reserve_ratio" if by_ratio else "budget.kv_tokens"
    asked = f"reserve ratio {inp.reserve_ratio:g}" if by_ratio else f"kv_tokens {inp.kv_tokens}"
    floor = min(plan.budget_floor_tokens, l)
    left = max(0, int(room(inp)))
    added = f" + {inp.suffix_tokens} after it" if inp.suffix_tokens else ""
    paid = (f"once the rows the job adds — kept whole, in blocks of {BLOCK_ROWS} — are paid for"
            if new or inp.suffix_tokens else f"in blocks of {BLOCK_ROWS} rows")
    why = (f"{inp.strategy} cannot hold {asked} on this job ({l} prompt tokens{added}, {new} new tokens): "
           f"the budget leaves the prompt {left} tokens per KV head {paid}, and {inp.strategy} keeps at least {floor}"
           + note)
    def ok(**change) -> bool:
        other = dataclasses.replace(inp, **change)
        return usable(plan_at(other), other)

    fits = []
    if by_ratio:
        r = _least(lambda n: ok(reserve_ratio=n / RATIO_STEP), 1, RATIO_STEP)
        if r is not None:
            fits.append(f"reserve ratio {r / RATIO_STEP:g} fits")
    else:
        n = _least(lambda k: ok(kv_tokens=k), inp.kv_tokens, l + inp.suffix_tokens + new + BLOCK_ROWS)
        if n is not None:
            fits.append(f"kv_tokens {n} fits")
    if new:
        most = _least(lambda k: not ok(new_tokens=k), 0, new)
        if most:                                   # the first count that does not fit, less one
            fits.append(f"at most {most - 1} new tokens fit {asked}")
    return InvalidRequest(field, why + ("; " + ", or ".join(fits) if fits else ""))
