"""One reader of Redis event streams per process, fanning their entries out to local waiters.

A job's events live in a Redis Stream (`kvplan:job:{id}:events`); every stream that follows a
job (`Generate`, `WatchJob`) waits for its next entries. A blocking XREAD per waiter holds one
Redis connection per watching stream: 100 watchers took the whole pool (issue 33: "Too many
connections", health NOT_SERVING for minutes). Here one task holds one connection and reads
every watched stream with a single blocking XREAD; waiters wait on futures.

    wait(key, after, timeout_s) -> [(id, fields)]     entries of `key` after id `after`

Per key the hub keeps a subscription: its cursor (the last id it read), a bounded buffer of the
entries it read (every entry after `start`, so a waiter that comes back with the id it last saw
is answered from memory) and its waiters. A waiter whose `after` the buffer does not cover (a
replay from "0", or a key seen for the first time) reads once with a plain XRANGE through the
shared pool (a short command, no blocking) and, when that finds nothing new, subscribes. A
subscription nobody waited on for `linger_s` is dropped.

A key subscribed while the reader blocks would wait for the block to end: the hub interrupts
the read (`CLIENT UNBLOCK` of the reader's connection, sent through the pool), so a new stream's
first event is not late. While Redis is unreachable the reader retries with backoff; the
waiters' own timeouts end their waits, and their callers look at the job's status as before.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

log = logging.getLogger("kvplan.executor.events")
Entry = tuple[str, dict]


def parse_id(stream_id: str) -> tuple[int, int]:
    """A stream id ("ms-seq", or "ms", or "0") as a comparable pair."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class _Waiter:
    after: tuple[int, int]
    future: asyncio.Future


@dataclass(eq=False)
class _Subscription:
    start: tuple[int, int]                 # every entry after this id is in `buffer`
    cursor: str                            # the last id the reader read (or `start`)
    buffer: collections.deque = field(default_factory=collections.deque)     # (parsed id, Entry)
    waiters: set = field(default_factory=set)
    used: float = field(default_factory=time.monotonic)

    def after(self, after: tuple[int, int]) -> list[Entry]:
        return [e for pid, e in self.buffer if pid > after]


class EventHub:
    def __init__(self, reader: Callable[[], object], pool, xrange: Callable[[str, str, int], Awaitable[list]],
                 block_ms: int = 2000, count: int = 512, buffer: int = 256, linger_s: float = 5.0):
        """reader(): a Redis client with one connection of its own (the blocking reads'); pool: the
        shared client (the reads that catch up, and CLIENT UNBLOCK); xrange(key, after, count):
        the entries after id `after` (exclusive), through the pool with its retries."""
        self._make_reader, self._pool, self._xrange = reader, pool, xrange
        self.block_ms, self.count, self.buffer_max, self.linger_s = block_ms, count, buffer, linger_s
        self._subs: dict[str, _Subscription] = {}
        self._news = asyncio.Event()          # a subscription was added (the reader may be idle)
        self._task: asyncio.Task | None = None
        self._conn = None
        self._client_id: int | None = None
        self._blocking = False                # the reader is inside its XREAD
        self._round = 0                       # XREADs issued; a kick stops once a newer one started
        self._kick_task: asyncio.Task | None = None
        self.reads = 0                        # XREADs done (tests and the watchdog read it)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvplan-event-hub")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        for task in (self._task, self._kick_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.aclose()
            self._conn = None
        for sub in self._subs.values():
            for w in sub.waiters:
                if not w.future.done():
                    w.future.set_result([])

    # -- waiting -----------------------------------------------------------------------------
    async def wait(self, key: str, after: str, timeout_s: float) -> list[Entry]:
        """Entries of `key` after id `after`, waiting up to `timeout_s` for the first one."""
        pafter = parse_id(after)
        sub = self._subs.get(key)
        if sub is None or pafter < sub.start:
            got = await self._xrange(key, after, self.count)
            if got:
                return got
            sub = self._subs.get(key)             # (the read may have let another waiter subscribe)
            if sub is None:
                sub = self._subs[key] = _Subscription(start=pafter, cursor=after)
                self._interrupt()
            elif pafter < sub.start:              # nothing after `after` exists: the buffer is empty too
                sub.start = pafter
        sub.used = time.monotonic()
        ready = sub.after(pafter)
        if ready:
            return ready
        w = _Waiter(pafter, asyncio.get_running_loop().create_future())
        sub.waiters.add(w)
        self.start()
        try:
            return await asyncio.wait_for(w.future, timeout_s)
        except asyncio.TimeoutError:
            return []
        finally:
            sub.waiters.discard(w)
            sub.used = time.monotonic()

    def watched(self) -> int:
        """Keys the reader reads now."""
        return len(self._subs)

    # -- the reader ----------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 0.05
        while True:
            self._expire()
            if not self._subs:
                self._news.clear()
                await self._news.wait()
                continue
            try:
                if self._conn is None or self._client_id is None:
                    self._conn = self._conn or self._make_reader()
                    self._client_id = int(await self._conn.client_id())
                streams = {key: sub.cursor for key, sub in self._subs.items()}
                self._round += 1
                self._blocking = True
                try:
                    got = await self._conn.xread(streams, count=self.count, block=self.block_ms)
                finally:
                    self._blocking = False
                self.reads += 1
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as e:                 # Redis unreachable, or a reply we cannot read
                self._client_id = None             # a new connection gets a new id
                log.warning("event reader: %s: %s; retrying in %.2fs", type(e).__name__, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            for key, entries in got or []:
                self._deliver(key.decode() if isinstance(key, bytes) else key, entries)

    def _deliver(self, key: str, entries: list) -> None:
        sub = self._subs.get(key)
        if sub is None or not entries:
            return
        for eid, fields in entries:
            eid = eid.decode() if isinstance(eid, bytes) else eid
            sub.buffer.append((parse_id(eid), (eid, fields)))
            sub.cursor = eid
        while len(sub.buffer) > self.buffer_max:
            sub.start = sub.buffer.popleft()[0]
        for w in list(sub.waiters):
            ready = sub.after(w.after)
            if ready and not w.future.done():
                w.future.set_result(ready)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._subs.items() if not s.waiters and now - s.used > self.linger_s]:
            del self._subs[key]

    def _interrupt(self) -> None:
        """A key joined: wake an idle reader, or end its blocking read so the next one has the key."""
        self._news.set()
        if self._blocking and (self._kick_task is None or self._kick_task.done()):
            self._kick_task = asyncio.get_running_loop().create_task(self._kick(self._round))

    async def _kick(self, round_: int) -> None:
        # CLIENT UNBLOCK may reach Redis before the XREAD it means (the read was sent but not
        # yet blocking): try again briefly until that read ended or a newer one started.
        for _ in range(50):
            if self._round != round_ or not self._blocking or self._client_id is None:
                return
            try:
                if await self._pool.client_unblock(self._client_id):
                    return
            except Exception:
                return                              # the reader's own timeout ends the read
            await asyncio.sleep(0.002)
