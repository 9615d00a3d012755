"""Offload transports against a real cachestore over gRPC on 127.0.0.1: shared memory (rows by
offset, prefetch into the staging slot), chunked gRPC streams, tenant isolation of segments, and
no segment left in /dev/shm after Release, a failed job, a stopped or a killed cachestore."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from cachestore import service as cs_service
from cachestore.client import CachestoreClient
from cachestore.handle import LocalHandle, StoreUnavailable
from cachestore.segment import leftovers
from cachestore.service import build_service
from kvcore.config import CachestoreConfig
from kvcore.serving import shutdown, start
from protos import cachestore_pb2 as pb
from cachestore.process import spawn

H, D, CAP, K = 3, 8, 64, 4


class Server:
    """A cachestore on its own event loop in a thread (the client under test is synchronous)."""

    def __init__(self, capacity: int = 1 << 24):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        cfg = CachestoreConfig(host="127.0.0.1", port=0, capacity_bytes=capacity)
        self.svc = build_service(cfg)
        self.server, self.port = self._run(start(self.svc, cfg, with_metrics=False))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self._run(shutdown(self.server, self.svc, grace_s=0))
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    c = CachestoreClient(f"127.0.0.1:{server.port}", timeout_s=5)
    yield c
    c.close()


def mine() -> list[str]:
    return [n for n in leftovers() if "-tt-" in n or n.startswith("kvplan-tt")]


def rows(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, t, D, generator=g).half(), torch.randn(H, t, D, generator=g).half()   # [H, T, D]


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_rows_round_trip_and_prefetch_brings_exactly_the_asked_rows(client, transport):
    client.transport = transport
    h = client.open("tt", f"j-{transport}", 2, H, D, torch.float16, CAP, K)
    assert h.transport == ("shm" if transport == "auto" else "grpc")     # same host: auto picks shared memory
    k, v = rows(10)
    h.put(1, k[:, :7], v[:, :7])
    h.put(1, k[:, 7:], v[:, 7:])                                         # appends continue the positions
    got_k, got_v = h.read(1)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    idx = torch.tensor([[0, 9, 3, 3], [1, 2, 8, 5], [7, 6, 0, 4]])       # [H, k]
    h.prefetch(1, 5, idx)
    f = h.take(1, 5, wait_s=5.0)
    expect = lambda t: torch.gather(t, 1, idx[..., None].expand(-1, -1, D))
    assert torch.equal(f.k, expect(k)) and torch.equal(f.v, expect(v)) and torch.equal(f.idx, idx)
    assert h.take(1, 5, wait_s=0.0) is None                              # taken once
    assert h.stats.in_time == 1 and h.stats.bytes_fetched == 2 * H * K * D * 2 and not h.failed
    h.release()
    assert not h.failed and mine() == []


@pytest.mark.parametrize("transport", ["auto", "grpc", "local"])
def test_a_prefetch_with_a_query_keeps_the_candidates_it_attends_to_most(client, transport):
    """Re-ranked prefetch: 8 candidates per head go over, the 2 of most attention (group mean of
    the softmax over the candidates' exact keys) come back; the bytes moved count all 8."""
    if transport == "local":
        h = LocalHandle()
    else:
        client.transport = transport
        h = client.open("tt", f"r-{transport}", 1, H, D, torch.float16, CAP, 8)
    k, v = rows(12, seed=3)
    h.put(0, k, v)
    cand = torch.stack([torch.randperm(12, generator=torch.Generator().manual_seed(s))[:8] for s in range(H)])  # [H, 8]
    query = torch.randn(H, 2, D, generator=torch.Generator().manual_seed(7))                          # [H, h_n, D]
    h.prefetch(0, 1, cand, query, keep=2)
    f = h.take(0, 1, wait_s=5.0)
    ck = torch.gather(k, 1, cand[..., None].expand(-1, -1, D)).float()                              # [H, 8, D]
    probs = torch.softmax(torch.einsum("ghd,gcd->ghc", query, ck), dim=-1).mean(1)                  # [H, 8]
    best = cand.gather(1, probs.topk(2, dim=-1).indices)                                           # [H, 2]
    assert torch.equal(f.idx, best)
    assert torch.equal(f.k, torch.gather(k, 1, best[..., None].expand(-1, -1, D)))
    assert torch.equal(f.v, torch.gather(v, 1, best[..., None].expand(-1, -1, D)))
    assert h.stats.bytes_fetched == 2 * H * 8 * D * 2                   # every candidate's K and V moved
    h.prefetch(0, 2, cand, query, keep=8)                               # keep all: nothing to re-rank
    assert torch.equal(h.take(0, 2, wait_s=5.0).idx, cand)
    h.release()


def test_get_stream_carries_a_block_bigger_than_one_chunk(client, monkeypatch):
    monkeypatch.setattr(cs_service, "CHUNK_BYTES", 64)                   # 4 rows of K per message
    client.transport = "grpc"
    h = client.open("tt", "big", 1, H, D, torch.float16, CAP, K)
    k, v = rows(50, seed=1)
    h.put(0, k, v)
    got_k, got_v = h.read(0)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # any gRPC client reads the hand-built chunks as Chunk messages: shape and dtype, then K, then V
    chunks = list(client.stub.GetStream(pb.GetRequest(key=pb.BlockKey(tenant="tt", job_id="big", layer=0, kv_head=0))))
    assert len(chunks) == 1 + 13 + 13 and list(chunks[0].shape) == [50, D] and chunks[0].dtype == "float16"
    assert b"".join(c.k for c in chunks) == k[0].numpy().tobytes()
    assert b"".join(c.v for c in chunks) == v[0].numpy().tobytes()
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.GetStream(pb.GetRequest(key=pb.BlockKey(tenant="tt", job_id="nope", layer=0, kv_head=0))))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    h.release()


