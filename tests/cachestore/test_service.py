"""The CacheStore over real gRPC on 127.0.0.1, port 0: round trips, status codes naming the
field at fault, capacity, tenant isolation, staging and Stats; the service survives errors."""
from __future__ import annotations

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from cachestore.service import build_service
from cachestore.tensor_codec import decode, encode
from kvcore.config import CachestoreConfig
from kvcore.serving import channel_options, shutdown, start
from protos import cachestore_pb2 as pb
from protos import cachestore_pb2_grpc

D = 8
ROW_BYTES = 8 + 2 * D * 2          # int64 position + fp16 K and V
CAPACITY = 16 * ROW_BYTES


@pytest.fixture
async def stub():
    cfg = CachestoreConfig(host="127.0.0.1", port=0, capacity_bytes=CAPACITY)
    svc = build_service(cfg)
    server, port = await start(svc, cfg, with_metrics=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
            yield cachestore_pb2_grpc.CacheStoreStub(channel)
    finally:
        await shutdown(server, svc, grace_s=0)


def key(tenant="acme", job="j1", layer=0, head=0) -> pb.BlockKey:
    return pb.BlockKey(tenant=tenant, job_id=job, layer=layer, kv_head=head)


def put_request(t=5, start=0, seed=0, dtype=torch.float16, pin=False, **key_args) -> tuple[pb.PutRequest, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, D, generator=g).to(dtype)     # [T, D]
    v = torch.randn(t, D, generator=g).to(dtype)     # [T, D]
    req = pb.PutRequest(key=key(**key_args), positions=range(start, start + t), k=encode(k), v=encode(v), pin=pin)
    return req, k, v


async def assert_alive(stub):
    """A valid request still works after an error."""
    reply = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert reply.transport == "grpc" and reply.capacity_bytes == CAPACITY


async def expect_error(call, code: grpc.StatusCode, details: str):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert details in err.value.details(), err.value.details()


async def test_put_get_round_trip(stub):
    req, k, v = put_request(t=5, start=10)
    reply = await stub.Put(req, timeout=5)
    assert (reply.rows, reply.bytes) == (5, 5 * ROW_BYTES)
    got = await stub.Get(pb.GetRequest(key=key()), timeout=5)
    assert list(got.positions) == [10, 11, 12, 13, 14] and not got.staged
    assert got.k.data == k.numpy().tobytes() and got.v.data == v.numpy().tobytes()
    assert (got.k.dtype, list(got.k.shape)) == ("float16", [5, D])
    some = await stub.Get(pb.GetRequest(key=key(), token_indices=[4, 0, 2]), timeout=5)
    assert list(some.positions) == [14, 10, 12]
    assert torch.equal(decode(some.k, "k"), k[[4, 0, 2]]) and torch.equal(decode(some.v, "v"), v[[4, 0, 2]])


async def test_bfloat16_and_append_over_the_wire(stub):
    first, k1, _ = put_request(t=2, dtype=torch.bfloat16, job="bf")
    second, k2, _ = put_request(t=3, start=2, seed=1, dtype=torch.bfloat16, job="bf")
    await stub.Put(first, timeout=5)
    assert (await stub.Put(second, timeout=5)).rows == 5
    got = await stub.Get(pb.GetRequest(key=key(job="bf")), timeout=5)
    assert torch.equal(decode(got.k, "k", ndim=2), torch.cat([k1, k2]))


def _set_v(req, tensor):
    req.v.CopyFrom(encode(tensor))


BAD_PUTS = {
    "empty tenant": (lambda r: setattr(r.key, "tenant", ""), "key.tenant: must not be empty"),
    "empty job": (lambda r: setattr(r.key, "job_id", ""), "key.job_id: must not be empty"),
    "negative layer": (lambda r: setattr(r.key, "layer", -2), "key.layer: must be >= 0"),
    "k/v shapes differ": (lambda r: _set_v(r, torch.zeros(5, 4, dtype=torch.float16)),
                          "v.shape: [5, 4] does not match k.shape [5, 8]"),
    "bad dtype": (lambda r: setattr(r.k, "dtype", "int8"), "k.dtype: unsupported 'int8'"),
    "k 3-D": (lambda r: r.k.shape.append(1), "k.shape: expected 2 dimensions, got [5, 8, 1]"),
    "short data": (lambda r: setattr(r.k, "data", r.k.data[:-2]), "k.data: 78 bytes, expected 80"),
    "negative dim": (lambda r: r.v.shape.__setitem__(0, -5), "v.shape: negative dimension"),
    "k/v dtypes differ": (lambda r: _set_v(r, torch.zeros(5, D)), "v.dtype: float32 does not match k.dtype float16"),
    "positions count": (lambda r: r.positions.pop(), "positions: 4 values for 5 rows of k"),
    "missing v": (lambda r: r.ClearField("v"), "v: missing"),
}


@pytest.mark.parametrize("case", list(BAD_PUTS))
async def test_bad_put_is_invalid_argument_naming_the_field(stub, case):
    mutate, details = BAD_PUTS[case]
    req, _, _ = put_request()
    mutate(req)
    await expect_error(stub.Put(req, timeout=5), grpc.StatusCode.INVALID_ARGUMENT, details)
    await assert_alive(stub)
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).blocks == 0


