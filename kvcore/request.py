"""Request checks planner and executor both make: the error that names the field at fault, and
a `kvplan.v1.Budget` read into (reserve_ratio, kv_tokens)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input; `field` names the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_budget(budget, field: str = "budget") -> tuple[float | None, int | None]:
    """(reserve_ratio, kv_tokens) from a `kvplan.v1.Budget`; unset means reserve_ratio 1.0, and so
    does adaptive (its fields checked; the planner lowers the ratio for the load: `adaptive_of`)."""
    kind = budget.WhichOneof("kind")
    if kind == "adaptive":
        adaptive_of(budget, field)
        return 1.0, None
    if kind == "kv_tokens":
        if budget.kv_tokens < 1:
            raise InvalidRequest(f"{field}.kv_tokens", f"must be >= 1, got {budget.kv_tokens}")
        return None, int(budget.kv_tokens)
    if kind == "reserve_ratio":
        r = budget.reserve_ratio
        if not 0.0 < r <= 1.0:
            raise InvalidRequest(f"{field}.reserve_ratio", f"must be in (0, 1], got {r:g}")
        return float(r), None
    return 1.0, None


def adaptive_of(budget, field: str = "budget") -> tuple[float, float] | None:
    """(floor_ratio, min_retained) of an adaptive `kvplan.v1.Budget` (0: not set); None when the
    budget is not adaptive."""
    if budget.WhichOneof("kind") != "adaptive":
        return None
    a = budget.adaptive
    for name in ("floor_ratio", "min_retained"):
        x = getattr(a, name)
        if not 0.0 <= x <= 1.0:                  # NaN fails too
            raise InvalidRequest(f"{field}.adaptive.{name}", f"must be in [0, 1], got {x:g}")
    return float(a.floor_ratio), float(a.min_retained)
