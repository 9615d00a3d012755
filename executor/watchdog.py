"""The executor's health watchdog: health follows what the executor can do now, re-checked every
interval, so no state of it outlives its cause.

- the job queue's store: NOT_SERVING while Redis does not answer (`backend.ping()`, on a
  connection of its own with a timeout: a busy pool or a flood of watchers is no outage),
  SERVING again once it does (its consumer group made again if it was lost);
- the event hub (the one reader of every watched job's events): started again if it ended;
- the health status is set every interval, not only on a change, so a status another path left
  behind is put right within one interval; and an error inside a check is logged and the loop
  goes on, so the watchdog itself never stops.

Before issue 33 a flood of watchers took every pooled Redis connection, the health check's ping
failed with "Too many connections", and health stayed NOT_SERVING for minutes after the clients
had left.
"""
from __future__ import annotations

import asyncio
import logging

from kvcore.serving import Service, set_health

log = logging.getLogger("kvplan.executor.watchdog")


async def watch(backend, svc: Service, interval_s: float = 1.0) -> None:
    up = True
    while True:
        try:
            ok = await backend.ping()
            hub = getattr(backend, "hub", None)
            if ok and hub is not None and hub.watched() and not hub.alive:
                log.warning("the event reader had stopped; starting it again")
                hub.start()
            if ok != up:
                log.warning("job queue %s: health %s", "reachable again" if ok else "unreachable",
                            "SERVING" if ok else "NOT_SERVING")
            up = ok
            await set_health(svc, ok)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("health check failed; checking again in %.1fs", interval_s)
        await asyncio.sleep(interval_s)
