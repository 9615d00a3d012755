"""The CacheStore gRPC service: Put / Get / Prefetch / Release / Stats over a BlockStore.

Each RPC decodes and checks its request, runs the store operation in a worker thread (KV
payloads are copied and gathered there, off the event loop), and maps failures to status
codes: bad input -> INVALID_ARGUMENT naming the field, capacity -> RESOURCE_EXHAUSTED, an
unknown block -> NOT_FOUND, another tenant's job with a `user` key -> PERMISSION_DENIED (the
tenant of every call is the API key's; `kvcore.auth`), a registration of an attempt older than
the job's -> FAILED_PRECONDITION. A failed RPC leaves the service serving.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Callable, TypeVar

import grpc
import numpy as np
import torch
from prometheus_client import Counter, Gauge

from cachestore.keys import BlockKey, JobKey
from cachestore.segment import Layout, NoSpace, Segment, segment_name, sweep_orphans
from cachestore.spill import RedisSpill
from cachestore.store import BlockStore, CapacityError, StaleAttempt
from kvcore.auth import Denied, acting_tenant, caller
from cachestore import wire
from cachestore.tensor_codec import NAMES, decode, encode
from kvcore.config import CachestoreConfig
from kvcore.serving import Service
from protos import cachestore_pb2, cachestore_pb2_grpc

log = logging.getLogger("kvplan.cachestore")
R = TypeVar("R")

GAUGES = {
    "capacity_bytes": Gauge("kvplan_cachestore_capacity_bytes", "host memory for KV blocks"),
    "used_bytes": Gauge("kvplan_cachestore_used_bytes", "bytes of KV blocks held (positions, K, V)"),
    "staged_bytes": Gauge("kvplan_cachestore_staged_bytes", "bytes of prefetched rows awaiting their Get"),
    "blocks": Gauge("kvplan_cachestore_blocks", "KV blocks held"),
    "jobs": Gauge("kvplan_cachestore_jobs", "jobs holding blocks"),
    "pinned_jobs": Gauge("kvplan_cachestore_pinned_jobs", "jobs pinned by in-flight work"),
}
COUNTERS = {
    "evictions": Counter("kvplan_cachestore_evictions", "jobs evicted for capacity (LRU)"),
    "hits": Counter("kvplan_cachestore_hits", "Gets of a block that exists"),
    "misses": Counter("kvplan_cachestore_misses", "Gets of a block that does not exist"),
    "prefetches": Counter("kvplan_cachestore_prefetches", "Prefetches accepted"),
    "prefetch_hits": Counter("kvplan_cachestore_prefetch_hits", "Gets served from prefetch staging"),
}


def block_key(msg: cachestore_pb2.BlockKey) -> BlockKey:
    """Wire key -> BlockKey of the caller's tenant; ValueError names the field ("key.tenant: must
    not be empty"), `Denied` a user key naming another tenant."""
    return BlockKey(acting_tenant(msg.tenant, "", "key.tenant"), msg.job_id, msg.layer, msg.kv_head)


def _job(tenant: str, job_id: str) -> JobKey:
    return JobKey(acting_tenant(tenant, ""), job_id)


CHUNK_BYTES = 4 << 20        # GetStream: bytes of K (and of V) per message


