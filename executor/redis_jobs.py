"""Redis backend of the job queue: a Stream with a consumer group, so a job claimed by an
executor that dies is re-claimed by another (XAUTOCLAIM after `claim_idle_ms` of silence; a
live executor refreshes its claim with XCLAIM on every heartbeat).

Keys: `kvplan:jobs` (stream; an entry per job waiting or running), `kvplan:job:{id}` (hash:
request, status, attempts, cancel, tenant), `kvplan:job:{id}:events` (stream of JobEvents),
`kvplan:queued` (hash: tenant -> jobs waiting or running), `kvplan:rate:{tenant}` (submissions
this minute). Finished jobs expire after the TTL. Submitting (bounds checked with the write)
and finishing (the tenant's count drops once) are Lua scripts, so both are atomic and safe to
retry.

Redis going away: every command retries with exponential backoff (tenacity) while Redis is
unreachable — for `PATIENCE` seconds (an RPC sets it short, then answers UNAVAILABLE via
`QueueUnavailable`), else for `patience_s` (the worker's calls: they wait for Redis to come
back, and the job goes on). A consumer group lost with a Redis that kept no data is made again
(`ping`, `claim`); `ping` is what the health check calls.
"""
from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from executor.job_backend import PATIENCE, QUEUE_FULL_RETRY_S, Claim, Limits, QueueFull, QueueUnavailable

log = logging.getLogger("kvplan.executor.queue")
STREAM = "kvplan:jobs"
QUEUED = "kvplan:queued"
DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def _job(job_id: str) -> str:
    return f"kvplan:job:{job_id}"


def _events(job_id: str) -> str:
    return f"kvplan:job:{job_id}:events"


# KEYS: stream, job, queued. ARGV: job_id, request, status, tenant, max_queued, max_per_tenant
_SUBMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 0} end
local queued = redis.call('XLEN', KEYS[1])
if tonumber(ARGV[5]) > 0 and queued >= tonumber(ARGV[5]) then return {1, queued} end
local mine = tonumber(redis.call('HGET', KEYS[3], ARGV[4]) or '0')
if tonumber(ARGV[6]) > 0 and mine >= tonumber(ARGV[6]) then return {2, mine} end
redis.call('HSET', KEYS[2], 'request', ARGV[2], 'status', ARGV[3], 'attempts', 0, 'tenant', ARGV[4])
redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'tenant', ARGV[4])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return {0, 0}
"""
# KEYS: stream, job, events, queued. ARGV: group, entry id, ttl, tenant
_FINISH = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
if acked == 1 and redis.call('HINCRBY', KEYS[4], ARGV[4], -1) <= 0 then redis.call('HDEL', KEYS[4], ARGV[4]) end
return acked
"""
# KEYS: the tenant's rate key. ARGV: limit. -> 0, or seconds until the window ends
_RATE = """
local n = redis.call('INCR', KEYS[1])
local ttl = redis.call('TTL', KEYS[1])
if ttl < 0 then redis.call('EXPIRE', KEYS[1], 60); ttl = 60 end
if n > tonumber(ARGV[1]) then return ttl end
return 0
"""


