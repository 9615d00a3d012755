"""For tests that read this process's Prometheus metrics (the services run in process)."""
from __future__ import annotations

from prometheus_client import REGISTRY


def summed(name: str) -> float:
    """A counter's value (or a histogram's observation count) over all its label sets; 0 before any."""
    return sum(s.value for m in REGISTRY.collect() if m.name == name for s in m.samples
               if s.name in (name + "_total", name + "_count"))
