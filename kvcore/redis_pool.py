"""Redis clients with a bounded pool, the one way kvplan's services connect to Redis.

redis-py's default pool opens up to 100 connections (more than a small Redis allows per client
budget, and each a file descriptor on both sides) and fails a command with "Too many
connections" once they are all busy. A `BlockingConnectionPool` of `max_connections` instead
makes a command wait up to `timeout_s` for a free connection: under a burst, calls queue in the
process, not in Redis (`KVPLAN_REDIS_MAX_CONNECTIONS`, `KVPLAN_REDIS_POOL_TIMEOUT_S`).
"""
from __future__ import annotations

import redis.asyncio as aioredis


def bounded(url: str, max_connections: int, timeout_s: float, **opts) -> aioredis.Redis:
    """An asyncio client whose pool holds at most `max_connections`; `opts` go to each connection
    (socket_timeout, retry, ...)."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s, **opts)
    return aioredis.Redis.from_pool(pool)
