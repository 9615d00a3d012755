"""An adaptive budget: the largest reserve ratio whose plan fits the job's fair share of the
executor's KV memory, never below the job's floor — full KV when memory is free, compressed only
as far as the load requires.

    share   = min(free bytes, budget / jobs sharing it)      (`KVLoad`: what the executor sent)
    ratio   = the first of RATIOS (1.0 down) whose plan's worst step (`kvcore.plan_cost`) fits
              the share                                      -> "fits" at 1.0, else "pressure"
    floor   = the lowest ratio at or above `floor_ratio` whose plan still predicts at least
              `min_retained` of the attention mass (a strategy that does not predict it: the
              floor ratio alone); a share below the floor's plan gets the floor -> "floor"

A share of budget / jobs is what lets every job present run at once; free bytes bound it when
earlier jobs hold more. Without a load (a plan asked outside an executor) nothing presses: 1.0."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from kvcore import plan_cost
from kvcore.plan import CompressionPlan
from planner.request import PlanInput

RATIOS = (1.0, 0.7, 0.5, 0.35, 0.25, 0.2, 0.15, 0.1, 0.07, 0.05)     # tried largest first


@dataclass(frozen=True)
class Load:
    budget_bytes: int
    free_bytes: int
    jobs: int             # this one included
    itemsize: int = 2
    chunk: int = 512

    @property
    def share(self) -> int:
        return min(self.free_bytes, self.budget_bytes // max(1, self.jobs))

    @classmethod
    def from_proto(cls, msg) -> "Load | None":
        """A `KVLoad` -> Load; None when the request carried none (budget_bytes 0)."""
        if msg.budget_bytes <= 0:
            return None
        return cls(int(msg.budget_bytes), max(0, int(msg.free_bytes)), max(1, int(msg.jobs)), int(msg.itemsize) or 2,
                   int(msg.chunk) or 512)


def plan(plan_at: Callable[[float], CompressionPlan], inp: PlanInput, load: Load | None, floor_ratio: float,
         min_retained: float) -> CompressionPlan:
    """plan_at(ratio): the job's strategy planned at that reserve ratio. -> the chosen plan, its
    `budget_ratio` and `budget_reason` set."""
    floor = None                                     # (plan, ratio): the lowest acceptable so far; 1.0 always is
    for r in RATIOS:                                 # (floor_ratio <= 1: `kvcore.request.adaptive_of`)
        if r < floor_ratio - 1e-9:
            break
        p = plan_at(r)
        if r < 1.0 and p.predicted_retained_attention < min_retained:
            break
        if load is None or kv_bytes(p, inp, load) <= load.share:
            return dataclasses.replace(p, budget_ratio=r, budget_reason="fits" if r == 1.0 else "pressure")
        floor = (p, r)
    return dataclasses.replace(floor[0], budget_ratio=floor[1], budget_reason="floor")


def kv_bytes(p: CompressionPlan, inp: PlanInput, load: Load) -> int:
    """The plan's worst step over the job, in the executor's storage dtype and chunks."""
    m = inp.model
    return plan_cost.plan_bytes(p, m.num_kv_heads, m.num_query_heads, m.head_dim, inp.prompt_tokens,
                                inp.suffix_tokens, inp.new_tokens, load.itemsize, load.chunk)
