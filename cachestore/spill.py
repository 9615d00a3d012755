"""The optional Redis spill tier: the blocks of a job the LRU evicts are written to Redis (with
a TTL), and a later read of such a block loads it back — so a resumed or repeated job reloads
its rows instead of recomputing them. Keys carry the tenant (`kvplan:spill:<tenant>:<job>:...`),
so one tenant's read never finds another's rows. `KVPLAN_CACHESTORE_REDIS_URL` turns it on."""
from __future__ import annotations

import numpy as np
import redis
import torch

from cachestore.block import Rows
from cachestore.keys import BlockKey, JobKey
from cachestore.tensor_codec import DTYPES, NAMES


def _job_key(job: JobKey) -> str:
    return f"kvplan:spill:{len(job.tenant)}:{job.tenant}:{job.job_id}"     # length-prefixed: no ambiguity


def _block_key(key: BlockKey) -> str:
    return f"{_job_key(key.job)}:{key.layer}:{key.kv_head}"


class RedisSpill:
    def __init__(self, url: str, ttl_s: int = 3600, max_connections: int = 16, pool_timeout_s: float = 5.0):
        """A bounded pool (KVPLAN_REDIS_MAX_CONNECTIONS): a call waits for a free connection."""
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=pool_timeout_s)
        self.r = redis.Redis(connection_pool=pool)
        self.ttl_s = ttl_s

    def save(self, key: BlockKey, rows: Rows) -> None:
        """rows: positions [N] int64, k, v [N, D]."""
        name, index = _block_key(key), _job_key(key.job)
        with self.r.pipeline() as p:
            p.hset(name, mapping={"dtype": NAMES[rows.k.dtype], "shape": f"{rows.k.shape[0]},{rows.k.shape[1]}",
                                  "positions": rows.positions.numpy().tobytes(),
                                  "k": rows.k.contiguous().view(torch.uint8).numpy().tobytes(),
                                  "v": rows.v.contiguous().view(torch.uint8).numpy().tobytes()})
            p.expire(name, self.ttl_s)
            p.sadd(index, name)
            p.expire(index, self.ttl_s)
            p.execute()

    def load(self, key: BlockKey) -> Rows | None:
        got = self.r.hgetall(_block_key(key))
        if not got:
            return None
        n, d = map(int, got[b"shape"].split(b","))
        dtype = DTYPES[got[b"dtype"].decode()]
        as_rows = lambda b: torch.from_numpy(np.frombuffer(b, dtype=np.uint8).copy()).view(dtype).view(n, d)
        positions = torch.from_numpy(np.frombuffer(got[b"positions"], dtype=np.int64).copy())
        return Rows(positions, as_rows(got[b"k"]), as_rows(got[b"v"]))

    def drop_job(self, job: JobKey) -> None:
        index = _job_key(job)
        names = self.r.smembers(index)
        if names:
            self.r.delete(*names)
        self.r.delete(index)

    def close(self) -> None:
        self.r.close()
