"""The executor's side of the cachestore: `CachestoreClient.open(...)` registers a job and returns
its `JobHandle` (cachestore/handle.py) on the transport that works:

- `shm` (same host): the cachestore creates the job's segment (cachestore/segment.py); this
  side maps it and writes and reads rows by offset. A prefetch is one `PrefetchLayer` call per
  layer — the cachestore gathers the rows into the segment's staging slot, this side copies them
  out — so a cachestore that died is noticed at the next step.
- `grpc` (another host, or `KVPLAN_CACHESTORE_TRANSPORT=grpc`): rows go out in `Put`s (one block
  per KV head) and come back in `GetStream` chunks and `PrefetchLayer` replies.

`auto` asks for a segment and falls back to gRPC when this host cannot map it. Every call has a
deadline; an unreachable cachestore raises `StoreUnavailable` (the handle then fails: the job
finishes on its low-bit copy, degraded). A handle whose cachestore is gone unlinks its segment
itself when released, so nothing stays in /dev/shm.

Shapes: H KV heads, T rows, k rows per head of a prefetch, D head dim.
"""
from __future__ import annotations

import grpc
import numpy as np
import torch

from cachestore import wire
from cachestore.handle import Fetched, JobHandle, StoreUnavailable
from cachestore.segment import Layout, Segment
from cachestore.tensor_codec import DTYPES, NAMES, decode, encode
from kvcore.channels import client_channel
from kvcore.serving import channel_options
from protos import cachestore_pb2 as pb
from protos import cachestore_pb2_grpc

TRANSPORTS = ("auto", "shm", "grpc")
GET_STREAM = "/kvplan.v1.CacheStore/GetStream"
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _unavailable(e: grpc.RpcError, what: str) -> Exception:
    if e.code() in UNREACHABLE:
        return StoreUnavailable(f"cachestore {what}: {e.code().name}: {e.details()}")
    return RuntimeError(f"cachestore {what}: {e.code().name}: {e.details()}")


def _prefetch_layer(h, layer: int, idx: torch.Tensor) -> pb.PrefetchLayerReply:
    """One `PrefetchLayer` call of handle h: rows idx [H, k] of `layer`."""
    req = pb.PrefetchLayerRequest(tenant=h.tenant, job_id=h.job_id, layer=layer, step=0, top_k=idx.shape[1],
                                  token_indices=idx.reshape(-1).tolist(), rows=h.rows[layer])
    try:
        return h.client.stub.PrefetchLayer(req, timeout=h.client.timeout_s)
    except grpc.RpcError as e:
        raise _unavailable(e, "PrefetchLayer") from None


def _release_job(h) -> None:
    try:
        h.client.stub.Release(pb.ReleaseRequest(tenant=h.tenant, job_id=h.job_id), timeout=h.client.timeout_s)
    except grpc.RpcError as e:
        raise _unavailable(e, "Release") from None


