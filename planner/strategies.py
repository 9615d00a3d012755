"""The strategy registry: a plain dict of named, versioned plan functions.

A strategy is `(PlanInput) -> CompressionPlan`. Later issues add eviction, codebook, merge and
offload strategies; the service only ever looks names up here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvplan.plan import CompressionPlan, full_plan
from planner.request import PlanInput


@dataclass(frozen=True)
class Strategy:
    name: str
    version: str
    description: str
    plan: Callable[[PlanInput, str], CompressionPlan]   # (input, plan_id) -> plan


def _full(inp: PlanInput, plan_id: str) -> CompressionPlan:
    return full_plan(inp.model.num_layers, plan_id, strategy="full", fingerprint=inp.model.fingerprint)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in [
        Strategy("full", "1", "uncompressed KV in every layer (the reference)", _full),
    ]
}
