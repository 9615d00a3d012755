"""Run one kvplan service in the foreground: `kvplan serve NAME` / `python -m NAME`.

The service is built inside the event loop it serves on (gRPC aio channels and Redis clients
bind to the loop that creates them)."""
from __future__ import annotations

import asyncio
import importlib

from kvplan.config import CachestoreConfig, ExecutorConfig, ModelConfig, PlannerConfig, from_env
from kvplan.serving import configure_logging, serve_forever

CONFIGS = {"planner": PlannerConfig, "executor": ExecutorConfig, "cachestore": CachestoreConfig}


def build(name: str, cfg):
    build_service = importlib.import_module(f"{name}.service").build_service
    return build_service(cfg, from_env(ModelConfig)) if name == "executor" else build_service(cfg)


def run(name: str) -> int:
    cfg = from_env(CONFIGS[name])
    configure_logging(cfg.log_level.upper())

    async def main() -> int:
        return await serve_forever(build(name, cfg), cfg)

    return asyncio.run(main())
