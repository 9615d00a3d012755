"""Redis backend of the job queue: per-tenant wait lists drained fairly (`executor.fairness`) into a
Stream with a consumer group, so a job claimed by an executor that dies is re-claimed by another
(XAUTOCLAIM after `claim_idle_ms` of silence; a live executor refreshes its claim with XCLAIM on
every heartbeat). Keys and scripts: `executor.queue_scripts`. Finished jobs expire after the TTL.
Submitting (bounds checked with the write), taking a tenant's head job and finishing (the
tenant's count drops once) are Lua scripts, so each is atomic and safe to retry.

Connections are bounded: one pool of `max_connections` (a call waits up to `pool_timeout_s` for
a free one instead of failing), one connection of the event hub's (every watched job's event
stream is read by one blocking XREAD, `executor.event_hub`, not one per watcher), and one for
`ping`, so the health check never queues behind a busy pool.

Redis going away: every command retries with exponential backoff (tenacity) while Redis is
unreachable — for `PATIENCE` seconds (an RPC sets it short, then answers UNAVAILABLE via
`QueueUnavailable`), else for `patience_s` (the worker's calls: they wait for Redis to come
back, and the job goes on). A consumer group lost with a Redis that kept no data is made again
(`ping`, `claim`); `ping` is what the health check calls.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from executor import queue_scripts as q
from executor.event_hub import EventHub
from executor.fairness import FairQueue, Waiting
from executor.job_backend import (PATIENCE, QUEUE_FULL_RETRY_S, Claim, Limits, QueueFull, QueueUnavailable,
                                  check_bounds)
from kvcore.redis_pool import bounded

log = logging.getLogger("kvplan.executor.queue")
DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
PING_TIMEOUT_S = 3.0


class RedisJobs:
    def __init__(self, url: str, group: str = "executors", claim_idle_ms: int = 15000, patience_s: float = 3600.0,
                 max_connections: int = 16, pool_timeout_s: float = 5.0, weight: Callable[[str], float] | None = None):
        """weight(tenant): the tenant's share in fair claiming (default 1 each)."""
        self.url, self.group, self.claim_idle_ms, self.patience_s = url, group, claim_idle_ms, patience_s
        self.max_connections, self.pool_timeout_s = max_connections, pool_timeout_s
        self.fair = FairQueue(weight)
        self.r: aioredis.Redis | None = None
        self._probe: aioredis.Redis | None = None
        self.hub: EventHub | None = None
        self._seen = "0"                        # the last submission this claimer looked at

    def _client(self, max_connections: int, timeout_s: float) -> aioredis.Redis:
        # retries are ours (tenacity, below); socket_timeout outlasts the blocking reads (<= 2 s)
        return bounded(self.url, max_connections, timeout_s, socket_timeout=5, socket_connect_timeout=2,
                       retry=Retry(NoBackoff(), 0))

    async def open(self) -> None:
        """Connect; a Redis that is not up yet is not an error (`ping` makes the group later)."""
        self.r = self._client(self.max_connections, self.pool_timeout_s)
        self._probe = self._client(1, PING_TIMEOUT_S)
        self.hub = EventHub(lambda: self._client(1, PING_TIMEOUT_S), self.r, self._xrange)
        if not await self.ping():
            log.warning("Redis at %s is not reachable yet; the executor reports NOT_SERVING until it is", self._where)

    async def close(self) -> None:
        if self.hub is not None:
            await self.hub.close()
        for client in (self.r, self._probe):
            if client is not None:
                await client.aclose()

    @property
    def _where(self) -> str:
        return self.url.rsplit("@", 1)[-1]          # no password in logs

    async def _do(self, call):
        """`call()` (a coroutine factory), retried with backoff while Redis is unreachable."""
        limit = PATIENCE.get()
        retrying = AsyncRetrying(stop=stop_after_delay(self.patience_s if limit is None else limit),
                                 wait=wait_exponential(multiplier=0.05, max=2.0),
                                 retry=retry_if_exception_type(DOWN), reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    return await call()
        except DOWN as e:
            raise QueueUnavailable(f"the job queue (Redis at {self._where}) is unreachable: {e}") from None

    async def _ensure_group(self, client: aioredis.Redis) -> None:
        try:
            await client.xgroup_create(q.STREAM, self.group, id="0", mkstream=True)
            log.info("made consumer group %s on %s", self.group, q.STREAM)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def depth(self) -> int:
        async def count():
            running, waiting = await self.r.xlen(q.STREAM), await self.r.get(q.NWAITING)
            return running + int(waiting or 0)
        return await self._do(count)

    async def ping(self) -> bool:
        """Whether Redis answers, on a connection of its own (a busy pool is no outage); the
        consumer group is made again if a Redis restarted without its data lost it."""
        async def check():
            await self._probe.ping()
            await self._ensure_group(self._probe)
        for _ in range(2):                           # a connection Redis dropped is no outage: once more
            try:
                await asyncio.wait_for(check(), PING_TIMEOUT_S)
                return True
            except (*DOWN, asyncio.TimeoutError):
                continue
        return False

    async def submit(self, job_id: str, request: bytes, status: bytes, tenant: str = "",
                     limits: Limits = Limits(), cost: int = 1) -> None:
        code, n = await self._do(lambda: self.r.eval(
            q.SUBMIT, 8, q.STREAM, q.job_key(job_id), q.QUEUED, q.wait_key(tenant), q.WAITING, q.NWAITING, q.SUBMITTED,
            q.SEQ,
            job_id, request, status, tenant, limits.max_queued, limits.max_per_tenant, max(1, cost),
            q.SUBMITTED_MAXLEN))
        if code == 1:
            raise QueueFull(f"the queue is full ({n} jobs waiting or running, at most {limits.max_queued})",
                            QUEUE_FULL_RETRY_S)
        if code == 2:
            raise QueueFull(f"tenant {tenant!r} has {n} jobs waiting or running, at most {limits.max_per_tenant}",
                            QUEUE_FULL_RETRY_S)

    async def room(self, tenant: str, limits: Limits) -> None:
        queued, mine = await self._do(lambda: self.r.eval(q.ROOM, 3, q.STREAM, q.QUEUED, q.NWAITING, tenant))
        check_bounds(int(queued), int(mine), tenant, limits)

    async def admit(self, tenant: str, limits: Limits) -> None:
        if not limits.rate_per_min:
            return
        wait = await self._do(lambda: self.r.eval(q.RATE, 1, f"kvplan:rate:{tenant}", limits.rate_per_min))
        if wait:
            raise QueueFull(f"tenant {tenant!r} is over its rate of {limits.rate_per_min} jobs a minute", wait)

    async def tenant(self, job_id: str) -> str | None:
        got = await self._do(lambda: self.r.hmget(q.job_key(job_id), "status", "tenant"))
        return None if got[0] is None else (got[1] or b"").decode()

    async def claim(self, consumer: str, block_ms: int, exclude: frozenset[str] = frozenset()) -> Claim | None:
        """A dead executor's job first, else the waiting job the fairness policy picks among the
        tenants not in `exclude`; with none, wait up to block_ms for a submission (through the
        event hub: no connection held)."""
        deadline = time.monotonic() + block_ms / 1000
        while True:
            seen = await self._do(lambda: self.r.xrevrange(q.SUBMITTED, count=1))
            if seen:
                self._seen = seen[0][0].decode()
            try:
                got = await self._claim_once(consumer, exclude)
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                await self._do(lambda: self._ensure_group(self.r))
                return None
            left = deadline - time.monotonic()
            if got is not None or left <= 0:
                return got
            await self.hub.wait(q.SUBMITTED, self._seen, left)

    async def _claim_once(self, consumer: str, exclude: frozenset[str]) -> Claim | None:
        # Jobs of dead executors first: entries pending longer than claim_idle_ms.
        _, entries, _ = await self._do(lambda: self.r.xautoclaim(q.STREAM, self.group, consumer, self.claim_idle_ms,
                                                                 "0-0", count=1))
        if entries:
            entry_id, fields = entries[0]
            return await self._claimed(entry_id.decode(), fields[b"job_id"].decode(),
                                       fields.get(b"tenant", b"").decode())
        while True:
            flat = await self._do(lambda: self.r.eval(q.HEADS, 1, q.WAITING))
            rows = sorted((int(flat[i + 3]), flat[i].decode(), flat[i + 1].decode(), int(flat[i + 2]))
                          for i in range(0, len(flat), 4))               # the heads in arrival order
            heads = [Waiting(job, tenant, cost) for _, tenant, job, cost in rows if tenant not in exclude]
            pick = self.fair.pick(heads)
            if pick is None:                         # entries queued straight into the stream (older
                got = await self._do(lambda: self.r.xreadgroup(self.group, consumer, {q.STREAM: ">"}, count=1))
                if not got or not got[0][1]:         # executors' submissions) are taken as they come
                    return None
                entry_id, fields = got[0][1][0]
                return await self._claimed(entry_id.decode(), fields[b"job_id"].decode(),
                                           fields.get(b"tenant", b"").decode())
            got = await self._do(lambda: self.r.eval(q.TAKE, 4, q.wait_key(pick.tenant), q.WAITING, q.NWAITING,
                                                     q.STREAM, pick.key, pick.tenant, self.group, consumer))
            if got:                                  # else another executor took that head first
                return await self._claimed(got[0].decode(), got[1].decode(), got[2].decode())

    async def _claimed(self, entry_id: str, job_id: str, tenant: str) -> Claim:
        attempt = await self._do(lambda: self.r.hincrby(q.job_key(job_id), "attempts", 1))
        return Claim(job_id, entry_id, int(attempt), tenant)

    async def heartbeat(self, claim: Claim, consumer: str) -> bool:
        pending = await self._do(lambda: self.r.xpending_range(q.STREAM, self.group, claim.entry_id,
                                                               claim.entry_id, 1))
        if not pending or pending[0]["consumer"].decode() != consumer:
            return False
        await self._do(lambda: self.r.xclaim(q.STREAM, self.group, consumer, 0, [claim.entry_id], justid=True))
        return True

    async def finish(self, claim: Claim, ttl_s: int) -> None:
        await self._do(lambda: self.r.eval(q.FINISH, 4, q.STREAM, q.job_key(claim.job_id), q.events_key(claim.job_id),
                                           q.QUEUED, self.group, claim.entry_id, ttl_s, claim.tenant))

    async def request(self, job_id: str) -> bytes | None:
        return await self._do(lambda: self.r.hget(q.job_key(job_id), "request"))

    async def set_status(self, job_id: str, status: bytes) -> None:
        await self._do(lambda: self.r.hset(q.job_key(job_id), "status", status))

    async def status(self, job_id: str) -> bytes | None:
        return await self._do(lambda: self.r.hget(q.job_key(job_id), "status"))

    async def append_event(self, job_id: str, event: bytes) -> None:
        await self._do(lambda: self.r.xadd(q.events_key(job_id), {"e": event}))

    async def events(self, job_id: str, after: str, block_ms: int) -> list[tuple[str, bytes]]:
        got = await self.hub.wait(q.events_key(job_id), after, block_ms / 1000)
        return [(eid, fields[b"e"]) for eid, fields in got]

    async def _xrange(self, key: str, after: str, count: int) -> list[tuple[str, dict]]:
        got = await self._do(lambda: self.r.xrange(key, min=f"({after}", count=count))
        return [(eid.decode(), fields) for eid, fields in got]

    async def cancel(self, job_id: str) -> None:
        await self._do(lambda: self.r.hset(q.job_key(job_id), "cancel", 1))

    async def is_cancelled(self, job_id: str) -> bool:
        return await self._do(lambda: self.r.hget(q.job_key(job_id), "cancel")) == b"1"
