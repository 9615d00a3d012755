"""`python -m kvplan.healthcheck HOST:PORT` against a real grpc.aio server with grpc.health.v1."""
from __future__ import annotations

import asyncio
import socket
import sys

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def run_healthcheck(*args: str, timeout_s: float = 60) -> tuple[int, str, str]:
    """Run the health check as a container would: a separate process, no shared state."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvplan.healthcheck", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def health_server():
    """(servicer, port): a grpc.aio server on 127.0.0.1, port 0, serving grpc.health.v1 only."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, port
    await server.stop(0)


async def test_serving_exits_0(health_server):
    servicer, port = health_server
    await servicer.set("", SERVING)
    rc, out, err = await run_healthcheck(f"127.0.0.1:{port}")
    assert rc == 0, err
    assert "SERVING" in out


async def test_not_serving_exits_1(health_server):
    servicer, port = health_server
    await servicer.set("", NOT_SERVING)
    rc, out, err = await run_healthcheck(f"127.0.0.1:{port}")
    assert rc == 1
    assert "NOT_SERVING" in err


async def test_goes_from_not_serving_to_serving(health_server):
    """What a container sees while a service warms up: unhealthy first, then healthy."""
    servicer, port = health_server
    await servicer.set("", NOT_SERVING)
    assert (await run_healthcheck(f"127.0.0.1:{port}"))[0] == 1
    await servicer.set("", SERVING)
    assert (await run_healthcheck(f"127.0.0.1:{port}"))[0] == 0


async def test_named_service(health_server):
    servicer, port = health_server
    await servicer.set("", SERVING)
    await servicer.set("kvplan.v1.Executor", NOT_SERVING)
    assert (await run_healthcheck(f"127.0.0.1:{port}", "--service", "kvplan.v1.Executor"))[0] == 1
    await servicer.set("kvplan.v1.Executor", SERVING)
    assert (await run_healthcheck(f"127.0.0.1:{port}", "--service", "kvplan.v1.Executor"))[0] == 0
    rc, _, err = await run_healthcheck(f"127.0.0.1:{port}", "--service", "kvplan.v1.Nope")
    assert rc == 1 and "kvplan.v1.Nope" in err


async def test_nothing_listening_exits_1_with_a_message():
    with socket.socket() as s:  # a port that was free a moment ago and has no listener now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, err = await run_healthcheck(f"127.0.0.1:{port}", "--timeout", "1")
    assert rc == 1
    assert f"127.0.0.1:{port}" in err and "DOWN" in err


@pytest.mark.parametrize("address", ["no-port", "127.0.0.1:", ":50051", "127.0.0.1:http", "127.0.0.1:70000"])
async def test_bad_address_is_a_usage_error(address):
    """Exit 1, not argparse's 2: Docker reserves 2 for health checks."""
    rc, _, err = await run_healthcheck(address)
    assert rc == 1
    assert "HOST:PORT" in err
