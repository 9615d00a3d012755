"""BlockStore: host-memory KV blocks with a byte capacity, LRU across jobs, and pins.

A job (tenant, job_id) owns the blocks of all its (layer, kv-head) pairs. The least recently
used job is evicted first, all its blocks together; a pinned job (one with work in flight,
pinned by `put(pin=True)` until `release`) is never evicted. A put that cannot fit even
after evicting every other unpinned job raises CapacityError and evicts nothing.

Bytes are the real sizes of the tensors held (positions, K and V). Rows staged by `prefetch`
are copies outside the capacity; `stats().staged_bytes` reports them. All methods are
thread-safe (one lock). Messages of ValueError name the request field at fault.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Callable, Sequence

import torch

from cachestore.block import Block, Rows, check_rows
from cachestore.counters import Counters, StoreStats
from cachestore.keys import BlockKey, JobKey
from cachestore.staging import PrefetchStaging

log = logging.getLogger("kvplan.cachestore")

Indices = Sequence[int] | torch.Tensor | None   # [N] row indices; None: all rows


class CapacityError(Exception):
    """A put does not fit, even after evicting every unpinned job but its own."""


class StaleAttempt(Exception):
    """A registration of an earlier attempt than the job's registered one (a presumed-dead
    executor that woke up): FAILED_PRECONDITION, nothing changes."""


@dataclass
class _Job:
    blocks: dict[BlockKey, Block] = field(default_factory=dict)
    nbytes: int = 0
    pinned: bool = False
    reserved: int = 0                     # bytes of a registered shared-memory segment
    on_drop: Callable[[], None] | None = None   # frees what the reservation stands for
    attempt: int = 0                      # the executor attempt that registered the job (0: not said)
    touched: float = field(default_factory=time.monotonic)   # last call about the job (a pin's lease)


def _host(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """A contiguous CPU tensor the store may own: a copy unless `copy` is False."""
    t = t.detach()
    if copy:
        return torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return t.cpu().contiguous()


def _as_indices(token_indices: Indices) -> torch.Tensor | None:   # [N] int64 on CPU
    if token_indices is None:
        return None
    idx = torch.as_tensor(token_indices).cpu()
    if idx.dim() != 1 or (idx.numel() and (idx.dtype.is_floating_point or idx.dtype == torch.bool)):
        raise ValueError(f"token_indices: must be a 1-D list of integers, got {idx.dtype} shape {list(idx.shape)}")
    return idx.to(torch.int64)


class BlockStore:
    def __init__(self, capacity_bytes: int, max_staged: int = 4096, spill=None):
        """spill: a `cachestore.spill.RedisSpill` for the blocks of evicted jobs, or None."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.RLock()
        self._jobs: OrderedDict[JobKey, _Job] = OrderedDict()   # least recently used first
        self._staging = PrefetchStaging(max_staged)
        self._used = 0
        self._total = Counters()
        self._by_tenant: dict[str, Counters] = {}
        self.spill = spill

    # -- the five operations ------------------------------------------------------------

    def put(self, key: BlockKey, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            pin: bool = False, copy: bool = True) -> tuple[int, int]:
        """Append rows (positions [T] int64, k [T, D], v [T, D]) to `key`'s block, creating it.

        Returns (rows, bytes) of the block afterwards. `copy=False` lets the store keep the
        caller's (CPU, contiguous) tensors instead of copying them.
        """
        with self._lock:
            job = self._jobs.get(key.job)
            block = job.blocks.get(key) if job else None
            if block is not None:
                block.check_append(positions, k, v)
            else:
                check_rows(positions, k, v)
            added = positions.nbytes + k.nbytes + v.nbytes
            self._make_room(added, keep=key.job)
            positions, k, v = (_host(t, copy) for t in (positions, k, v))
            if job is None:
                job = self._jobs[key.job] = _Job()
            if block is None:
                block = job.blocks[key] = Block(positions, k, v)
            else:
                block.append(positions, k, v)
            job.nbytes += added
            job.pinned |= pin
            self._used += added
            self._touch(key.job)
            return block.rows, block.nbytes

    def get(self, key: BlockKey, token_indices: Indices = None, step: int = 0) -> Rows | None:
        """Rows `token_indices` of the block (all when None), or None when there is no block.

        A prefetch staged for the same step and indices is served (and dropped) first. Rows
        of a whole-block read share the store's tensors: treat them as read-only.
        """
        idx = _as_indices(token_indices)
        with self._lock:
            block = self._block(key) or self._reload(key)
            if block is None:
                self._count(key.tenant, "misses")
                return None
            rows = self._staging.take(key, step, idx)
            if rows is not None:
                self._count(key.tenant, "prefetch_hits")
            else:
                rows = self._read(block, idx)
            self._count(key.tenant, "hits")
            self._touch(key.job)
            return rows

    def prefetch(self, key: BlockKey, step: int, token_indices: Indices = None) -> bool:
        """Gather rows now for the Get of `step`; False when the block does not exist."""
        idx = _as_indices(token_indices)
        with self._lock:
            block = self._block(key) or self._reload(key)
            if block is None:
                return False
            self._staging.stage(key, step, idx, self._read(block, idx))
            self._count(key.tenant, "prefetches")
            self._touch(key.job)
            return True

    def reserve(self, job: JobKey, nbytes: int, attempt: int = 0) -> bool:
        """Register executor attempt `attempt` of a job, pinned until `release`: `nbytes` of a
        shared-memory segment counted against the capacity before the segment exists (so a size
        that cannot fit, CapacityError, costs nothing), or 0 (rows over gRPC). The same attempt
        again is idempotent: False, nothing changes. A later attempt (or attempt 0, not said)
        replaces the job: its blocks, segment and pin are dropped first, so its rows start over.
        An earlier attempt raises StaleAttempt. True: reserved; `attach` the segment's clean-up."""
        with self._lock:
            old = self._jobs.get(job)
            if old is not None and attempt and old.attempt == attempt:
                if old.reserved != nbytes:
                    raise ValueError(f"job_id: attempt {attempt} of {job.job_id!r} is registered with "
                                     f"{old.reserved} bytes, asked again with {nbytes}")
                return False
            self._replace(job, attempt)
            self._make_room(nbytes, keep=job)
            self._jobs[job] = _Job(nbytes=nbytes, pinned=True, reserved=nbytes, attempt=attempt)
            self._used += nbytes
            return True

    def attach(self, job: JobKey, on_drop: Callable[[], None]) -> bool:
        """Give a reserved job the clean-up of its segment (run when the job is dropped); False
        when the reservation is gone (released meanwhile): the caller frees the segment."""
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None or not entry.reserved or entry.on_drop is not None:
                return False
            entry.on_drop = on_drop
            return True

    def _replace(self, job: JobKey, attempt: int) -> None:
        """Drop what an earlier attempt of `job` holds (StaleAttempt for a later one's)."""
        old = self._jobs.get(job)
        if old is None:
            return
        if attempt and old.attempt > attempt:
            raise StaleAttempt(f"attempt: {attempt} of job {job.job_id!r} is older than the registered "
                               f"attempt {old.attempt}")
        log.info("job %s: attempt %d replaces attempt %d (its rows and segment are dropped)", job, attempt,
                 old.attempt)
        if self.spill is not None:
            self.spill.drop_job(job)
        self._drop(job)

    def release(self, tenant: str, job_id: str, keep: bool = False) -> int:
        """Unpin a job; drop its blocks unless `keep`. Returns the bytes freed."""
        job_key = JobKey(tenant, job_id)
        with self._lock:
            if self.spill is not None and not keep:
                self.spill.drop_job(job_key)
            job = self._jobs.get(job_key)
            if job is None:
                return 0
            job.pinned = False
            return 0 if keep else self._drop(job_key)

    def stats(self, tenant: str = "", job_id: str = "") -> StoreStats:
        """Totals, or those of one tenant / job. Counters are kept per tenant, not per job."""
        with self._lock:
            jobs = [j for jk, j in self._jobs.items()
                    if (not tenant or jk.tenant == tenant) and (not job_id or jk.job_id == job_id)]
            counters = self._total if not tenant else self._by_tenant.get(tenant, Counters())
            return StoreStats(
                **{f.name: getattr(counters, f.name) for f in fields(Counters)},
                capacity_bytes=self.capacity_bytes,
                used_bytes=sum(j.nbytes for j in jobs),
                blocks=sum(len(j.blocks) for j in jobs),
                jobs=len(jobs),
                pinned_jobs=sum(j.pinned for j in jobs),
                staged_bytes=self._staging.nbytes,
            )

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return self._block(key) is not None

    # -- internals ----------------------------------------------------------------------

    def _block(self, key: BlockKey) -> Block | None:
        job = self._jobs.get(key.job)
        return job.blocks.get(key) if job else None

    @staticmethod
    def _read(block: Block, idx: torch.Tensor | None) -> Rows:
        if idx is None:
            return block.all_rows()
        try:
            return block.gather(idx)
        except IndexError as e:
            raise ValueError(f"token_indices: {e}") from None

    def _make_room(self, needed: int, keep: JobKey) -> None:
        over = self._used + needed - self.capacity_bytes
        if over <= 0:
            return
        victims = [jk for jk, j in self._jobs.items() if not j.pinned and jk != keep]   # LRU first
        if sum(self._jobs[jk].nbytes for jk in victims) < over:
            pinned = sum(j.nbytes for j in self._jobs.values() if j.pinned)
            raise CapacityError(
                f"a put of {needed} bytes does not fit: capacity {self.capacity_bytes} bytes, "
                f"{self._used} used, {pinned} of them pinned by in-flight jobs")
        for jk in victims:
            if over <= 0:
                break
            self._spill(jk)
            over -= self._drop(jk)
            self._count(jk.tenant, "evictions")
            log.info("evicted job %s (least recently used) to fit %d bytes", jk, needed)

    def _spill(self, job_key: JobKey) -> None:
        """Write an evicted job's blocks to the spill tier (when there is one)."""
        if self.spill is None:
            return
        for key, block in self._jobs[job_key].blocks.items():
            self.spill.save(key, block.all_rows())
            self._count(key.tenant, "spilled")

    def _reload(self, key: BlockKey) -> Block | None:
        """A block of an evicted job, back from the spill tier into memory (unpinned), or None."""
        if self.spill is None:
            return None
        rows = self.spill.load(key)
        if rows is None:
            return None
        self._make_room(rows.nbytes, keep=key.job)
        job = self._jobs.setdefault(key.job, _Job())
        block = job.blocks[key] = Block(rows.positions, rows.k, rows.v)
        job.nbytes += block.nbytes
        self._used += block.nbytes
        self._count(key.tenant, "reloaded")
        return block

    def _drop(self, job_key: JobKey) -> int:
        job = self._jobs.pop(job_key)
        self._staging.drop_job(job_key)
        self._used -= job.nbytes
        if job.on_drop is not None:
            job.on_drop()
        return job.nbytes

    def drop_all(self) -> None:
        """Drop every job (the service is stopping): segments are unlinked."""
        with self._lock:
            for jk in list(self._jobs):
                self._drop(jk)

    def _touch(self, job: JobKey) -> None:
        self._jobs.move_to_end(job)
        self._jobs[job].touched = time.monotonic()

    def touch(self, job: JobKey) -> None:
        """A call about the job (a prefetch, a liveness check): its pin's lease starts again."""
        with self._lock:
            if job in self._jobs:
                self._touch(job)

    def expire(self, lease_s: float) -> list[JobKey]:
        """Drop the pinned jobs untouched for `lease_s` (their executor died, no attempt came back)."""
        now = time.monotonic()
        with self._lock:
            stale = [jk for jk, j in self._jobs.items() if j.pinned and now - j.touched > lease_s]
            for jk in stale:
                self._drop(jk)
        return stale

    def count(self, tenant: str, name: str) -> None:
        """Count one event of `name` (a Counters field) for `tenant`."""
        with self._lock:
            self._count(tenant, name)

    def _count(self, tenant: str, name: str) -> None:
        for counters in (self._total, self._by_tenant.setdefault(tenant, Counters())):
            setattr(counters, name, getattr(counters, name) + 1)
