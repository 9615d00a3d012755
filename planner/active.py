"""Where the active (default) strategy lives: in process, or in Redis so planner replicas agree."""
from __future__ import annotations

import redis.asyncio as aioredis

ACTIVE_KEY = "kvplan:planner:active_strategy"


class MemoryActive:
    def __init__(self, default: str):
        self._name = default

    async def get(self) -> str:
        return self._name

    async def set(self, name: str) -> None:
        self._name = name

    async def close(self) -> None:
        pass


class RedisActive:
    """The active strategy in one Redis key; the first planner up seeds it with its default."""

    def __init__(self, url: str, default: str):
        self._r = aioredis.from_url(url)
        self._default = default

    async def get(self) -> str:
        await self._r.set(ACTIVE_KEY, self._default, nx=True)
        raw = await self._r.get(ACTIVE_KEY)
        return raw.decode() if raw else self._default

    async def set(self, name: str) -> None:
        await self._r.set(ACTIVE_KEY, name)

    async def close(self) -> None:
        await self._r.aclose()


def open_active(redis_url: str, default: str):
    return RedisActive(redis_url, default) if redis_url else MemoryActive(default)
