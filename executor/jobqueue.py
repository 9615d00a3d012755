"""The job queue and job records, behind one interface with two backends: in process (the
embedded default) and Redis Streams (`executor/redis_jobs.py`), chosen from a URL.

A record holds the request, the latest `JobStatus`, an ordered event log (serialized
`JobEvent`s, replayed by WatchJob), a cancel flag and the job's tenant. All payloads are
protobuf bytes. Admission is bounded (`Limits`): jobs waiting or running, all together and per
tenant, and submissions per tenant per minute; a refusal is `QueueFull` with a retry-after.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Claim:
    job_id: str
    entry_id: str       # the queue entry, acked when the job ends
    attempt: int        # 1 for the first executor to claim it
    tenant: str = ""    # the job's tenant (its queue count drops when the job ends)


@dataclass(frozen=True)
class Limits:
    """Bounds on admission; 0: none."""
    max_queued: int = 0           # jobs waiting or running, all tenants together
    max_per_tenant: int = 0       # the same, per tenant
    rate_per_min: int = 0         # submissions per tenant per minute


class QueueFull(Exception):
    """A bound of `Limits` refuses the job (RESOURCE_EXHAUSTED); retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = max(1, int(retry_after_s))


class QueueUnavailable(Exception):
    """The queue's store (Redis) cannot be reached (UNAVAILABLE)."""


QUEUE_FULL_RETRY_S = 2       # a full queue's retry-after: about a short job's time
# How long a queue call of this task retries an unreachable store before QueueUnavailable; None:
# the backend's own patience (the worker's calls wait for Redis to come back; an RPC sets it short).
PATIENCE: contextvars.ContextVar[float | None] = contextvars.ContextVar("kvplan_queue_patience", default=None)


class JobBackend(Protocol):
    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def depth(self) -> int:
        """Jobs in the queue, waiting or running."""
    async def ping(self) -> bool:
        """Whether the store answers (restoring the consumer group if it was lost)."""
    async def submit(self, job_id: str, request: bytes, status: bytes, tenant: str = "",
                     limits: Limits = Limits()) -> None:
        """Queue a job (idempotent per job_id); QueueFull when a bound refuses it."""
    async def admit(self, tenant: str, limits: Limits) -> None:
        """Count one submission of `tenant` against its rate; QueueFull past it."""
    async def tenant(self, job_id: str) -> str | None: ...
    async def claim(self, consumer: str, block_ms: int) -> Claim | None: ...
    async def heartbeat(self, claim: Claim, consumer: str) -> bool:
        """Keep the claim alive; False when another executor has taken the job over."""
    async def finish(self, claim: Claim, ttl_s: int) -> None: ...
    async def request(self, job_id: str) -> bytes | None: ...
    async def set_status(self, job_id: str, status: bytes) -> None: ...
    async def status(self, job_id: str) -> bytes | None: ...
    async def append_event(self, job_id: str, event: bytes) -> None: ...
    async def events(self, job_id: str, after: str, block_ms: int) -> list[tuple[str, bytes]]:
        """Events after id `after` ("0" for all), waiting up to block_ms for the first."""
    async def cancel(self, job_id: str) -> None: ...
    async def is_cancelled(self, job_id: str) -> bool: ...


@dataclass
class _Record:
    request: bytes
    status: bytes
    tenant: str = ""
    events: list[bytes] = field(default_factory=list)
    cancelled: bool = False
    expires: float | None = None


class MemoryJobs:
    """In-process backend: jobs live as long as the process (no crash recovery)."""

    def __init__(self):
        self._jobs: dict[str, _Record] = {}
        self._pending: asyncio.Queue[str] | None = None
        self._changed: asyncio.Condition | None = None
        self._entries = itertools.count(1)
        self._queued: Counter[str] = Counter()                  # tenant -> jobs waiting or running
        self._window: tuple[int, Counter[str]] = (0, Counter())  # (minute, submissions per tenant)

    async def open(self) -> None:
        self._pending = asyncio.Queue()
        self._changed = asyncio.Condition()

    async def close(self) -> None:
        pass

    async def ping(self) -> bool:
        return True

    async def depth(self) -> int:
        return sum(self._queued.values())

    async def submit(self, job_id: str, request: bytes, status: bytes, tenant: str = "",
                     limits: Limits = Limits()) -> None:
        if job_id in self._jobs:
            return
        check_bounds(sum(self._queued.values()), self._queued[tenant], tenant, limits)
        self._jobs[job_id] = _Record(request, status, tenant)
        self._queued[tenant] += 1
        await self._pending.put(job_id)

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

    async def claim(self, consumer: str, block_ms: int) -> Claim | None:
        try:
            job_id = await asyncio.wait_for(self._pending.get(), block_ms / 1000)
        except asyncio.TimeoutError:
            return None
        rec = self._jobs.get(job_id)
        return Claim(job_id, str(next(self._entries)), 1, rec.tenant if rec else "")

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
        self._jobs[job_id].events.append(event)
        async with self._changed:
            self._changed.notify_all()

    async def events(self, job_id: str, after: str, block_ms: int) -> list[tuple[str, bytes]]:
        start = int(after)

        def ready():
            rec = self._jobs.get(job_id)
            return rec is None or len(rec.events) > start

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), block_ms / 1000)
            except asyncio.TimeoutError:
                return []
        rec = self._jobs.get(job_id)
        return [] if rec is None else [(str(i + 1), e) for i, e in enumerate(rec.events[start:], start)]

    async def cancel(self, job_id: str) -> None:
        self._jobs[job_id].cancelled = True

    async def is_cancelled(self, job_id: str) -> bool:
        rec = self._jobs.get(job_id)
        return rec is not None and rec.cancelled


def check_bounds(queued: int, mine: int, tenant: str, limits: Limits) -> None:
    """QueueFull when one more job of `tenant` would pass a bound (`queued` jobs in all, `mine` its)."""
    if limits.max_queued and queued >= limits.max_queued:
        raise QueueFull(f"the queue is full ({queued} jobs waiting or running, at most {limits.max_queued})",
                        QUEUE_FULL_RETRY_S)
    if limits.max_per_tenant and mine >= limits.max_per_tenant:
        raise QueueFull(f"tenant {tenant!r} has {mine} jobs waiting or running, at most {limits.max_per_tenant}",
                        QUEUE_FULL_RETRY_S)


def open_backend(redis_url: str, group: str = "executors", claim_idle_ms: int = 15000):
    if not redis_url:
        return MemoryJobs()
    from executor.redis_jobs import RedisJobs
    return RedisJobs(redis_url, group=group, claim_idle_ms=claim_idle_ms)
