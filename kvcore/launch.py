"""Run one kvplan service in the foreground: `python -m NAME` / `kvplan serve NAME` (each
service's `__main__.main`, which hands its config class and its builder here).

The service is built inside the event loop it serves on (gRPC aio channels and Redis clients
bind to the loop that creates them)."""
from __future__ import annotations

import asyncio
from typing import Callable

from kvcore.config import ServiceConfig, from_env
from kvcore.serving import Service, configure_logging, serve_forever


def run(config: type[ServiceConfig], build_service: Callable[[ServiceConfig], Service]) -> int:
    """Serve `build_service(cfg)`, cfg read from the env, until SIGTERM/SIGINT -> exit status."""
    cfg = from_env(config)
    configure_logging(cfg.log_level.upper())

    async def main() -> int:
        return await serve_forever(build_service(cfg), cfg)

    return asyncio.run(main())
