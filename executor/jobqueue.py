"""The job queue: a backend chosen from a URL's scheme, as LMCache chooses its connectors.

    ""  or  memory://            in process (`executor.memory_jobs`: the embedded default)
    redis:// rediss:// unix://   Redis Streams with a consumer group (`executor.redis_jobs`)

The interface and the types both backends share live in `executor.job_backend`, so neither
backend imports this module."""
from __future__ import annotations

from typing import Callable
from urllib.parse import urlsplit

from executor.job_backend import JobBackend
from executor.memory_jobs import MemoryJobs
from executor.redis_jobs import RedisJobs

# URL scheme -> (url, consumer group, claim idle ms, options) -> backend. Options: max_connections,
# pool_timeout_s (Redis), weight (a tenant's share in fair claiming).
BACKENDS: dict[str, Callable[..., JobBackend]] = {
    "memory": lambda url, group, idle_ms, weight=None, **_: MemoryJobs(weight),
    **{scheme: lambda url, group, idle_ms, **opts: RedisJobs(url, group=group, claim_idle_ms=idle_ms, **opts)
       for scheme in ("redis", "rediss", "unix")},
}


def open_backend(url: str, group: str = "executors", claim_idle_ms: int = 15000, **opts) -> JobBackend:
    """The backend `url` names; an empty URL is the in-process one. `opts`: max_connections and
    pool_timeout_s (the Redis pool's bounds), weight(tenant) -> its share in fair claiming."""
    scheme = urlsplit(url).scheme if url else "memory"
    make = BACKENDS.get(scheme)
    if make is None:
        raise ValueError(f"job queue URL {url!r}: scheme {scheme!r} is not one of {', '.join(sorted(BACKENDS))}")
    return make(url, group, claim_idle_ms, **opts)
