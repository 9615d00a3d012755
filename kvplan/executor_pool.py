"""The executors a client may call (`KVPLAN_EXECUTOR_ADDR`: one address, or several separated by
commas), one asyncio gRPC channel each, for the HTTP gateway.

A job lives in the job queue, not in the executor that took the request: when the stream of the
executor answering it breaks (it died), any executor sharing that queue can follow the job
(`WatchJob` replays its events and waits for the rest, wherever it is re-run). `after(i)` gives
the executors to try, starting with the one after `i`, so a re-attach goes to another executor
first and comes back to `i` last; `next()` spreads new requests across them.
"""
from __future__ import annotations

import dataclasses
import itertools

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcore.channels import aio_channel
from kvcore.config import SecurityConfig, from_env
from kvcore.serving import channel_options
from protos import executor_pb2_grpc


class ExecutorPool:
    def __init__(self, addresses: tuple[str, ...]):
        self.addresses = addresses
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[executor_pb2_grpc.ExecutorStub] = []
        self._turn = itertools.count()

    async def open(self) -> None:
        # TLS as the process is configured; never this process's own API key: each request acts
        # with its client's key (its Authorization header), or with none
        sec = dataclasses.replace(from_env(SecurityConfig), api_key="")
        for address in self.addresses:
            ch = aio_channel(address, options=channel_options(), sec=sec)
            self.channels.append(ch)
            self.stubs.append(executor_pb2_grpc.ExecutorStub(ch))

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()

    def next(self) -> int:
        """The executor for a new request (round robin)."""
        return next(self._turn) % len(self.stubs)

    def after(self, i: int) -> list[int]:
        """Every executor, the ones after `i` first and `i` last."""
        n = len(self.stubs)
        return [(i + k) % n for k in range(1, n + 1)]

    async def healthy(self) -> bool:
        """Whether any of them answers SERVING."""
        for ch in self.channels:
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                continue
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        return False
