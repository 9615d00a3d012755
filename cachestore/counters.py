"""What the cachestore counts: per-tenant event counters and the totals `BlockStore.stats` reports."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    hits: int = 0            # gets of a block that exists
    misses: int = 0          # gets of a block that does not (evicted, released, other tenant)
    evictions: int = 0       # jobs evicted for capacity
    prefetches: int = 0      # prefetches accepted (the block existed)
    prefetch_hits: int = 0   # gets served from the staging area
    spilled: int = 0         # blocks of evicted jobs written to the spill tier
    reloaded: int = 0        # blocks read back from it


@dataclass(frozen=True)
class StoreStats:
    hits: int
    misses: int
    evictions: int
    prefetches: int
    prefetch_hits: int
    spilled: int = 0
    reloaded: int = 0
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    jobs: int = 0
    pinned_jobs: int = 0
    staged_bytes: int = 0