class RedisJobs:
    def __init__(self, url: str, group: str = "executors", claim_idle_ms: int = 15000, patience_s: float = 3600.0):
        self.url, self.group, self.claim_idle_ms, self.patience_s = url, group, claim_idle_ms, patience_s
        self.r: aioredis.Redis | None = None

    async def open(self) -> None:
        """Connect; a Redis that is not up yet is not an error (`ping` makes the group later)."""
        # retries are ours (tenacity, below); socket_timeout outlasts the blocking reads (<= 1 s)
        self.r = aioredis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))
        if not await self.ping():
            log.warning("Redis at %s is not reachable yet; the executor reports NOT_SERVING until it is", self._where)

    async def close(self) -> None:
        if self.r is not None:
            await self.r.aclose()

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

    async def _ensure_group(self) -> None:
        try:
            await self.r.xgroup_create(STREAM, self.group, id="0", mkstream=True)
            log.info("made consumer group %s on %s", self.group, STREAM)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def depth(self) -> int:
        return await self._do(lambda: self.r.xlen(STREAM))

    async def ping(self) -> bool:
        try:
            await self.r.ping()
            await self._ensure_group()       # a Redis restarted without its data lost the group
            return True
        except DOWN:
            return False

    async def submit(self, job_id: str, request: bytes, status: bytes, tenant: str = "",
                     limits: Limits = Limits()) -> None:
        code, n = await self._do(lambda: self.r.eval(_SUBMIT, 3, STREAM, _job(job_id), QUEUED, job_id, request, status,
                                                     tenant, limits.max_queued, limits.max_per_tenant))
        if code == 1:
            raise QueueFull(f"the queue is full ({n} jobs waiting or running, at most {limits.max_queued})",
                            QUEUE_FULL_RETRY_S)
        if code == 2:
            raise QueueFull(f"tenant {tenant!r} has {n} jobs waiting or running, at most {limits.max_per_tenant}",
                            QUEUE_FULL_RETRY_S)

    async def admit(self, tenant: str, limits: Limits) -> None:
        if not limits.rate_per_min:
            return
        wait = await self._do(lambda: self.r.eval(_RATE, 1, f"kvplan:rate:{tenant}", limits.rate_per_min))
        if wait:
            raise QueueFull(f"tenant {tenant!r} is over its rate of {limits.rate_per_min} jobs a minute", wait)

    async def tenant(self, job_id: str) -> str | None:
        got = await self._do(lambda: self.r.hmget(_job(job_id), "status", "tenant"))
        return None if got[0] is None else (got[1] or b"").decode()

    async def claim(self, consumer: str, block_ms: int) -> Claim | None:
        async def read():
            # Jobs of dead executors first: entries pending longer than claim_idle_ms.
            _, entries, _ = await self.r.xautoclaim(STREAM, self.group, consumer, self.claim_idle_ms, "0-0", count=1)
            if not entries:
                got = await self.r.xreadgroup(self.group, consumer, {STREAM: ">"}, count=1, block=block_ms)
                entries = got[0][1] if got else []
            return entries

        try:
            entries = await self._do(read)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self._ensure_group()
            return None
        if not entries:
            return None
        entry_id, fields = entries[0]
        job_id = fields[b"job_id"].decode()
        attempt = await self._do(lambda: self.r.hincrby(_job(job_id), "attempts", 1))
        return Claim(job_id, entry_id.decode(), int(attempt), fields.get(b"tenant", b"").decode())

    async def heartbeat(self, claim: Claim, consumer: str) -> bool:
        pending = await self._do(lambda: self.r.xpending_range(STREAM, self.group, claim.entry_id, claim.entry_id, 1))
        if not pending or pending[0]["consumer"].decode() != consumer:
            return False
        await self._do(lambda: self.r.xclaim(STREAM, self.group, consumer, 0, [claim.entry_id], justid=True))
        return True

    async def finish(self, claim: Claim, ttl_s: int) -> None:
        await self._do(lambda: self.r.eval(_FINISH, 4, STREAM, _job(claim.job_id), _events(claim.job_id), QUEUED,
                                           self.group, claim.entry_id, ttl_s, claim.tenant))

    async def request(self, job_id: str) -> bytes | None:
        return await self._do(lambda: self.r.hget(_job(job_id), "request"))

    async def set_status(self, job_id: str, status: bytes) -> None:
        await self._do(lambda: self.r.hset(_job(job_id), "status", status))

    async def status(self, job_id: str) -> bytes | None:
        return await self._do(lambda: self.r.hget(_job(job_id), "status"))

    async def append_event(self, job_id: str, event: bytes) -> None:
        await self._do(lambda: self.r.xadd(_events(job_id), {"e": event}))

    async def events(self, job_id: str, after: str, block_ms: int) -> list[tuple[str, bytes]]:
        got = await self._do(lambda: self.r.xread({_events(job_id): after}, block=block_ms))
        return [(eid.decode(), f[b"e"]) for eid, f in got[0][1]] if got else []

    async def cancel(self, job_id: str) -> None:
        await self._do(lambda: self.r.hset(_job(job_id), "cancel", 1))

    async def is_cancelled(self, job_id: str) -> bool:
        return await self._do(lambda: self.r.hget(_job(job_id), "cancel")) == b"1"
