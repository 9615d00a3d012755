"""The job queue and job records, behind one interface with two backends: in process (the
embedded default) and Redis Streams (`executor/redis_jobs.py`), chosen from a URL.

A record holds the request, the latest `JobStatus`, an ordered event log (serialized
`JobEvent`s, replayed by WatchJob) and a cancel flag. All payloads are protobuf bytes.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Claim:
    job_id: str
    entry_id: str       # the queue entry, acked when the job ends
    attempt: int        # 1 for the first executor to claim it


class JobBackend(Protocol):
    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def submit(self, job_id: str, request: bytes, status: bytes) -> None: ...
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

    async def open(self) -> None:
        self._pending = asyncio.Queue()
        self._changed = asyncio.Condition()

    async def close(self) -> None:
        pass

    async def submit(self, job_id: str, request: bytes, status: bytes) -> None:
        self._jobs[job_id] = _Record(request, status)
        await self._pending.put(job_id)

    async def claim(self, consumer: str, block_ms: int) -> Claim | None:
        try:
            job_id = await asyncio.wait_for(self._pending.get(), block_ms / 1000)
        except asyncio.TimeoutError:
            return None
        return Claim(job_id, str(next(self._entries)), 1)

    async def heartbeat(self, claim: Claim, consumer: str) -> bool:
        return True

    async def finish(self, claim: Claim, ttl_s: int) -> None:
        self._jobs[claim.job_id].expires = time.time() + ttl_s
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


def open_backend(redis_url: str, group: str = "executors", claim_idle_ms: int = 15000):
    if not redis_url:
        return MemoryJobs()
    from executor.redis_jobs import RedisJobs
    return RedisJobs(redis_url, group=group, claim_idle_ms=claim_idle_ms)