class CachestoreServicer(cachestore_pb2_grpc.CacheStoreServicer):
    def __init__(self, store: BlockStore, transport: str = "grpc"):
        self.store = store
        self.transport = transport
        self.segments: dict[JobKey, Segment] = {}      # registered shared-memory jobs
        self._exported = {name: 0 for name in COUNTERS}
        self._export()

    async def Register(self, request: cachestore_pb2.RegisterRequest, context) -> cachestore_pb2.RegisterReply:
        """Idempotent per (job, attempt): the same attempt gets the same segment; a later attempt
        (an executor that re-claimed the job) replaces the earlier one's rows, segment and pin."""
        def register():
            job = _job(request.tenant, request.job_id)
            layout = Layout(request.layers, request.kv_heads, request.head_dim, request.dtype, request.max_tokens,
                            request.top_k)
            if not request.shared_memory:
                self.store.reserve(job, 0, request.attempt)
                return cachestore_pb2.RegisterReply(transport="grpc")
            if not self.store.reserve(job, layout.nbytes, request.attempt):      # capacity first: no file yet
                seg = self.segments[job]
            else:
                try:
                    seg = Segment(segment_name(job.tenant, job.job_id), layout, create=True)
                except BaseException:
                    self.store.release(job.tenant, job.job_id)
                    raise
                if not self.store.attach(job, lambda: self._drop_segment(job, seg)):
                    seg.unlink()
                    raise ValueError(f"job_id: {job.job_id!r} was released while it registered")
                self.segments[job] = seg
                log.info("job %s: segment %s (%d bytes, attempt %d)", job, seg.name, layout.nbytes, request.attempt)
            self.transport = "shm"
            return cachestore_pb2.RegisterReply(transport="shm", segment=seg.name, segment_bytes=layout.nbytes)

        return await self._call(context, register)

    async def PrefetchLayer(self, request: cachestore_pb2.PrefetchLayerRequest, context) -> cachestore_pb2.PrefetchLayerReply:
        def prefetch():
            job = _job(request.tenant, request.job_id)
            if request.top_k < 1:
                raise ValueError(f"top_k: must be >= 1, got {request.top_k}")
            idx = torch.from_numpy(np.asarray(request.token_indices, dtype=np.int64))
            if not idx.numel() or idx.numel() % request.top_k:
                raise ValueError(f"token_indices: {idx.numel()} values are not kv_heads x top_k={request.top_k}")
            idx = idx.view(-1, request.top_k)                                            # [H, k]
            self.store.touch(job)
            seg = self.segments.get(job)
            if seg is not None:
                return self._prefetch_shm(seg, request, idx)
            return self._prefetch_blocks(request, idx)

        reply = await self._call(context, prefetch)
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no rows of job {request.job_id!r} layer {request.layer}")
        return reply

    def _prefetch_shm(self, seg: Segment, request, idx: torch.Tensor) -> cachestore_pb2.PrefetchLayerReply:
        lay = seg.layout
        if not 0 <= request.layer < lay.layers:
            raise ValueError(f"layer: must be in [0, {lay.layers}), got {request.layer}")
        if idx.shape != (lay.kv_heads, min(request.top_k, lay.top_k)) or request.top_k > lay.top_k:
            raise ValueError(f"token_indices: expected kv_heads x top_k = {lay.kv_heads} x <= {lay.top_k}, "
                             f"got {list(idx.shape)}")
        if not 0 <= request.rows <= lay.max_tokens:
            raise ValueError(f"rows: must be in [0, {lay.max_tokens}], got {request.rows}")
        slot = request.step % 2
        seg.gather(request.layer, slot, idx, request.rows)
        self.store.count(request.tenant, "prefetches")
        return cachestore_pb2.PrefetchLayerReply(slot=slot)

    def _prefetch_blocks(self, request, idx: torch.Tensor) -> cachestore_pb2.PrefetchLayerReply | None:
        ks, vs = [], []
        for h in range(idx.shape[0]):
            rows = self.store.get(BlockKey(request.tenant, request.job_id, request.layer, h), idx[h], request.step)
            if rows is None:
                return None
            ks.append(rows.k)
            vs.append(rows.v)
        self.store.count(request.tenant, "prefetches")
        return cachestore_pb2.PrefetchLayerReply(k=encode(torch.stack(ks)), v=encode(torch.stack(vs)))

    async def GetStream(self, request: cachestore_pb2.GetRequest, context):
        """Yields wire-encoded `Chunk`s (cachestore/wire.py): shape and dtype, then K's bytes and
        V's bytes in CHUNK_BYTES slices, each copied once from the store's rows."""
        rows = await self._rows(request, context)
        yield cachestore_pb2.Chunk(shape=list(rows.k.shape), dtype=NAMES[rows.k.dtype]).SerializeToString()
        for field, t in ((wire.K_FIELD, rows.k), (wire.V_FIELD, rows.v)):
            flat = t.contiguous().view(-1).view(torch.uint8).numpy()           # the store's bytes, no copy
            for a in range(0, flat.size, CHUNK_BYTES):
                yield wire.data_chunk(field, flat[a:a + CHUNK_BYTES])

    async def _rows(self, request: cachestore_pb2.GetRequest, context):
        """The rows a Get asks for; NOT_FOUND when there is no such block."""
        def get():
            key = block_key(request.key)
            return key, self.store.get(key, list(request.token_indices) or None, request.step)

        key, rows = await self._call(context, get)
        if rows is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"key: no block for job {key.job_id!r} layer {key.layer} kv_head {key.kv_head}")
        return rows

    def _drop_segment(self, job: JobKey, seg: Segment) -> None:
        seg.unlink()
        if self.segments.get(job) is seg:
            del self.segments[job]

    def stop(self) -> None:
        """The service is stopping: drop every job, unlinking every segment."""
        self.store.drop_all()

    async def Put(self, request: cachestore_pb2.PutRequest, context) -> cachestore_pb2.PutReply:
        def put():
            key = block_key(request.key)
            k = decode(request.k, "k", ndim=2)                                         # [T, D]
            v = decode(request.v, "v", ndim=2)                                         # [T, D]
            positions = torch.from_numpy(np.asarray(request.positions, dtype=np.int64))  # [T]
            return self.store.put(key, positions, k, v, pin=request.pin, copy=False)

        rows, nbytes = await self._call(context, put)
        return cachestore_pb2.PutReply(rows=rows, bytes=nbytes)

    async def Get(self, request: cachestore_pb2.GetRequest, context) -> cachestore_pb2.GetReply:
        rows = await self._rows(request, context)
        return await asyncio.to_thread(
            lambda: cachestore_pb2.GetReply(
                positions=rows.positions.tolist(), k=encode(rows.k), v=encode(rows.v), staged=rows.staged))

    async def Prefetch(self, request: cachestore_pb2.PrefetchRequest, context) -> cachestore_pb2.PrefetchReply:
        def prefetch():
            key = block_key(request.key)
            return self.store.prefetch(key, request.step, list(request.token_indices) or None)

        return cachestore_pb2.PrefetchReply(accepted=await self._call(context, prefetch))

    async def Release(self, request: cachestore_pb2.ReleaseRequest, context) -> cachestore_pb2.ReleaseReply:
        def release():
            job = _job(request.tenant, request.job_id)
            return self.store.release(job.tenant, job.job_id, request.keep)

        freed = await self._call(context, release)
        return cachestore_pb2.ReleaseReply(freed_bytes=freed)

    async def Stats(self, request: cachestore_pb2.StatsRequest, context) -> cachestore_pb2.StatsReply:
        """Totals (an admin's, without a tenant), or a tenant's or a job's; a user key sees its own
        tenant's only."""
        def stats():
            everyone = not request.tenant and caller().role == "admin"
            tenant = "" if everyone else acting_tenant(request.tenant, "")
            if tenant and request.job_id:                     # a handle's liveness call: the job is alive
                self.store.touch(JobKey(tenant, request.job_id))
            return self.store.stats(tenant, request.job_id)

        s = await self._call(context, stats)
        return cachestore_pb2.StatsReply(
            capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes, blocks=s.blocks, jobs=s.jobs,
            pinned_jobs=s.pinned_jobs, evictions=s.evictions, hits=s.hits, misses=s.misses,
            prefetches=s.prefetches, prefetch_hits=s.prefetch_hits, transport=self.transport,
            spilled=s.spilled, reloaded=s.reloaded)

    async def _call(self, context, fn: Callable[[], R]) -> R:
        """Run `fn` in a worker thread; abort the RPC with the status its failure maps to."""
        try:
            result = await asyncio.to_thread(fn)
        except (CapacityError, NoSpace) as e:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except Denied as e:
            code, message = grpc.StatusCode.PERMISSION_DENIED, str(e)
        except StaleAttempt as e:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, str(e)
        except ValueError as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        else:
            self._export()
            return result
        log.info("rejected (%s): %s", code.name, message)
        self._export()
        await context.abort(code, message)

    def _export(self) -> None:
        """Mirror the store's totals into the Prometheus gauges and counters."""
        stats = asdict(self.store.stats())
        for name, gauge in GAUGES.items():
            gauge.set(stats[name])
        for name, counter in COUNTERS.items():
            delta = stats[name] - self._exported[name]
            if delta > 0:
                counter.inc(delta)
            self._exported[name] = stats[name]


