"""Register (issue 23) against a real cachestore over gRPC on 127.0.0.1: bounded by the capacity
before any file exists, idempotent per job and attempt (a re-claimed job's second attempt
replaces the first's segment and pin), undecodable bytes and malformed tenants refused."""
from __future__ import annotations

import time

import grpc
import pytest
import torch

from cachestore.client import CachestoreClient
from cachestore.segment import leftovers
from protos import cachestore_pb2 as pb
from tests.cachestore.test_transport import H, D, CAP, K, Server, rows


@pytest.fixture
def server():
    s = Server(capacity=1 << 24)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    c = CachestoreClient(f"127.0.0.1:{server.port}", timeout_s=5)
    yield c
    c.close()


def mine() -> list[str]:
    return [n for n in leftovers() if n.startswith("kvplan-rg-")]


def register(client, attempt: int = 0, job: str = "j", **over) -> pb.RegisterReply:
    fields = dict(tenant="rg", job_id=job, layers=1, kv_heads=H, head_dim=D, dtype="float16", max_tokens=CAP,
                  top_k=K, shared_memory=True, attempt=attempt)
    return client.stub.Register(pb.RegisterRequest(**{**fields, **over}), timeout=5)


def expect(call, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code and words in e.value.details(), (e.value.code(), e.value.details())


def test_a_petabyte_register_is_resource_exhausted_before_any_file(client):
    """Before: UNKNOWN, and a 4.5 PB sparse file left in /dev/shm."""
    expect(lambda: register(client, layers=512, kv_heads=256, head_dim=1024, max_tokens=1 << 20),
           grpc.StatusCode.RESOURCE_EXHAUSTED, "does not fit")
    assert mine() == []
    stats = client.stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.used_bytes == 0 and stats.pinned_jobs == 0


@pytest.mark.parametrize("field, value", [("layers", 10**6), ("max_tokens", 1 << 40), ("head_dim", 0), ("top_k", -1)])
def test_register_sizes_are_bounded(client, field, value):
    expect(lambda: register(client, **{field: value}), grpc.StatusCode.INVALID_ARGUMENT, f"{field}:")
    assert mine() == []


def test_register_is_idempotent_per_attempt_and_a_later_attempt_replaces_the_earlier(client):
    """Before: a re-claimed specache job FAILED with `job_id ... is already registered`, and the
    first attempt's segment and pinned capacity stayed until the cachestore stopped."""
    first = register(client, attempt=1)
    assert register(client, attempt=1).segment == first.segment           # a retried Register: same segment
    used = client.stub.Stats(pb.StatsRequest(), timeout=5).used_bytes
    second = register(client, attempt=2)                                  # the executor that re-claimed it
    assert second.segment != first.segment and mine() == [second.segment]
    stats = client.stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.used_bytes == used == first.segment_bytes and stats.pinned_jobs == 1
    expect(lambda: register(client, attempt=1), grpc.StatusCode.FAILED_PRECONDITION, "attempt: 1")
    assert mine() == [second.segment]
    third = register(client, attempt=0)                                   # attempt not said: replaces too
    assert mine() == [third.segment]
    client.stub.Release(pb.ReleaseRequest(tenant="rg", job_id="j"), timeout=5)
    assert mine() == [] and client.stub.Stats(pb.StatsRequest(), timeout=5).used_bytes == 0


def test_a_reclaimed_grpc_job_starts_its_rows_over(server):
    """Rows over gRPC: the second attempt's rows replace the first's (not appended to them)."""
    c = CachestoreClient(f"127.0.0.1:{server.port}", transport="grpc", timeout_s=5)
    try:
        a = c.open("rg", "g", 1, H, D, torch.float16, CAP, K, attempt=1)
        a.put(0, *rows(5))
        b = c.open("rg", "g", 1, H, D, torch.float16, CAP, K, attempt=2)
        b.put(0, *rows(3))
        k, _ = b.read(0)
        assert k.shape == (H, 3, D)
        b.release()
    finally:
        c.close()


def test_the_handle_of_a_second_attempt_works(client):
    a = client.open("rg", "h", 1, H, D, torch.float16, CAP, K, attempt=1)
    a.put(0, *rows(4))
    b = client.open("rg", "h", 1, H, D, torch.float16, CAP, K, attempt=2)
    b.put(0, *rows(6))
    b.prefetch(0, 1, torch.tensor([[5], [0], [2]]))
    assert b.take(0, 1, 5.0) is not None and not b.failed
    b.release()
    assert mine() == []


@pytest.mark.parametrize("method", ["Register", "Put", "Get", "Release", "Stats", "PrefetchLayer"])
def test_undecodable_bytes_are_invalid_argument(client, method):
    call = client.channel.unary_unary(f"/kvplan.v1.CacheStore/{method}", request_serializer=None,
                                      response_deserializer=None)
    expect(lambda: call(b"\xff\xff\xff\x07garbage", timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "request:")
    assert client.stub.Stats(pb.StatsRequest(), timeout=5).capacity_bytes == 1 << 24


def test_a_tenant_that_would_forge_a_log_line_is_refused(client):
    expect(lambda: register(client, tenant="rg\n2026-01-01 INFO forged"), grpc.StatusCode.INVALID_ARGUMENT, "tenant:")
    expect(lambda: client.stub.Release(pb.ReleaseRequest(tenant="a b", job_id="j"), timeout=5),
           grpc.StatusCode.INVALID_ARGUMENT, "tenant:")


def test_a_segment_nobody_maps_is_swept_when_a_cachestore_starts(tmp_path):
    """What a cachestore SIGKILLed while the job's executor was dead too leaves: a file no
    process maps. The next cachestore unlinks it; mapped (live) segments stay."""
    import os
    from cachestore.segment import SHM_DIR, sweep_orphans
    orphan = SHM_DIR / "kvplan-rg-orphan-000000000000"
    orphan.write_bytes(b"\0" * 64)
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    s = Server()
    c = CachestoreClient(f"127.0.0.1:{s.port}", timeout_s=5)
    try:
        live = c.open("rg", "live", 1, H, D, torch.float16, CAP, K)
        os.utime(live.seg.path, (time.time() - 3600, time.time() - 3600))
        assert not orphan.exists()                                     # swept by the new cachestore
        assert live.seg.name not in sweep_orphans(min_age_s=1800) and live.seg.path.exists()   # mapped: kept
        live.release()
    finally:
        orphan.unlink(missing_ok=True)
        c.close()
        s.stop()


def test_a_pin_nothing_touches_is_released_after_its_lease():
    """An executor that died holding a segment, its job never registered again (re-claimed
    without offload, or failed): the lease releases the segment and its pinned capacity."""
    from cachestore.keys import JobKey
    from cachestore.store import BlockStore
    store, dropped = BlockStore(1 << 20), []
    for job in ("dead", "alive"):
        assert store.reserve(JobKey("rg", job), 1000, attempt=1)
        assert store.attach(JobKey("rg", job), lambda job=job: dropped.append(job))
    time.sleep(0.3)
    store.touch(JobKey("rg", "alive"))                  # its handle's liveness call
    assert store.expire(lease_s=0.2) == [JobKey("rg", "dead")] and dropped == ["dead"]
    stats = store.stats()
    assert stats.jobs == 1 and stats.pinned_jobs == 1 and stats.used_bytes == 1000
