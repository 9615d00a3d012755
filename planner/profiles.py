"""Profile mode for probing strategies (XKV's online mode, spec xkv.md summary 5): jobs that
carry a profile name share what their probes learned. The planner probes a sample of a
profile's jobs — the first, then every round(1/sample)-th, counted across replicas — keeps the
running mean of the per-layer budget shares [m] those probes chose, and plans the others from
it without probing. A job without a profile probes every time (per-request mode).

A profile's statistics are kept per (profile, strategy@version, model fingerprint, layers): a
new strategy version or another model starts afresh. In process, or in Redis (a job counter
and a hash of sums per key) so planner replicas share them."""
from __future__ import annotations

import numpy as np

from kvcore.redis_pool import bounded

PREFIX = "kvplan:planner:profile:"


def key(profile: str, strategy: str, version: str, fingerprint: str, num_layers: int) -> str:
    return f"{profile}|{strategy}@{version}|{fingerprint}|{num_layers}"


def sampled(index: int, sample: float) -> bool:
    """Whether the `index`-th job (0-based) of a profile is probed: the first, then every
    round(1/sample)-th."""
    return index % max(1, round(1.0 / sample)) == 0


class MemoryProfiles:
    def __init__(self):
        self._jobs: dict[str, int] = {}
        self._sums: dict[str, tuple[np.ndarray, int]] = {}

    async def next_job(self, k: str) -> int:
        """Count one more job of the key; -> its 0-based index."""
        self._jobs[k] = self._jobs.get(k, 0) + 1
        return self._jobs[k] - 1

    async def shares(self, k: str) -> np.ndarray | None:
        """The mean of the shares added under the key [m], or None before the first."""
        if k not in self._sums:
            return None
        total, n = self._sums[k]
        return total / n

    async def add(self, k: str, shares: np.ndarray) -> None:
        total, n = self._sums.get(k, (np.zeros(len(shares)), 0))
        self._sums[k] = (total + np.asarray(shares, dtype=np.float64), n + 1)

    async def close(self) -> None:
        pass


class RedisProfiles:
    """Per key: `<prefix><key>:jobs` (INCR) and `<prefix><key>:sum` (hash: "n" and one field per
    layer, incremented together in one transaction)."""

    def __init__(self, url: str, max_connections: int = 16, pool_timeout_s: float = 5.0):
        self._r = bounded(url, max_connections, pool_timeout_s)

    async def next_job(self, k: str) -> int:
        return int(await self._r.incr(PREFIX + k + ":jobs")) - 1

    async def shares(self, k: str) -> np.ndarray | None:
        raw = await self._r.hgetall(PREFIX + k + ":sum")
        n = int(raw.pop(b"n", 0))
        if not n:
            return None
        return np.array([float(raw[str(i).encode()]) for i in range(len(raw))]) / n

    async def add(self, k: str, shares: np.ndarray) -> None:
        async with self._r.pipeline(transaction=True) as p:
            for i, s in enumerate(np.asarray(shares, dtype=np.float64)):
                p.hincrbyfloat(PREFIX + k + ":sum", str(i), float(s))
            p.hincrby(PREFIX + k + ":sum", "n", 1)
            await p.execute()

    async def close(self) -> None:
        await self._r.aclose()


def open_profiles(redis_url: str, max_connections: int = 16, pool_timeout_s: float = 5.0):
    return RedisProfiles(redis_url, max_connections, pool_timeout_s) if redis_url else MemoryProfiles()
