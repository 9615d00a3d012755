"""The job queue: a backend chosen from a URL's scheme, as LMCache chooses its connectors.

    ""  or  memory://            in process (`executor.memory_jobs`: the embedded default)
    redis:// rediss:// unix://   Redis Streams with a consumer group (`executor.redis_jobs`)

The interface and the types both backends share live in `executor.job_backend` (re-exported
here), so neither backend imports this module."""
from __future__ import annotations

from typing import Callable
from urllib.parse import urlsplit

from executor.job_backend import (PATIENCE, QUEUE_FULL_RETRY_S, Claim, JobBackend, Limits, QueueFull,  # noqa: F401
                                  QueueUnavailable, check_bounds)
from executor.memory_jobs import MemoryJobs
from executor.redis_jobs import RedisJobs

# URL scheme -> (url, consumer group, claim idle ms) -> backend
BACKENDS: dict[str, Callable[[str, str, int], JobBackend]] = {
    "memory": lambda url, group, idle_ms: MemoryJobs(),
    **{scheme: lambda url, group, idle_ms: RedisJobs(url, group=group, claim_idle_ms=idle_ms)
       for scheme in ("redis", "rediss", "unix")},
}


def open_backend(url: str, group: str = "executors", claim_idle_ms: int = 15000) -> JobBackend:
    """The backend `url` names; an empty URL is the in-process one."""
    scheme = urlsplit(url).scheme if url else "memory"
    make = BACKENDS.get(scheme)
    if make is None:
        raise ValueError(f"job queue URL {url!r}: scheme {scheme!r} is not one of {', '.join(sorted(BACKENDS))}")
    return make(url, group, claim_idle_ms)
