"""Event delivery without a Redis connection per watcher (issue 33): the job queue's event hub
reads every watched job's event stream with one blocking XREAD and fans the entries out, over a
real redis-server. Before, each watching stream held a blocking XREAD on a pooled connection: 100
watchers took redis-py's whole default pool, the rest failed with "Too many connections", and
the health check's ping failed with them (NOT_SERVING)."""
import asyncio
import time

import pytest
import redis

from executor.job_backend import PATIENCE
from executor.redis_jobs import RedisJobs

WATCHERS = 300
POOL = 8


@pytest.fixture
async def jobs(redis_db):
    """The Redis job backend, open, over this test's flushed Redis."""
    backend = RedisJobs(redis_db)
    await backend.open()
    yield backend
    await backend.close()


def _clients(url: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return len(r.client_list()) - 1             # not this one
    finally:
        r.close()


async def test_300_watchers_share_one_reader_and_the_health_ping_still_answers(redis_db):
    jobs = RedisJobs(redis_db, max_connections=POOL, pool_timeout_s=5)
    await jobs.open()
    try:
        PATIENCE.set(2.0)                               # as an RPC's calls
        for i in range(WATCHERS):
            await jobs.submit(f"j{i}", b"req", b"queued", "flood")
            await jobs.append_event(f"j{i}", b"queued")
        first = await asyncio.gather(*(jobs.events(f"j{i}", "0", block_ms=1000) for i in range(WATCHERS)))
        seen = [batch[-1][0] for batch in first]
        waiting = [asyncio.create_task(jobs.events(f"j{i}", seen[i], block_ms=10_000)) for i in range(WATCHERS)]
        await asyncio.sleep(0.5)                        # every watcher waits now
        t0 = time.perf_counter()
        assert await jobs.ping()                        # the health check: answered, at once
        assert time.perf_counter() - t0 < 0.5
        assert _clients(redis_db) <= POOL + 2           # the pool, the ping's, the reader's: not one per watcher
        assert jobs.hub.watched() == WATCHERS
        for i in range(WATCHERS):
            await jobs.append_event(f"j{i}", f"token {i}".encode())
        got = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert [[e for _, e in batch] for batch in got] == [[f"token {i}".encode()] for i in range(WATCHERS)]
    finally:
        await jobs.close()


async def test_a_new_watcher_is_woken_at_once_while_the_reader_blocks_on_others(jobs):
    for job in ("old", "new"):
        await jobs.submit(job, b"req", b"s", "t")
    old = asyncio.create_task(jobs.events("old", "0", block_ms=10_000))   # the reader blocks on "old"
    await asyncio.sleep(0.3)
    new = asyncio.create_task(jobs.events("new", "0", block_ms=10_000))
    await asyncio.sleep(0.1)
    t0 = time.perf_counter()
    await jobs.append_event("new", b"first")
    assert [e for _, e in await asyncio.wait_for(new, 5)] == [b"first"]
    assert time.perf_counter() - t0 < 0.5           # not after the reader's 2 s block
    await jobs.append_event("old", b"x")
    assert [e for _, e in await asyncio.wait_for(old, 5)] == [b"x"]


async def test_a_watcher_coming_back_reads_what_it_missed_and_a_replay_reads_everything(jobs):
    await jobs.submit("j", b"req", b"s", "t")
    await jobs.append_event("j", b"a")
    first = await jobs.events("j", "0", block_ms=100)
    waiter = asyncio.create_task(jobs.events("j", first[-1][0], block_ms=5000))
    await asyncio.sleep(0.2)
    await jobs.append_event("j", b"b")
    got = await asyncio.wait_for(waiter, 5)
    await jobs.append_event("j", b"c")              # while nobody waits: kept for the next call
    later = await jobs.events("j", got[-1][0], block_ms=1000)
    assert [e for _, e in first + got + later] == [b"a", b"b", b"c"]
    assert [e for _, e in await jobs.events("j", "0", block_ms=100)] == [b"a", b"b", b"c"]
    assert await jobs.events("j", later[-1][0], block_ms=200) == []


async def test_the_reader_survives_a_redis_that_goes_away_and_comes_back(jobs, redis_db):
    """The hub's connection is dropped under it (CLIENT KILL): the reader reconnects, and the
    waiter still gets its event."""
    await jobs.submit("j", b"req", b"s", "t")
    waiter = asyncio.create_task(jobs.events("j", "0", block_ms=15_000))
    await asyncio.sleep(0.3)
    r = redis.Redis.from_url(redis_db)
    try:
        r.client_kill_filter(_type="normal", skipme=True)
    finally:
        r.close()
    await asyncio.sleep(0.5)
    await jobs.append_event("j", b"after")
    assert [e for _, e in await asyncio.wait_for(waiter, 10)] == [b"after"]
    assert jobs.hub.alive and await jobs.ping()
