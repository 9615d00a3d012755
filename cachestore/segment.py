"""A job's shared-memory segment: the offloaded rows of every (layer, KV head) and a staging area
for prefetched rows, in one file under /dev/shm that the cachestore and an executor on the same
host both map (MAP_SHARED). The executor writes rows and reads rows by offset — one-sided, like
RDMA; only control messages go over gRPC.

Layout (row-major, the storage dtype):
    k, v        [L, H, max_tokens, D]   row r of (layer, head) = the token at position r
    stage_k/_v  [L, 2, H, top_k, D]     a prefetch of step s lands in slot s % 2

Names are `kvplan-<tenant>-<job>-<random>` (the random part: a job id reused by another tenant,
or a job registered again, never maps the same file); files are created 0600. Unlinking the
file is what frees it; the mappings go when their tensors do.
"""
from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "kvplan-"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
LIMITS = {"layers": 512, "kv_heads": 256, "head_dim": 1024, "max_tokens": 1 << 20, "top_k": 1 << 16}


@dataclass(frozen=True)
class Layout:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_tokens: int
    top_k: int

    def __post_init__(self):
        for name, limit in LIMITS.items():
            if not 1 <= getattr(self, name) <= limit:
                raise ValueError(f"{name}: must be in [1, {limit}], got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def rows_numel(self) -> int:
        return self.layers * self.kv_heads * self.max_tokens * self.head_dim

    @property
    def stage_numel(self) -> int:
        return self.layers * 2 * self.kv_heads * self.top_k * self.head_dim

    @property
    def nbytes(self) -> int:
        return 2 * (self.rows_numel + self.stage_numel) * self.torch_dtype.itemsize


class NoSpace(Exception):
    """/dev/shm has no room for the segment (RESOURCE_EXHAUSTED)."""


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def segment_name(tenant: str, job_id: str) -> str:
    clean = lambda s: re.sub(r"[^A-Za-z0-9_.-]", "_", s)[:40]
    return f"{PREFIX}{clean(tenant)}-{clean(job_id)}-{secrets.token_hex(6)}"


class Segment:
    def __init__(self, name: str, layout: Layout, create: bool):
        """Create (the cachestore) or attach to (an executor) segment `name`; FileNotFoundError
        when attaching to a segment this host does not have."""
        self.name, self.layout = name, layout
        self.path = SHM_DIR / name
        if create:
            free = shm_free_bytes()
            if layout.nbytes > free:            # tmpfs files are sparse: a write past the space would SIGBUS
                raise NoSpace(f"{layout.nbytes} bytes of shared memory asked, {free} free in {SHM_DIR}")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, layout.nbytes)
            finally:
                os.close(fd)
        elif self.path.stat().st_size != layout.nbytes:
            raise ValueError(f"segment {name}: {self.path.stat().st_size} bytes, the layout needs {layout.nbytes}")
        try:
            raw = torch.from_file(str(self.path), shared=True, size=layout.nbytes, dtype=torch.uint8)
        except BaseException:
            if create:                          # never leave a file nobody maps
                self.unlink()
            raise
        flat = raw.view(layout.torch_dtype)
        L, H, T, D, K = layout.layers, layout.kv_heads, layout.max_tokens, layout.head_dim, layout.top_k
        n, m = layout.rows_numel, layout.stage_numel
        self.k = flat[:n].view(L, H, T, D)                       # [L, H, max_tokens, D]
        self.v = flat[n:2 * n].view(L, H, T, D)
        self.stage_k = flat[2 * n:2 * n + m].view(L, 2, H, K, D)   # [L, 2, H, top_k, D]
        self.stage_v = flat[2 * n + m:].view(L, 2, H, K, D)

    def gather(self, layer: int, slot: int, idx: torch.Tensor, rows: int) -> None:
        """Copy rows idx [H, k] (< rows) of `layer` into staging slot `slot` (vectorized)."""
        h, k = idx.shape
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            raise ValueError(f"token_indices: must be in [0, {rows}) (rows written), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        index = idx.unsqueeze(-1).expand(h, k, self.layout.head_dim)                  # [H, k, D]
        torch.gather(self.k[layer], 1, index, out=self.stage_k[layer, slot, :, :k])
        torch.gather(self.v[layer], 1, index, out=self.stage_v[layer, slot, :, :k])

    def unlink(self) -> None:
        """Remove the file (idempotent); mappings stay valid until their tensors go."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def leftovers() -> list[str]:
    """kvplan segments present on this host (tests check none leaks)."""
    return sorted(p.name for p in SHM_DIR.glob(PREFIX + "*"))


def mapped() -> set[str]:
    """Names of the kvplan segments some process on this host maps (from /proc/*/maps)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:                      # gone, or not ours to read
            continue
        names.update(line.rsplit("/", 1)[-1].removesuffix(" (deleted)") for line in text.splitlines()
                     if f"{SHM_DIR}/{PREFIX}" in line)
    return names


def sweep_orphans(min_age_s: float = 30.0) -> list[str]:
    """Unlink kvplan segments no process maps and older than `min_age_s`: left by a cachestore
    killed while the executor of the job had died too (each side unlinks what the other left
    otherwise). A cachestore calls it when it starts. -> the names unlinked"""
    now, live, gone = time.time(), mapped(), []
    for path in SHM_DIR.glob(PREFIX + "*"):
        try:
            if path.name not in live and now - path.stat().st_mtime > min_age_s:
                path.unlink()
                gone.append(path.name)
        except FileNotFoundError:
            pass
    return gone
