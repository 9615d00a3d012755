"""The strategy registry: named, versioned plan functions built from definitions (data).

A strategy is `(PlanInput, plan_id) -> CompressionPlan`; the service only ever looks names up
here (and in the custom definitions `SetStrategy` registered). A definition
(planner/definition.py) names its `kind`, a key of `PLANNERS`, whose function builds the
Strategy: `compose` lays the definition's parts over the layers (planner/compose.py). Another
planner registers itself with `PLANNERS[kind] = build_fn` in its own module; a preset of that
kind needs the module imported before `STRATEGIES` is built below.

The shipped strategies are the definitions in `presets.yaml`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from planner import auto, definition
from planner.compose import Composed
from planner.definition import Definition
from planner.strategy import Strategy

PRESETS_FILE = Path(__file__).with_name("presets.yaml")
__all__ = ["PLANNERS", "PRESETS", "STRATEGIES", "Strategy", "build", "composed", "parse"]


def composed(d: Definition) -> Strategy:
    c = Composed(d)
    return Strategy(d.name, d.version or "1", d.description, c.plan, probe_mode=c.probe_mode, definition=d)


# definition kind -> (definition) -> Strategy
PLANNERS: dict[str, Callable[[Definition], Strategy]] = {"compose": composed, "auto": auto.strategy}


def build(d: Definition) -> Strategy:
    return PLANNERS[d.kind](d)


def parse(text: str, field: str = "definition") -> Definition:
    """A definition from JSON or YAML text, validated (`DefinitionError` names the field)."""
    return definition.loads(text, PLANNERS, field)


PRESETS: tuple[Definition, ...] = definition.load_all(PRESETS_FILE, PLANNERS)
STRATEGIES: dict[str, Strategy] = {d.name: build(d) for d in PRESETS}
