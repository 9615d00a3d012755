"""Host-memory KV store: blocks per (tenant, job, layer, kv-head), LRU + pins, prefetch staging."""
from cachestore.block import Rows
from cachestore.keys import BlockKey, JobKey
from cachestore.store import BlockStore, CapacityError, StoreStats

__all__ = ["BlockKey", "BlockStore", "CapacityError", "JobKey", "Rows", "StoreStats"]
