"""The job backend's interface and the types both backends share: a claim, admission bounds
and their refusals. The backends (`executor.memory_jobs`, `executor.redis_jobs`) import this
module; `executor.jobqueue` opens one of them from a URL.

Jobs wait per tenant and are claimed fairly across tenants (`executor.fairness`: deficit round
robin by tokens, weighted per tenant). A record holds the request, the latest `JobStatus`, an ordered event log (serialized
`JobEvent`s, replayed by WatchJob), a cancel flag and the job's tenant. All payloads are
protobuf bytes. Admission is bounded (`Limits`): jobs waiting or running, all together and per
tenant, and submissions per tenant per minute; a refusal is `QueueFull` with a retry-after.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
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
                     limits: Limits = Limits(), cost: int = 1) -> None:
        """Queue a job (idempotent per job_id); QueueFull when a bound refuses it. `cost`: its
        tokens (prompt + max new tokens), what fair claiming counts (`executor.fairness`)."""
    async def room(self, tenant: str, limits: Limits) -> None:
        """QueueFull if one more job of `tenant` would pass a bound now: a cheap look before a
        submission's work (tokenizing), so a tenant over its quota costs little (`submit` checks
        again when it writes)."""
    async def admit(self, tenant: str, limits: Limits) -> None:
        """Count one submission of `tenant` against its rate; QueueFull past it."""
    async def tenant(self, job_id: str) -> str | None: ...
    async def claim(self, consumer: str, block_ms: int, exclude: frozenset[str] = frozenset()) -> Claim | None:
        """A job to run: a dead executor's first, else the waiting job fair claiming picks across
        the tenants not in `exclude` (those holding their share of the caller's slots); None
        after block_ms without one."""
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


def check_bounds(queued: int, mine: int, tenant: str, limits: Limits) -> None:
    """QueueFull when one more job of `tenant` would pass a bound (`queued` jobs in all, `mine` its)."""
    if limits.max_queued and queued >= limits.max_queued:
        raise QueueFull(f"the queue is full ({queued} jobs waiting or running, at most {limits.max_queued})",
                        QUEUE_FULL_RETRY_S)
    if limits.max_per_tenant and mine >= limits.max_per_tenant:
        raise QueueFull(f"tenant {tenant!r} has {mine} jobs waiting or running, at most {limits.max_per_tenant}",
                        QUEUE_FULL_RETRY_S)
