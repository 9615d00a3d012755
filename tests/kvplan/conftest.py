"""The embedded services with the real model (one per session of these tests), and the HTTP
gateway served by uvicorn in a thread on a free loopback port."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from kvcore.config import HttpConfig


@pytest.fixture(scope="session")
def embedded(model_cfg, real_model_dir):
    from kvplan.embedded import Embedded
    with Embedded(model_cfg) as e:
        yield e


@contextlib.contextmanager
def http_gateway(executor_addr: str, model_name: str = "test-model", **settings):
    """-> the gateway's base URL (http://127.0.0.1:PORT), serving until the block ends; `settings`:
    HttpConfig fields."""
    import uvicorn
    from kvplan.gateway import create_app
    from kvplan.http_protocol import Protocol
    cfg = HttpConfig(**{"port": 0, "executor_addr": executor_addr, "timeout_s": 600, **settings})
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say it, and without it every
    # response (headers, then body) waited ~40 ms for the client's delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, model_name), log_level="warning", lifespan="on",
                                           http=Protocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
