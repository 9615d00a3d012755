"""One tenant within its quota must not stall the executor (issue 33), with the real model, a real
redis-server job queue and real gRPC: 100 concurrent `Generate` streams (the per-tenant quota)
and 100 `WatchJob` streams on the same jobs, against a Redis pool of 8 connections. Before, each
stream held a blocking XREAD on a pooled connection: "Too many connections", streams failing
UNAVAILABLE, and health NOT_SERVING for minutes after the clients had left. Now every stream
ends with its job's result, health stays SERVING throughout, and Redis sees the pool's
connections and two more, not one per stream."""
import asyncio
import time

import grpc
import pytest
import redis

from kvplan.client import request
from kvplan.embedded import Embedded
from kvcore.serving import check_health
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc

pytestmark = pytest.mark.slow
STREAMS, POOL = 100, 8


@pytest.fixture(scope="module")
def cluster(model_cfg, real_model_dir, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    r.close()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPLAN_REDIS_MAX_CONNECTIONS", str(POOL))
    try:
        with Embedded(model_cfg, redis_url=redis_url) as e:
            yield e
    finally:
        mp.undo()


def _redis_clients(url: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return len(r.client_list()) - 1
    finally:
        r.close()


async def _run(addr: str, redis_url: str):
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = executor_pb2_grpc.ExecutorStub(ch)

        async def generate(i: int):
            return [ev async for ev in stub.Generate(request(f"Say the number {i}.", max_new_tokens=2), timeout=600)]

        async def watch(job_id: str):
            return [ev async for ev in stub.WatchJob(pb.JobRef(job_id=job_id), timeout=600)]

        gens = [asyncio.create_task(generate(i)) for i in range(STREAMS)]
        health, clients = [], []
        job_ids: list[str] = []
        while len(job_ids) < STREAMS and not all(g.done() for g in gens):
            await asyncio.sleep(0.5)
            job_ids = _job_ids(redis_url)
        watches = [asyncio.create_task(watch(j)) for j in job_ids]
        while not all(t.done() for t in gens + watches):
            health.append(await asyncio.to_thread(check_health, addr))
            clients.append(_redis_clients(redis_url))
            await asyncio.sleep(0.5)
        return [g.result() for g in gens], [w.result() for w in watches], health, clients


def _job_ids(redis_url: str) -> list[str]:
    """The jobs the queue holds (their records: `kvplan:job:{id}`)."""
    r = redis.Redis.from_url(redis_url)
    try:
        return [k.decode().split(":")[2] for k in r.keys("kvplan:job:*") if not k.endswith(b":events")]
    finally:
        r.close()


def test_a_tenant_at_its_quota_of_streams_does_not_stall_the_executor(cluster, redis_url):
    t0 = time.perf_counter()
    gens, watches, health, clients = asyncio.run(_run(cluster.executor_addr, redis_url))
    took = time.perf_counter() - t0
    print(f"\n{STREAMS} Generate + {len(watches)} WatchJob streams in {took:.1f}s; health {set(health)}; "
          f"Redis clients at most {max(clients)}")
    assert len(watches) == STREAMS
    for events in gens + watches:                     # every stream ended with its job's result
        assert events[-1].WhichOneof("kind") == "result", events[-1]
    assert set(health) == {"SERVING"}
    assert max(clients) <= POOL + 2                   # the pool, the ping's and the event reader's
    assert check_health(cluster.executor_addr) == "SERVING"
