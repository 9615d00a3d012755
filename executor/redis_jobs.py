"""Redis backend of the job queue: a Stream with a consumer group, so a job claimed by an
executor that dies is re-claimed by another (XAUTOCLAIM after `claim_idle_ms` of silence; a
live executor refreshes its claim with XCLAIM on every heartbeat).

Keys: `kvplan:jobs` (stream), `kvplan:job:{id}` (hash: request, status, attempts, cancel),
`kvplan:job:{id}:events` (stream of JobEvents). Finished jobs expire after the TTL.
"""
from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from executor.jobqueue import Claim

STREAM = "kvplan:jobs"


def _job(job_id: str) -> str:
    return f"kvplan:job:{job_id}"


def _events(job_id: str) -> str:
    return f"kvplan:job:{job_id}:events"


class RedisJobs:
    def __init__(self, url: str, group: str = "executors", claim_idle_ms: int = 15000):
        self.url, self.group, self.claim_idle_ms = url, group, claim_idle_ms
        self.r: aioredis.Redis | None = None

    async def open(self) -> None:
        self.r = aioredis.from_url(self.url)
        try:
            await self.r.xgroup_create(STREAM, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def close(self) -> None:
        if self.r is not None:
            await self.r.aclose()

    async def submit(self, job_id: str, request: bytes, status: bytes) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.hset(_job(job_id), mapping={"request": request, "status": status, "attempts": 0})
            p.xadd(STREAM, {"job_id": job_id})
            await p.execute()

    async def claim(self, consumer: str, block_ms: int) -> Claim | None:
        # Jobs of dead executors first: entries pending longer than claim_idle_ms.
        _, entries, _ = await self.r.xautoclaim(STREAM, self.group, consumer, self.claim_idle_ms, "0-0", count=1)
        if not entries:
            got = await self.r.xreadgroup(self.group, consumer, {STREAM: ">"}, count=1, block=block_ms)
            entries = got[0][1] if got else []
        if not entries:
            return None
        entry_id, fields = entries[0]
        job_id = fields[b"job_id"].decode()
        attempt = await self.r.hincrby(_job(job_id), "attempts", 1)
        return Claim(job_id, entry_id.decode(), int(attempt))

    async def heartbeat(self, claim: Claim, consumer: str) -> bool:
        pending = await self.r.xpending_range(STREAM, self.group, claim.entry_id, claim.entry_id, 1)
        if not pending or pending[0]["consumer"].decode() != consumer:
            return False
        await self.r.xclaim(STREAM, self.group, consumer, 0, [claim.entry_id], justid=True)
        return True

    async def finish(self, claim: Claim, ttl_s: int) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.xack(STREAM, self.group, claim.entry_id)
            p.xdel(STREAM, claim.entry_id)
            p.expire(_job(claim.job_id), ttl_s)
            p.expire(_events(claim.job_id), ttl_s)
            await p.execute()

    async def request(self, job_id: str) -> bytes | None:
        return await self.r.hget(_job(job_id), "request")

    async def set_status(self, job_id: str, status: bytes) -> None:
        await self.r.hset(_job(job_id), "status", status)

    async def status(self, job_id: str) -> bytes | None:
        return await self.r.hget(_job(job_id), "status")

    async def append_event(self, job_id: str, event: bytes) -> None:
        await self.r.xadd(_events(job_id), {"e": event})

    async def events(self, job_id: str, after: str, block_ms: int) -> list[tuple[str, bytes]]:
        got = await self.r.xread({_events(job_id): after}, block=block_ms)
        return [(eid.decode(), f[b"e"]) for eid, f in got[0][1]] if got else []

    async def cancel(self, job_id: str) -> None:
        await self.r.hset(_job(job_id), "cancel", 1)

    async def is_cancelled(self, job_id: str) -> bool:
        return await self.r.hget(_job(job_id), "cancel") == b"1"