def build_service(cfg: CachestoreConfig, store: BlockStore | None = None) -> Service:
    """The cachestore as a kvplan Service; `store` lets tests hand in their own."""
    if store is None:
        spill = RedisSpill(cfg.redis_url, cfg.spill_ttl_s, cfg.redis_max_connections,
                           cfg.redis_pool_timeout_s) if cfg.redis_url else None
        store = BlockStore(cfg.capacity_bytes, spill=spill)
    servicer = CachestoreServicer(store)
    orphans = sweep_orphans()
    if orphans:
        log.warning("unlinked %d shared-memory segments no process maps (a killed cachestore's): %s",
                    len(orphans), ", ".join(orphans))
    sweeper: list[asyncio.Task] = []

    async def warmup() -> None:
        if cfg.lease_s:
            sweeper.append(asyncio.create_task(_expire_leases(store, cfg.lease_s)))

    async def stop() -> None:
        for task in sweeper:
            task.cancel()
        servicer.stop()

    return Service(
        name="cachestore",
        full_names=[cachestore_pb2.DESCRIPTOR.services_by_name["CacheStore"].full_name],
        register=lambda server: register(server, servicer),
        warmup=warmup, stop=stop,
    )


async def _expire_leases(store: BlockStore, lease_s: float) -> None:
    """Release, now and then, the pinned jobs whose executor went away without a word."""
    while True:
        await asyncio.sleep(min(60.0, lease_s / 4))
        for job in await asyncio.to_thread(store.expire, lease_s):
            log.warning("job %s: no call for %.0fs; released (its executor is gone)", job, lease_s)


class _Captured:
    """Stands in for a server to take the generated method handlers."""
    handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def register(server: grpc.aio.Server, servicer: CachestoreServicer) -> None:
    """The generated handlers, but `GetStream` sends the bytes it builds (`cachestore.wire`)."""
    captured = _Captured()
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(servicer, captured)
    handlers = captured.handlers
    handlers["GetStream"] = grpc.unary_stream_rpc_method_handler(
        servicer.GetStream, request_deserializer=cachestore_pb2.GetRequest.FromString, response_serializer=None)
    name = cachestore_pb2.DESCRIPTOR.services_by_name["CacheStore"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