async def test_out_of_range_token_index_is_invalid_argument(stub):
    await stub.Put(put_request(t=5)[0], timeout=5)
    await expect_error(stub.Get(pb.GetRequest(key=key(), token_indices=[1, 7]), timeout=5),
                       grpc.StatusCode.INVALID_ARGUMENT, "token_indices: index 7 out of range for 5 rows")
    await expect_error(stub.Prefetch(pb.PrefetchRequest(key=key(), step=1, token_indices=[-3]), timeout=5),
                       grpc.StatusCode.INVALID_ARGUMENT, "token_indices: index -3 out of range for 5 rows")
    assert len((await stub.Get(pb.GetRequest(key=key(), token_indices=[4]), timeout=5)).positions) == 1


async def test_capacity_is_resource_exhausted(stub):
    await stub.Put(put_request(t=16, pin=True, job="pinned")[0], timeout=5)
    await expect_error(stub.Put(put_request(t=1, job="other")[0], timeout=5),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, "does not fit")
    await assert_alive(stub)
    released = await stub.Release(pb.ReleaseRequest(tenant="acme", job_id="pinned"), timeout=5)
    assert released.freed_bytes == 16 * ROW_BYTES
    assert (await stub.Put(put_request(t=1, job="other")[0], timeout=5)).rows == 1


async def test_unknown_block_is_not_found(stub):
    await expect_error(stub.Get(pb.GetRequest(key=key(job="nope")), timeout=5), grpc.StatusCode.NOT_FOUND, "key:")
    assert not (await stub.Prefetch(pb.PrefetchRequest(key=key(job="nope"), step=1), timeout=5)).accepted
    await expect_error(stub.Get(pb.GetRequest(key=key(tenant="")), timeout=5),
                       grpc.StatusCode.INVALID_ARGUMENT, "key.tenant: must not be empty")
    await expect_error(stub.Release(pb.ReleaseRequest(tenant="acme"), timeout=5),
                       grpc.StatusCode.INVALID_ARGUMENT, "job_id: must not be empty")
    await assert_alive(stub)


async def test_tenant_isolation_over_the_wire(stub):
    await stub.Put(put_request(tenant="a", job="shared")[0], timeout=5)
    await expect_error(stub.Get(pb.GetRequest(key=key(tenant="b", job="shared")), timeout=5),
                       grpc.StatusCode.NOT_FOUND, "key:")
    assert (await stub.Release(pb.ReleaseRequest(tenant="b", job_id="shared"), timeout=5)).freed_bytes == 0
    b_stats = await stub.Stats(pb.StatsRequest(tenant="b"), timeout=5)
    assert (b_stats.jobs, b_stats.used_bytes, b_stats.misses) == (0, 0, 1)
    a_stats = await stub.Stats(pb.StatsRequest(tenant="a"), timeout=5)
    assert (a_stats.jobs, a_stats.blocks, a_stats.used_bytes, a_stats.misses) == (1, 1, 5 * ROW_BYTES, 0)
    assert len((await stub.Get(pb.GetRequest(key=key(tenant="a", job="shared")), timeout=5)).positions) == 5


async def test_prefetch_is_served_staged_once(stub):
    req, k, _ = put_request(t=6)
    await stub.Put(req, timeout=5)
    assert (await stub.Prefetch(pb.PrefetchRequest(key=key(), step=7, token_indices=[5, 2]), timeout=5)).accepted
    got = await stub.Get(pb.GetRequest(key=key(), step=7, token_indices=[5, 2]), timeout=5)
    assert got.staged and torch.equal(decode(got.k, "k"), k[[5, 2]])
    again = await stub.Get(pb.GetRequest(key=key(), step=7, token_indices=[5, 2]), timeout=5)
    assert not again.staged and again.k.data == got.k.data


async def test_stats_numbers(stub):
    evictions_before = REGISTRY.get_sample_value("kvplan_cachestore_evictions_total")
    await stub.Put(put_request(t=4, job="a", layer=0, pin=True)[0], timeout=5)
    await stub.Put(put_request(t=4, job="a", layer=1, pin=True)[0], timeout=5)
    await stub.Put(put_request(t=4, job="b")[0], timeout=5)
    await stub.Get(pb.GetRequest(key=key(job="b")), timeout=5)
    await stub.Prefetch(pb.PrefetchRequest(key=key(job="a"), step=1), timeout=5)
    await stub.Get(pb.GetRequest(key=key(job="a"), step=1), timeout=5)
    await stub.Put(put_request(t=8, job="c")[0], timeout=5)        # evicts b (the only unpinned job)
    await expect_error(stub.Get(pb.GetRequest(key=key(job="b")), timeout=5), grpc.StatusCode.NOT_FOUND, "key:")
    s = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert (s.capacity_bytes, s.used_bytes, s.blocks, s.jobs, s.pinned_jobs) == (CAPACITY, 16 * ROW_BYTES, 3, 2, 1)
    assert (s.evictions, s.hits, s.misses, s.prefetches, s.prefetch_hits) == (1, 2, 1, 1, 1)
    assert s.transport == "grpc"
    job_a = await stub.Stats(pb.StatsRequest(tenant="acme", job_id="a"), timeout=5)
    assert (job_a.blocks, job_a.used_bytes, job_a.pinned_jobs) == (2, 8 * ROW_BYTES, 1)
    # Prometheus mirrors the store (the gauges show the store that exported last: this one)
    assert REGISTRY.get_sample_value("kvplan_cachestore_used_bytes") == 16 * ROW_BYTES
    assert REGISTRY.get_sample_value("kvplan_cachestore_blocks") == 3
    assert REGISTRY.get_sample_value("kvplan_cachestore_evictions_total") == evictions_before + 1