def test_another_tenant_never_sees_a_jobs_rows(client):
    a = client.open("tt", "same", 1, H, D, torch.float16, CAP, K)
    b = client.open("tt-other", "same", 1, H, D, torch.float16, CAP, K)
    assert a.seg.name != b.seg.name                                      # same job id, separate segments
    k, v = rows(6)
    a.put(0, k, v)
    req = pb.PrefetchLayerRequest(tenant="tt-other", job_id="same", layer=0, top_k=1, token_indices=[0, 1, 2], rows=6)
    client.stub.PrefetchLayer(req, timeout=5)                            # b's own (empty) rows: zeros, not a's
    assert not b.seg.stage_k.any()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.PrefetchLayer(pb.PrefetchLayerRequest(tenant="nobody", job_id="same", layer=0, top_k=1,
                                                          token_indices=[0, 1, 2], rows=6), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    a.release()
    b.release()


def test_bad_prefetch_is_invalid_argument_naming_the_field_and_the_service_goes_on(client):
    h = client.open("tt", "bad", 1, H, D, torch.float16, CAP, K)
    h.put(0, *rows(5))
    for req, field in [
        (pb.PrefetchLayerRequest(tenant="tt", job_id="bad", layer=0, top_k=2, token_indices=[0, 1, 2, 3, 4, 9], rows=5),
         "token_indices: must be in [0, 5)"),
        (pb.PrefetchLayerRequest(tenant="tt", job_id="bad", layer=3, top_k=1, token_indices=[0, 1, 2], rows=5), "layer:"),
        (pb.PrefetchLayerRequest(tenant="tt", job_id="bad", layer=0, top_k=0, token_indices=[], rows=5), "top_k:"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            client.stub.PrefetchLayer(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    h.prefetch(0, 1, torch.tensor([[4], [3], [2]]))
    assert h.take(0, 1, 5.0) is not None
    h.release()


def test_segments_count_against_the_capacity_and_pin_the_job():
    s = Server(capacity=20_000)
    c = CachestoreClient(f"127.0.0.1:{s.port}", timeout_s=5)
    try:
        a = c.open("tt", "a", 2, H, D, torch.float16, CAP, K)             # 2·(2·3·64·8 + 2·2·3·4·8)·2 = 13824 bytes
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):     # a pinned job is not evicted for b
            c.open("tt", "b", 2, H, D, torch.float16, CAP, K)
        stats = c.stub.Stats(pb.StatsRequest(), timeout=5)
        assert stats.used_bytes == a.seg.layout.nbytes == 13824 and stats.pinned_jobs == 1
        a.release()
        b = c.open("tt", "b", 2, H, D, torch.float16, CAP, K)
        b.release()
    finally:
        c.close()
        s.stop()
    assert mine() == []


def test_segments_are_unlinked_after_a_failed_job_and_when_the_cachestore_stops():
    s = Server()
    c = CachestoreClient(f"127.0.0.1:{s.port}", timeout_s=5)
    h = c.open("tt", "fails", 1, H, D, torch.float16, CAP, K)
    try:
        with pytest.raises(ValueError, match="registered for 64"):       # the job fails mid-way ...
            h.put(0, *rows(CAP + 1))
    finally:
        h.release()                                                      # ... and the worker releases it
    assert mine() == []
    left = c.open("tt", "left", 1, H, D, torch.float16, CAP, K)
    assert mine() == [left.seg.name]
    s.stop()                                                             # graceful stop: segments go
    assert mine() == []
    c.close()


def test_a_killed_cachestore_fails_the_handle_without_hanging_and_leaks_nothing():
    with spawn(timeout_s=2) as (proc, c):
        h = c.open("tt", "killed", 1, H, D, torch.float16, CAP, K)
        h.put(0, *rows(8))
        assert mine() == [h.seg.name]
        proc.kill()
        proc.wait(30)
        got = []
        for step in (1, 2, 3):        # one-sided reads need no cachestore; the per-step liveness call notices
            h.prefetch(0, step, torch.zeros(H, K, dtype=torch.long))
            got.append(h.take(0, step, wait_s=10.0))                      # bounded by the call deadline
        assert got[-1] is None and h.stats.late >= 1
        assert h.failed and "UNAVAILABLE" in h.error
        h.put(0, *rows(1))                                                # a failed handle stores nothing
        assert h.read(0) is None
        h.release()
        assert mine() == []                                               # the handle unlinked it
        with pytest.raises(StoreUnavailable):
            c.open("tt", "after", 1, H, D, torch.float16, CAP, K)
