"""The Strategy type: a named, versioned plan function. A leaf module, so the planners that build
strategies (`planner.auto`, `planner.compose`) and the registry that holds them
(`planner.strategies`) import it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvcore.plan import CompressionPlan
from planner.definition import Definition
from planner.request import PlanInput


@dataclass(frozen=True)
class Strategy:
    name: str
    version: str
    description: str
    plan: Callable[[PlanInput, str], CompressionPlan]   # (input, plan_id) -> plan
    probe_mode: str | None = None                       # GQA mode of the probe it calls; None: it never probes
    definition: Definition | None = None
    probe_losses: bool = False                          # it asks the probe for storage-form losses
