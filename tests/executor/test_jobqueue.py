"""Both job backends behind one interface, opened by URL scheme; the Redis one re-claims a job
whose executor went silent."""
import asyncio

import pytest

from executor.jobqueue import open_backend
from executor.memory_jobs import MemoryJobs
from executor.redis_jobs import RedisJobs


@pytest.fixture(params=["memory", "redis"])
async def backend(request):
    if request.param == "memory":
        b = MemoryJobs()
    else:
        b = RedisJobs(request.getfixturevalue("redis_db"), claim_idle_ms=300)
    await b.open()
    yield b
    await b.close()


def test_backend_chosen_by_url_scheme():
    assert isinstance(open_backend(""), MemoryJobs) and isinstance(open_backend("memory://"), MemoryJobs)
    for url in ("redis://127.0.0.1:1/0", "rediss://h:1/0", "unix:///tmp/redis.sock"):
        assert isinstance(open_backend(url, claim_idle_ms=300), RedisJobs)
    with pytest.raises(ValueError, match="scheme 'http'"):
        open_backend("http://localhost:6379")


async def test_submit_claim_events_finish(backend):
    await backend.submit("j1", b"req", b"queued")
    claim = await backend.claim("e1", block_ms=1000)
    assert claim.job_id == "j1" and claim.attempt == 1
    assert await backend.request("j1") == b"req" and await backend.status("j1") == b"queued"
    await backend.append_event("j1", b"a")
    await backend.append_event("j1", b"b")
    got = await backend.events("j1", "0", block_ms=100)
    assert [e for _, e in got] == [b"a", b"b"]
    assert await backend.events("j1", got[-1][0], block_ms=50) == []
    assert await backend.heartbeat(claim, "e1")
    await backend.set_status("j1", b"done")
    await backend.finish(claim, ttl_s=60)
    assert await backend.status("j1") == b"done"
    assert await backend.claim("e1", block_ms=100) is None          # acked: nothing left


async def test_watcher_wakes_on_new_event(backend):
    await backend.submit("j2", b"req", b"s")
    waiter = asyncio.create_task(backend.events("j2", "0", block_ms=3000))
    await asyncio.sleep(0.1)
    await backend.append_event("j2", b"x")
    assert [e for _, e in await asyncio.wait_for(waiter, 3)] == [b"x"]


async def test_cancel_flag(backend):
    await backend.submit("j3", b"req", b"s")
    assert not await backend.is_cancelled("j3")
    await backend.cancel("j3")
    assert await backend.is_cancelled("j3")


async def test_redis_reclaims_a_silent_claim_and_the_old_owner_learns_it(redis_db):
    a, b = RedisJobs(redis_db, claim_idle_ms=300), RedisJobs(redis_db, claim_idle_ms=300)
    await a.open()
    await b.open()
    try:
        await a.submit("j", b"req", b"s")
        first = await a.claim("exec-a", block_ms=500)
        assert await b.claim("exec-b", block_ms=100) is None        # held and fresh
        assert await a.heartbeat(first, "exec-a")
        await asyncio.sleep(0.4)                                     # exec-a goes silent
        second = await b.claim("exec-b", block_ms=100)
        assert second.job_id == "j" and second.entry_id == first.entry_id and second.attempt == 2
        assert not await a.heartbeat(first, "exec-a")               # a lost it
        assert await b.heartbeat(second, "exec-b")
    finally:
        await a.close()
        await b.close()
