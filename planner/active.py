"""Where the active (default) strategy and the custom definitions live: in process, or in Redis
so planner replicas agree. Definitions are stored as canonical JSON text, keyed by name."""
from __future__ import annotations

from kvcore.redis_pool import bounded

ACTIVE_KEY = "kvplan:planner:active_strategy"
DEFINITIONS_KEY = "kvplan:planner:definitions"     # hash: name -> definition JSON


class MemoryActive:
    def __init__(self, default: str):
        self._name = default
        self._definitions: dict[str, str] = {}

    async def get(self) -> str:
        return self._name

    async def set(self, name: str) -> None:
        self._name = name

    async def definitions(self) -> dict[str, str]:
        return dict(self._definitions)

    async def define(self, name: str, text: str, activate: bool = False) -> None:
        """Register (or replace) a definition; with `activate`, make it active."""
        self._definitions[name] = text
        if activate:
            self._name = name

    async def delete(self, name: str, fallback: str) -> bool:
        """Remove a definition (False: there is none); if it was active, `fallback` is."""
        if self._definitions.pop(name, None) is None:
            return False
        if self._name == name:
            self._name = fallback
        return True

    async def close(self) -> None:
        pass


_DELETE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('SET', KEYS[2], ARGV[2]) end
return 1
"""


class RedisActive:
    """The active strategy in one Redis key, the definitions in one hash; the first planner up
    seeds the active key with its default."""

    def __init__(self, url: str, default: str, max_connections: int = 16, pool_timeout_s: float = 5.0):
        self._r = bounded(url, max_connections, pool_timeout_s)
        self._default = default

    async def get(self) -> str:
        await self._r.set(ACTIVE_KEY, self._default, nx=True)
        raw = await self._r.get(ACTIVE_KEY)
        return raw.decode() if raw else self._default

    async def set(self, name: str) -> None:
        await self._r.set(ACTIVE_KEY, name)

    async def definitions(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in (await self._r.hgetall(DEFINITIONS_KEY)).items()}

    async def define(self, name: str, text: str, activate: bool = False) -> None:
        """Register (or replace) a definition; with `activate`, make it active in the same transaction."""
        async with self._r.pipeline(transaction=True) as p:
            p.hset(DEFINITIONS_KEY, name, text)
            if activate:
                p.set(ACTIVE_KEY, name)
            await p.execute()

    async def delete(self, name: str, fallback: str) -> bool:
        """Remove a definition (False: there is none); if it was active, `fallback` is (one
        script, so a planner replica never sees the active name without its definition)."""
        return bool(await self._r.eval(_DELETE, 2, DEFINITIONS_KEY, ACTIVE_KEY, name, fallback))

    async def close(self) -> None:
        await self._r.aclose()


def open_active(redis_url: str, default: str, max_connections: int = 16, pool_timeout_s: float = 5.0):
    return RedisActive(redis_url, default, max_connections, pool_timeout_s) if redis_url else MemoryActive(default)
