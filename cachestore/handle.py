"""What the executor sees of the cachestore for one job: a `JobHandle`.

A SpeCache job offloads the full-precision K/V of every token, layer by layer, and reads back
a few rows per (layer, KV head) each decode step. Row r of a layer is the token at position r
(every token is offloaded, in order). The handle hides the transport:

- `local`: in this process (tests, the benches' direct runs, an executor without a cachestore);
- `shm`: a shared-memory segment the cachestore registered for the job; rows are written and
  read by offset, gRPC carries only control messages (`cachestore.client`);
- `grpc`: chunked gRPC streams when the cachestore is on another host (`cachestore.client`).

`prefetch` never blocks; `take` returns the rows of a prefetch if they arrived (waiting at most
`wait_s`), else None — the caller then attends over its low-bit copy for that layer. A handle
whose store went away sets `failed` and from then on stores nothing and fetches nothing; the
job finishes on its low-bit copy, degraded.

Shapes: H = KV heads, T new rows, N rows held, k rows per head of one prefetch, D head dim.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvcore import threads


class StoreUnavailable(RuntimeError):
    """The cachestore cannot be reached, or went away during the job."""


@dataclass
class TransferStats:
    """Per job, counted by the executor's handle."""
    prefetches: int = 0        # prefetches issued
    in_time: int = 0           # taken, and ready when taken
    late: int = 0              # not ready when taken (waited past `wait_s`, or failed)
    waited: int = 0            # ready only after the taker waited for it (counted in in_time too)
    bytes_fetched: int = 0     # bytes of K/V rows prefetched
    bytes_put: int = 0         # bytes of K/V rows offloaded
    stall_s: float = 0.0       # time `take` spent waiting


@dataclass(frozen=True)
class Fetched:
    idx: torch.Tensor          # [H, k] int64 rows (= token positions) the rows are
    k: torch.Tensor            # [H, k, D] storage dtype
    v: torch.Tensor            # [H, k, D]
    moved: int = 0             # bytes brought over for them (re-ranked candidates included); 0: k's and v's

    @property
    def bytes_moved(self) -> int:
        return self.moved or self.k.nbytes + self.v.nbytes

    def rerank(self, query: torch.Tensor, keep: int) -> "Fetched":
        """The `keep` rows per head of most attention from query [H, h_n, D] (pre-scaled; the
        GQA group's mean of its softmax over these rows) -> [H, keep] rows, their bytes moved
        still counting every candidate's."""
        probs = torch.softmax(torch.einsum("ghd,gcd->ghc", query.float(), self.k.float()), dim=-1).mean(1)   # [H, C]
        top = probs.topk(keep, dim=-1).indices                                                 # [H, keep]
        rows = top.unsqueeze(-1).expand(-1, -1, self.k.shape[-1])                               # [H, keep, D]
        return Fetched(self.idx.gather(1, top), self.k.gather(1, rows), self.v.gather(1, rows), self.bytes_moved)


