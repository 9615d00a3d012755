"""The embedded default: the planner, cachestore and executor servicers in this process, each on
an ephemeral loopback port, reached through the same gRPC client as a real cluster."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

from kvcore.config import CachestoreConfig, ExecutorConfig, ModelConfig, PlannerConfig, SecurityConfig, from_env
from kvcore import serving


class Embedded:
    """`with Embedded() as e: ExecutorClient(e.executor_addr)`. Starts in a background thread."""

    def __init__(self, model_cfg: ModelConfig | None = None, ready_timeout_s: float = 600.0,
                 planner_addr: str | None = None, redis_url: str = ""):
        """planner_addr: use that planner instead of starting one here; redis_url: keep the job
        queue in that Redis (default: in process)."""
        self.model_cfg = model_cfg or from_env(ModelConfig)
        self.external_planner = planner_addr
        self.redis_url = redis_url
        self.ready_timeout_s = ready_timeout_s
        self.addresses: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvplan-embedded", daemon=True)
        self._servers: list = []

    @property
    def executor_addr(self) -> str:
        return self.addresses["executor"]

    @property
    def planner_addr(self) -> str:
        return self.addresses["planner"]

    def __enter__(self) -> "Embedded":
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(self.ready_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(60)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _start(self) -> None:
        # In-process everything: no Redis (unless asked for the queue), ephemeral ports, no metrics HTTP servers.
        from cachestore.service import build_service as cachestore_service
        from executor.service import build_service as executor_service
        from planner.service import build_service as planner_service

        local = dict(host="127.0.0.1", port=0, metrics_port=0)
        if self.external_planner:
            self.addresses["planner"] = self.external_planner
        else:
            pcfg = dataclasses.replace(from_env(PlannerConfig), redis_url="", **local)
            await self._add("planner", planner_service(pcfg), pcfg)
        ccfg = dataclasses.replace(from_env(CachestoreConfig), **local)
        await self._add("cachestore", cachestore_service(ccfg), ccfg)
        ecfg = dataclasses.replace(from_env(ExecutorConfig), redis_url=self.redis_url, planner_addr=self.planner_addr,
                                   cachestore_addr=self.addresses["cachestore"], **local)
        await self._add("executor", executor_service(ecfg, self.model_cfg), ecfg)
        for _, svc in self._servers:
            error = await asyncio.wait_for(svc.warm_task, self.ready_timeout_s)
            if error is not None:
                raise RuntimeError(f"embedded {svc.name} failed to start: {error}")

    async def _add(self, name: str, svc: serving.Service, cfg) -> None:
        # loopback, ephemeral ports, this process only: the one setup that runs without API keys
        security = dataclasses.replace(from_env(SecurityConfig), auth="off")
        server, port = await serving.start(svc, cfg, with_metrics=False, security=security)
        self._servers.append((server, svc))
        self.addresses[name] = f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        for server, svc in reversed(self._servers):
            await serving.shutdown(server, svc, grace_s=1.0)