class CachestoreClient:
    def __init__(self, addr: str, transport: str = "auto", timeout_s: float = 10.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.addr, self.transport, self.timeout_s = addr, transport, timeout_s
        self.channel = client_channel(addr, options=channel_options())
        self.stub = cachestore_pb2_grpc.CacheStoreStub(self.channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise StoreUnavailable(f"cachestore at {self.addr} not reachable within {timeout_s:g}s") from None

    def open(self, tenant: str, job_id: str, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             max_tokens: int, top_k: int, attempt: int = 0) -> JobHandle:
        """Register a job (max_tokens rows per layer and head, prefetches of top_k rows per head).
        `attempt` (the claim's): registering again for the same attempt is idempotent, a later
        attempt (a re-claimed job) replaces the earlier one's rows, segment and pin."""
        layout = Layout(layers, kv_heads, head_dim, NAMES[dtype], max_tokens, max(1, top_k))
        req = pb.RegisterRequest(tenant=tenant, job_id=job_id, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=layout.dtype, max_tokens=max_tokens, top_k=layout.top_k,
                                 shared_memory=self.transport != "grpc", attempt=attempt)
        reply = self._register(req)
        if reply.transport == "shm":
            try:
                return ShmHandle(self, tenant, job_id, Segment(reply.segment, layout, create=False))
            except FileNotFoundError:                      # another host: its /dev/shm is not ours
                self.stub.Release(pb.ReleaseRequest(tenant=tenant, job_id=job_id), timeout=self.timeout_s)
                if self.transport == "shm":
                    raise StoreUnavailable(f"cachestore at {self.addr} is on another host: no shared memory") from None
                req.shared_memory = False
                self._register(req)
        return GrpcHandle(self, tenant, job_id, layout)

    def _register(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        try:
            return self.stub.Register(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _unavailable(e, "Register") from None

    def close(self) -> None:
        self.channel.close()


class ShmHandle(JobHandle):
    """`one_sided` (default): a prefetch gathers the rows straight from the mapped segment (an
    RDMA-style read by offset: no call per layer) and the cachestore only hears one `Stats`
    call per decode step, which tells a dead cachestore from a live one; otherwise every layer's
    prefetch is a `PrefetchLayer` call that gathers into the segment's staging slot."""

    def __init__(self, client: CachestoreClient, tenant: str, job_id: str, seg: Segment, one_sided: bool = True):
        super().__init__(transport="shm")
        self.client, self.tenant, self.job_id, self.seg = client, tenant, job_id, seg
        self.one_sided = one_sided
        self.rows = [0] * seg.layout.layers            # rows written per layer
        self._ping = None                              # this step's liveness call (one-sided mode)

    def _put(self, layer, k, v):
        n, t = self.rows[layer], k.shape[1]
        if n + t > self.seg.layout.max_tokens:
            raise ValueError(f"job {self.job_id}: layer {layer} would hold {n + t} rows, registered for "
                             f"{self.seg.layout.max_tokens}")
        self.seg.k[layer, :, n:n + t].copy_(k)       # one-sided write by offset
        self.seg.v[layer, :, n:n + t].copy_(v)
        self.rows[layer] = n + t

    def _read(self, layer):
        n = self.rows[layer]
        return self.seg.k[layer, :, :n].clone(), self.seg.v[layer, :, :n].clone()    # [H, N, D]

    def _gather(self, layer, idx):
        if not self.one_sided:
            return self._gather_by_cachestore(layer, idx)
        if layer == 0:
            self._check_alive()
        index = idx.unsqueeze(-1).expand(-1, -1, self.seg.layout.head_dim)          # [H, k, D]
        return Fetched(idx, torch.gather(self.seg.k[layer], 1, index), torch.gather(self.seg.v[layer], 1, index))

    def _check_alive(self) -> None:
        """The previous step's liveness call must have succeeded; start this step's."""
        if self._ping is not None:
            try:
                self._ping.result(timeout=self.client.timeout_s)
            except grpc.RpcError as e:
                raise _unavailable(e, "Stats") from None
            except grpc.FutureTimeoutError:
                raise StoreUnavailable(f"cachestore at {self.client.addr}: no answer in {self.client.timeout_s:g}s") from None
        self._ping = self.client.stub.Stats.future(pb.StatsRequest(tenant=self.tenant, job_id=self.job_id),
                                                   timeout=self.client.timeout_s)

    def _gather_by_cachestore(self, layer, idx):
        reply = _prefetch_layer(self, layer, idx)
        k = idx.shape[1]
        return Fetched(idx, self.seg.stage_k[layer, reply.slot, :, :k].clone(),     # [H, k, D]
                       self.seg.stage_v[layer, reply.slot, :, :k].clone())

    def _release(self):
        try:
            _release_job(self)
        except StoreUnavailable:
            self.seg.unlink()                         # the cachestore is gone: nobody else will
            raise
        finally:
            if self.failed:
                self.seg.unlink()


class GrpcHandle(JobHandle):
    def __init__(self, client: CachestoreClient, tenant: str, job_id: str, layout: Layout):
        super().__init__(transport="grpc")
        self.client, self.tenant, self.job_id, self.layout = client, tenant, job_id, layout
        self.rows = [0] * layout.layers

    def read_into(self, layer: int, head: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One KV head's rows of `layer` streamed into k, v [N, D] (the bench's fair comparison
        with a memcpy into a buffer that exists already)."""
        self._stream(pb.GetRequest(key=self._key(layer, head)), (k, v))

    def _key(self, layer: int, head: int) -> pb.BlockKey:
        return pb.BlockKey(tenant=self.tenant, job_id=self.job_id, layer=layer, kv_head=head)

    def _put(self, layer, k, v):
        n, t = self.rows[layer], k.shape[1]
        positions = list(range(n, n + t))
        try:
            for h in range(k.shape[0]):
                self.client.stub.Put(pb.PutRequest(key=self._key(layer, h), positions=positions, k=encode(k[h]),
                                                   v=encode(v[h]), pin=True), timeout=self.client.timeout_s)
        except grpc.RpcError as e:
            raise _unavailable(e, "Put") from None
        self.rows[layer] = n + t

    def _read(self, layer):
        ks, vs = [], []
        for h in range(self.layout.kv_heads):
            k, v = self._stream(pb.GetRequest(key=self._key(layer, h)))
            ks.append(k)
            vs.append(v)
        return torch.stack(ks), torch.stack(vs)                                  # [H, N, D]

    def _stream(self, req: pb.GetRequest, out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's rows from `GetStream`'s chunks (cachestore/wire.py), each payload copied
        once, into place -> k, v [N, D] (into `out` when given: contiguous, of the block's shape)."""
        call = self.client.channel.unary_stream(GET_STREAM, request_serializer=pb.GetRequest.SerializeToString,
                                                response_deserializer=None)
        try:
            messages = iter(call(req, timeout=self.client.timeout_s))
            head = pb.Chunk.FromString(next(messages))
            shape, dtype = list(head.shape), DTYPES[head.dtype]
            if out is not None and (list(out[0].shape) != shape or out[0].dtype != dtype):
                raise ValueError(f"out: block is {head.dtype} {shape}, got {out[0].dtype} {list(out[0].shape)}")
            k, v = out if out is not None else (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
            flat = {wire.K_FIELD: k.view(-1).view(torch.uint8).numpy(), wire.V_FIELD: v.view(-1).view(torch.uint8).numpy()}
            at = {wire.K_FIELD: 0, wire.V_FIELD: 0}
            for message in messages:
                field, data = wire.read_data_chunk(message)
                n = len(data)
                flat[field][at[field]:at[field] + n] = np.frombuffer(data, dtype=np.uint8)
                at[field] += n
        except grpc.RpcError as e:
            raise _unavailable(e, "GetStream") from None
        return k, v

    def _gather(self, layer, idx):
        reply = _prefetch_layer(self, layer, idx)
        return Fetched(idx, decode(reply.k, "k", ndim=3), decode(reply.v, "v", ndim=3))

    def _release(self):
        _release_job(self)
