"""The strategy a job runs when it names none, as planner and executor both read it: the active
default, except that a budget asking to compress while the default is `full` (which never
compresses) (or an adaptive one) gets `auto` — so `--ratio 0.2` alone is never silently a full cache."""
from __future__ import annotations


def strategy_for(named: str, active: str, reserve_ratio: float | None, kv_tokens: int | None,
                 adaptive: bool = False) -> str:
    if named:
        return named
    compresses = adaptive or kv_tokens is not None or (reserve_ratio is not None and reserve_ratio < 1.0)
    return "auto" if active == "full" and compresses else active
