"""A cachestore in its own process on free loopback ports (`python -m cachestore`), for the
benches and the tests that need one they can kill: `with spawn() as (proc, client): ...`."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

from cachestore.client import CachestoreClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawn(capacity_bytes: int | None = None, timeout_s: float = 10.0, transport: str = "auto"):
    """Yields (process, a ready client); stops (terminates) the process at the end."""
    env = {**os.environ, "KVPLAN_CACHESTORE_PORT": str(port := free_port()),
           "KVPLAN_CACHESTORE_METRICS_PORT": str(free_port())}
    if capacity_bytes is not None:
        env["KVPLAN_CACHESTORE_CAPACITY_BYTES"] = str(capacity_bytes)
    proc = subprocess.Popen([sys.executable, "-m", "cachestore"], env=env, stderr=subprocess.DEVNULL)
    client = CachestoreClient(f"127.0.0.1:{port}", transport, timeout_s)
    try:
        client.wait_ready(60)
        yield proc, client
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)
