"""Fair admission across tenants: deficit round robin by tokens (Shreedhar & Varghese's DRR), with a
weight per tenant. A pure policy: no I/O, no clock; the caller says what waits, it says what goes
next.

Used where the executor claims jobs from the queue (`executor.redis_jobs`, `executor.memory_jobs`:
the head job of each tenant's waiting list) and where the engine admits waiting sequences
(`executor.engine.scheduler`, with `peek` and `unpick`). The interface, for both:

    fair = FairQueue(weight=lambda tenant: 1.0, quantum=256)
    item = fair.pick([Waiting(key, tenant, cost), ...])     # -> one of them, or None if empty

- `waiting` lists what waits now, in arrival order; a tenant's items are served in the order they
  appear (FIFO within a tenant), so passing only each tenant's first item is enough.
- `cost` is the item's size in tokens (prompt + max new tokens): a tenant of long jobs gets fewer
  jobs, not more tokens.
- `weight(tenant)` > 0 scales a tenant's share (the keys file's `weight`, default 1): over a
  backlog, tokens served per tenant are proportional to their weights.
- Call `pick` once per item you admit, with what waits at that moment; the object keeps each
  tenant's deficit (tokens it may still take this turn) and whose turn it is. A tenant absent
  from `waiting` leaves the round and loses its deficit (an idle tenant banks nothing), and one
  that arrives joins the round at its end: it waits at most one turn of every other tenant,
  whatever their backlog.

One `FairQueue` per admission point (each executor has its own): fairness is per executor, and
across executors approximately so.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable, Sequence

DEFAULT_QUANTUM = 256       # tokens a tenant of weight 1 may take per turn


@dataclass(frozen=True)
class Waiting:
    key: str                # the caller's handle: a job id, a sequence id
    tenant: str
    cost: int               # tokens: prompt + max new tokens (>= 1 counts; smaller is taken as 1)


class FairQueue:
    def __init__(self, weight: Callable[[str], float] | None = None, quantum: int = DEFAULT_QUANTUM):
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        self.weight = weight or (lambda tenant: 1.0)
        self.quantum = quantum
        self._ring: collections.deque[str] = collections.deque()   # ring[0]: whose turn it is
        self._deficit: dict[str, float] = {}
        self._in_turn = False                                        # ring[0] got its quantum this turn

    def pick(self, waiting: Sequence[Waiting]) -> Waiting | None:
        """The item to admit next (see the module's docstring), or None when nothing waits."""
        heads: dict[str, Waiting] = {}
        for item in waiting:
            heads.setdefault(item.tenant, item)
        self._sync(heads)
        if not heads:
            return None
        passes = 0
        while True:
            tenant = self._ring[0]
            if not self._in_turn:
                self._deficit[tenant] += self._quantum(tenant)
                self._in_turn = True
            item = heads[tenant]
            cost = max(1, item.cost)
            if cost <= self._deficit[tenant]:
                self._deficit[tenant] -= cost
                return item
            self._ring.rotate(-1)                   # its turn ends; the deficit carries over
            self._in_turn = False
            passes += 1
            if passes == len(self._ring):           # a whole round admitted nothing: skip the
                self._skip_rounds(heads)            # rounds in which nobody could pay, at once
                passes = 0

    def peek(self, waiting: Sequence[Waiting]) -> Waiting | None:
        """What `pick` would give now, leaving every deficit and turn as it was."""
        saved = (collections.deque(self._ring), dict(self._deficit), self._in_turn)
        try:
            return self.pick(waiting)
        finally:
            self._ring, self._deficit, self._in_turn = saved

    def unpick(self, item: Waiting) -> None:
        """`item`, picked, was not admitted after all (it did not fit): its tenant gets its tokens back
        and keeps its turn, so the next `pick` offers it again."""
        if item.tenant in self._deficit:
            self._deficit[item.tenant] += max(1, item.cost)

    def deficits(self) -> dict[str, float]:
        """Each waiting tenant's deficit (tokens), for logs and tests."""
        return dict(self._deficit)

    def _quantum(self, tenant: str) -> float:
        w = float(self.weight(tenant))
        if not w > 0 or math.isinf(w):
            raise ValueError(f"tenant {tenant!r}: weight must be a finite number > 0, got {w}")
        return self.quantum * w

    def _sync(self, heads: dict[str, Waiting]) -> None:
        """Tenants with nothing waiting leave the round (their deficit goes); new ones join at its end."""
        if self._ring and self._ring[0] not in heads:
            self._in_turn = False
        for tenant in [t for t in self._ring if t not in heads]:
            self._ring.remove(tenant)
            del self._deficit[tenant]
        for tenant in heads:
            if tenant not in self._deficit:
                self._ring.append(tenant)
                self._deficit[tenant] = 0.0

    def _skip_rounds(self, heads: dict[str, Waiting]) -> None:
        """Add the quanta of the k - 1 rounds in which no tenant could pay for its head, where k is
        the fewest more quanta any tenant needs; the next round admits someone."""
        k = min(math.ceil((max(1, heads[t].cost) - self._deficit[t]) / self._quantum(t)) for t in self._ring)
        if k > 1:
            for t in self._ring:
                self._deficit[t] += (k - 1) * self._quantum(t)
