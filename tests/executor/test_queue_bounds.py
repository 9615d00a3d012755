"""Admission bounds of both job backends (issue 23): jobs waiting or running, all together and per
tenant, a per-tenant rate (kept in Redis), a tenant recorded per job, idempotent submit, and a
finished job's count dropping once however often its finish is retried."""
import pytest

from executor.job_backend import Limits, QueueFull
from executor.memory_jobs import MemoryJobs
from executor.redis_jobs import RedisJobs


@pytest.fixture(params=["memory", "redis"])
async def backend(request):
    b = MemoryJobs() if request.param == "memory" else RedisJobs(request.getfixturevalue("redis_db"), claim_idle_ms=300)
    await b.open()
    yield b
    await b.close()


async def test_global_and_per_tenant_bounds(backend):
    limits = Limits(max_queued=4, max_per_tenant=2)
    await backend.submit("a1", b"r", b"s", "a", limits)
    await backend.submit("a2", b"r", b"s", "a", limits)
    with pytest.raises(QueueFull, match="tenant 'a' has 2 jobs") as e:
        await backend.submit("a3", b"r", b"s", "a", limits)
    assert e.value.retry_after_s >= 1
    await backend.submit("b1", b"r", b"s", "b", limits)
    await backend.submit("c1", b"r", b"s", "c", limits)
    with pytest.raises(QueueFull, match="the queue is full"):
        await backend.submit("d1", b"r", b"s", "d", limits)
    assert await backend.status("a3") is None and await backend.status("d1") is None   # nothing written
    claim = await backend.claim("e1", block_ms=1000)
    assert (claim.job_id, claim.tenant) == ("a1", "a")
    await backend.finish(claim, ttl_s=60)
    await backend.finish(claim, ttl_s=60)                 # a retried finish counts once
    await backend.submit("a3", b"r", b"s", "a", limits)   # room again (a: 2 of 2, all: 4 of 4)
    with pytest.raises(QueueFull, match="the queue is full"):
        await backend.submit("d1", b"r", b"s", "d", limits)


async def test_submit_is_idempotent_and_records_the_tenant(backend):
    limits = Limits(max_queued=5, max_per_tenant=5)
    await backend.submit("j", b"r", b"s", "acme", limits)
    await backend.submit("j", b"r", b"s", "acme", limits)            # a retried submit: one job
    assert await backend.tenant("j") == "acme" and await backend.tenant("nope") is None
    assert (await backend.claim("e1", block_ms=1000)).job_id == "j"
    assert await backend.claim("e1", block_ms=100) is None


async def test_rate_per_tenant(backend):
    limits = Limits(rate_per_min=3)
    for _ in range(3):
        await backend.admit("a", limits)
    with pytest.raises(QueueFull, match="over its rate of 3 jobs a minute") as e:
        await backend.admit("a", limits)
    assert 1 <= e.value.retry_after_s <= 60
    await backend.admit("b", limits)                                  # another tenant's own window
    await backend.admit("a", Limits())                                # no limit: always admitted


async def test_the_rate_is_shared_through_redis(redis_db):
    """Two executors on one Redis: the tenant's rate is one window, not one each."""
    one, two = RedisJobs(redis_db), RedisJobs(redis_db)
    await one.open()
    await two.open()
    try:
        limits = Limits(rate_per_min=2)
        await one.admit("t", limits)
        await two.admit("t", limits)
        with pytest.raises(QueueFull):
            await one.admit("t", limits)
    finally:
        await one.close()
        await two.close()
