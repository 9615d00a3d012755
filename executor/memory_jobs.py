"""The in-process job backend (the embedded default): jobs live as long as the process, no
crash recovery. Waiting jobs queue per tenant and are claimed in the order the fairness policy
gives (`executor.fairness`), as the Redis backend's are."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from executor.fairness import FairQueue, Waiting
from executor.job_backend import Claim, Limits, QueueFull, check_bounds


@dataclass
class _Record:
    request: bytes
    status: bytes
    tenant: str = ""
    cost: int = 1
    seq: int = 0                     # arrival order: the tenants' heads are offered in it
    events: list[bytes] = field(default_factory=list)
    cancelled: bool = False
    expires: float | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)   # its followers wait on it


class MemoryJobs:
    """In-process backend: jobs live as long as the process (no crash recovery)."""

    def __init__(self, weight: Callable[[str], float] | None = None):
        """weight(tenant): the tenant's share in fair claiming (default 1 each)."""
        self._jobs: dict[str, _Record] = {}
        self._waiting: dict[str, deque[str]] = {}               # tenant -> its waiting job ids, oldest first
        self._submitted: asyncio.Event | None = None
        self.fair = FairQueue(weight)
        self._entries = itertools.count(1)
        self._queued: Counter[str] = Counter()                  # tenant -> jobs waiting or running
        self._window: tuple[int, Counter[str]] = (0, Counter())  # (minute, submissions per tenant)

    async def open(self) -> None:
        self._submitted = asyncio.Event()

    async def close(self) -> None:
        pass

    async def ping(self) -> bool:
        return True

    async def depth(self) -> int:
        return sum(self._queued.values())

    async def submit(self, job_id: str, request: bytes, status: bytes, tenant: str = "",
                     limits: Limits = Limits(), cost: int = 1) -> None:
        if job_id in self._jobs:
            return
        check_bounds(sum(self._queued.values()), self._queued[tenant], tenant, limits)
        self._jobs[job_id] = _Record(request, status, tenant, max(1, cost), next(self._entries))
        self._queued[tenant] += 1
        self._waiting.setdefault(tenant, deque()).append(job_id)
        self._submitted.set()

    async def room(self, tenant: str, limits: Limits) -> None:
        check_bounds(sum(self._queued.values()), self._queued[tenant], tenant, limits)

    async def admit(self, tenant: str, limits: Limits) -> None:
        if not limits.rate_per_min:
            return
        minute = int(time.time() // 60)
        if self._window[0] != minute:
            self._window = (minute, Counter())
        self._window[1][tenant] += 1
        if self._window[1][tenant] > limits.rate_per_min:
            raise QueueFull(f"tenant {tenant!r} is over its rate of {limits.rate_per_min} jobs a minute",
                            60 - time.time() % 60)

    async def tenant(self, job_id: str) -> str | None:
        rec = self._jobs.get(job_id)
        return rec.tenant if rec else None

    async def claim(self, consumer: str, block_ms: int, exclude: frozenset[str] = frozenset()) -> Claim | None:
        deadline = time.monotonic() + block_ms / 1000
        while True:
            heads = sorted((Waiting(ids[0], tenant, self._jobs[ids[0]].cost) for tenant, ids in self._waiting.items()
                            if ids and tenant not in exclude), key=lambda w: self._jobs[w.key].seq)
            pick = self.fair.pick(heads)
            if pick is not None:
                queue = self._waiting[pick.tenant]
                queue.popleft()
                if not queue:
                    del self._waiting[pick.tenant]
                return Claim(pick.key, str(next(self._entries)), 1, pick.tenant)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._submitted.clear()
            try:
                await asyncio.wait_for(self._submitted.wait(), left)
            except asyncio.TimeoutError:
                return None

    async def heartbeat(self, claim: Claim, consumer: str) -> bool:
        return True

    async def finish(self, claim: Claim, ttl_s: int) -> None:
        rec = self._jobs[claim.job_id]
        if rec.expires is None:                  # once per job: its queue count drops
            self._queued[rec.tenant] -= 1
        rec.expires = time.time() + ttl_s
        self._expire()

    def _expire(self) -> None:
        now = time.time()
        for job_id in [j for j, r in self._jobs.items() if r.expires is not None and r.expires < now]:
            del self._jobs[job_id]

    async def request(self, job_id: str) -> bytes | None:
        rec = self._jobs.get(job_id)
        return rec.request if rec else None

    async def set_status(self, job_id: str, status: bytes) -> None:
        self._jobs[job_id].status = status

    async def status(self, job_id: str) -> bytes | None:
        rec = self._jobs.get(job_id)
        return rec.status if rec else None

    async def append_event(self, job_id: str, event: bytes) -> None:
        """Wakes this job's followers only: a token of one job never wakes the streams of the others."""
        rec = self._jobs[job_id]
        rec.events.append(event)
        async with rec.changed:
            rec.changed.notify_all()

    async def events(self, job_id: str, after: str, block_ms: int) -> list[tuple[str, bytes]]:
        start = int(after)
        rec = self._jobs.get(job_id)
        if rec is None:
            return []
        if len(rec.events) <= start:                   # nothing new yet: wait for this job's next event
            async with rec.changed:
                try:
                    await asyncio.wait_for(rec.changed.wait_for(lambda: len(rec.events) > start), block_ms / 1000)
                except asyncio.TimeoutError:
                    return []
        return [(str(i + 1), e) for i, e in enumerate(rec.events[start:], start)]

    async def cancel(self, job_id: str) -> None:
        self._jobs[job_id].cancelled = True

    async def is_cancelled(self, job_id: str) -> bool:
        rec = self._jobs.get(job_id)
        return rec is not None and rec.cancelled