@dataclass
class JobHandle:
    """Base: bookkeeping shared by the transports. Subclasses implement `_put`, `_read`,
    `_gather` and `_release`; `_gather` runs on the handle's prefetch thread."""
    transport: str = "local"
    stats: TransferStats = field(default_factory=TransferStats)
    failed: bool = False
    error: str = ""

    def __post_init__(self):
        self._pending: dict[tuple[int, int], Future] = {}    # (layer, step) -> Future[Fetched]
        # one OpenMP thread on the prefetch thread (`kvcore.threads.one`: that thread's alone, where
        # torch.set_num_threads(1) also set torch's process-wide count the engine's ops read): its
        # gathers and re-ranks are small, and an OpenMP team per job's prefetch thread spin-waits
        # on the cores the engine's step computes on
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvplan-prefetch",
                                        initializer=threads.one)
        self._lock = threading.Lock()

    # -- the executor's calls -----------------------------------------------------------

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append rows: k, v [H, T, D] (storage dtype), the next T positions of `layer`."""
        if self.failed:
            return
        try:
            self._put(layer, k, v)
            self.stats.bytes_put += k.nbytes + v.nbytes
        except StoreUnavailable as e:
            self._fail(e)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row of `layer`: k, v [H, N, D]; None once the store has failed."""
        if self.failed:
            return None
        try:
            return self._read(layer)
        except StoreUnavailable as e:
            self._fail(e)
            return None

    def prefetch(self, layer: int, step: int, idx: torch.Tensor, query: torch.Tensor | None = None,
                 keep: int | None = None) -> None:
        """Start gathering rows idx [H, k] (int64) of `layer` for the `take` of `step`. With a
        `query` [H, h_n, D] (pre-scaled), idx are candidates: the prefetch thread keeps the `keep`
        of them per head the query attends to most over their exact keys (`Fetched.rerank`)."""
        if self.failed:
            return
        idx = idx.to(torch.int64).contiguous()
        with self._lock:
            for key in [key for key in self._pending if key[0] == layer and key[1] < step]:
                self._pending.pop(key).cancel()          # an older step's rows nobody took
            self._pending[(layer, step)] = self._pool.submit(self._fetch, layer, idx, query, keep)
        self.stats.prefetches += 1

    def _fetch(self, layer: int, idx: torch.Tensor, query: torch.Tensor | None, keep: int | None) -> Fetched:
        """On the prefetch thread: the rows, re-ranked when a query came with them."""
        got = self._gather(layer, idx)
        if query is None or keep is None or keep >= idx.shape[1]:
            return got
        return got.rerank(query, keep)

    def take(self, layer: int, step: int, wait_s: float) -> Fetched | None:
        """The rows prefetched for (layer, step) if they arrive within `wait_s`, else None."""
        with self._lock:
            fut = self._pending.pop((layer, step), None)
        if fut is None:
            return None
        if not fut.done():
            t0 = time.perf_counter()
            try:
                fut.exception(timeout=wait_s)          # waits; raises TimeoutError if still running
                self.stats.waited += 1
            except Exception:
                pass
            self.stats.stall_s += time.perf_counter() - t0
        if not fut.done():
            self.stats.late += 1
            return None
        error = fut.exception()
        if error is not None:
            if not isinstance(error, StoreUnavailable):
                raise error
            self._fail(error)
            self.stats.late += 1
            return None
        fetched = fut.result()
        self.stats.in_time += 1
        self.stats.bytes_fetched += fetched.bytes_moved
        return fetched

    def release(self) -> None:
        """End of the job (finished, failed or cancelled): drop its rows and resources."""
        with self._lock:
            for fut in self._pending.values():
                fut.cancel()
            self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self._release()
        except StoreUnavailable as e:
            self._fail(e)

    # -- transports ---------------------------------------------------------------------

    def _put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _gather(self, layer: int, idx: torch.Tensor) -> Fetched:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def _fail(self, e: Exception) -> None:
        if not self.failed:
            self.failed, self.error = True, str(e)


class LocalHandle(JobHandle):
    """Rows in this process's memory, per layer k, v [H, capacity, D] grown by appends (the
    capacity doubles, so a decode step's one-row append copies nothing and a read is a view)."""

    def __init__(self):
        super().__init__(transport="local")
        self._rows_lock = threading.Lock()      # the prefetch thread reads while the job appends
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._n: dict[int, int] = {}

    def _put(self, layer, k, v):
        with self._rows_lock:
            n, t = self._n.get(layer, 0), k.shape[1]
            if layer not in self._k or n + t > self._k[layer].shape[1]:
                cap = max(2 * (n + t), 64)
                for rows, x in ((self._k, k), (self._v, v)):
                    grown = x.new_empty(x.shape[0], cap, x.shape[2])
                    if layer in rows:
                        grown[:, :n] = rows[layer][:, :n]
                    rows[layer] = grown
            self._k[layer][:, n:n + t] = k.detach()
            self._v[layer][:, n:n + t] = v.detach()
            self._n[layer] = n + t

    def _read(self, layer):
        with self._rows_lock:
            if layer not in self._k:
                raise StoreUnavailable(f"layer {layer}: nothing offloaded")
            n = self._n[layer]
            return self._k[layer][:, :n], self._v[layer][:, :n]

    def _gather(self, layer, idx):
        k, v = self._read(layer)                                   # [H, N, D]
        index = idx.unsqueeze(-1).expand(-1, -1, k.shape[-1])      # [H, k, D]
        return Fetched(idx, torch.gather(k, 1, index), torch.gather(v, 1, index))

    def _release(self):
        self._k.clear()
        self._v.clear()
        self._n.clear()


class Unavailable(JobHandle):
    """The handle of a job whose cachestore could not be reached at its start: failed from the
    outset, so the job runs on its low-bit copy alone (degraded)."""

    def __init__(self, error: str):
        super().__init__(transport="none", failed=True, error=error)

    def _release(self):
        pass
