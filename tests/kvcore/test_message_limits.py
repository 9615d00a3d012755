"""Per-role request limits on every service (issues 33 and 42), over real gRPC with API keys: a
call without a known key is refused before its message is read — ten keyless 50 MB Plan calls
grew the planner by 690 MB, which it kept (issue 42); a user key's request above its role's
limit is RESOURCE_EXHAUSTED before it is decoded — the planner decoded a 52 MB Plan from a user
key before refusing it (+550 MB RSS), because its one receive limit had to hold an executor's
prefill statistics — and its memory goes back to the OS. The limits are the ones
docs/security.md states.

The memory checks read the service's own process (`python -m planner`, `python -m cachestore`,
tests/procs.py): measured in the test's process, the client's own 50 MB messages and gRPC's late
release of them counted against the service (62 MB "kept" once in the full suite)."""
from __future__ import annotations

import time

import grpc
import psutil
import pytest

from kvcore.auth import TRIM_DELAY_S
from kvcore.config import CachestoreConfig, ExecutorConfig, PlannerConfig
from tests.kvcore.test_auth import channel, keys  # noqa: F401  (the keys fixture)
from tests.procs import Service, base_env


def _plan_bytes(n_tokens: int) -> bytes:
    """A serialized PlanRequest of `n_tokens` token ids (packed, one byte each): built as bytes,
    so the test itself never holds them as a message."""
    payload = b"\x01" * n_tokens
    length, size = b"", len(payload)
    while True:
        byte, size = size & 0x7F, size >> 7
        length += bytes([byte | (0x80 if size else 0)])
        if not size:
            break
    return b"\x42" + length + payload                            # field 8 (token_ids), length-delimited


def _call(addr: str, key: str, method: str, raw: bytes) -> grpc.RpcError:
    rpc = channel(addr, key).unary_unary(method, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        rpc(raw, timeout=60)
    return e.value


def _rss(pid: int) -> int:
    """The service process's resident bytes once freed memory went back: the least of a few
    readings over 3 s after the trim's delay (a message that was read and kept stays in every
    reading)."""
    time.sleep(TRIM_DELAY_S + 0.5)
    readings = []
    for _ in range(12):
        readings.append(psutil.Process(pid).memory_info().rss)
        time.sleep(0.25)
    return min(readings)


class _Services:
    """The planner and the cachestore as their own processes, authentication on with `keys_file`."""

    def __init__(self, keys_file, log_dir):
        env = base_env(KVPLAN_AUTH="on", KVPLAN_AUTH_KEYS_FILE=str(keys_file), KVPLAN_REDIS_URL="",
                       KVPLAN_CACHESTORE_CAPACITY_BYTES=str(1 << 24))
        self.procs = {name: Service(name, log_dir, env) for name in ("planner", "cachestore")}
        try:
            for s in self.procs.values():
                s.start()
        except BaseException:
            self.stop()
            raise
        self.addr = {name: s.address for name, s in self.procs.items()}

    def pid(self, name: str) -> int:
        return self.procs[name].proc.pid

    def stop(self) -> None:
        for s in self.procs.values():
            s.stop()


@pytest.fixture
def services(keys, tmp_path):  # noqa: F811
    s = _Services(keys[0], tmp_path)
    yield s
    s.stop()


def test_the_documented_limits(monkeypatch):
    planner, executor = PlannerConfig(), ExecutorConfig()
    assert planner.max_request_bytes("user") == 8 * 131072 + (1 << 20) == 2 << 20          # 2 MiB
    assert planner.max_request_bytes("admin") == planner.max_receive_bytes == 256 << 20    # statistics
    assert executor.max_request_bytes("user") == executor.max_request_bytes("admin") == 2 * (512 << 10) + (64 << 10)
    assert CachestoreConfig().max_request_bytes("user") == 256 << 20                     # KV payloads


@pytest.mark.parametrize("service, method", [("planner", "/kvplan.v1.Planner/Plan"),
                                             ("cachestore", "/kvplan.v1.CacheStore/Put")])
def test_a_keyless_callers_huge_message_is_never_read(services, keys, service, method):  # noqa: F811
    raw = _plan_bytes(50 << 20)
    _call(services.addr[service], "", method, raw[:1 << 10])          # (the call's own first-time costs)
    before = _rss(services.pid(service))
    for key in ("", "kvp_not-a-key", "", "kvp_not-a-key"):
        err = _call(services.addr[service], key, method, raw)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    grown = _rss(services.pid(service)) - before
    assert grown < 40 << 20, grown >> 20                                 # four 50 MB messages: none read


def test_a_user_keys_huge_plan_is_refused_before_it_is_decoded(services, keys):  # noqa: F811
    _, made = keys
    raw = _plan_bytes(52 << 20)
    before = _rss(services.pid("planner"))
    for _ in range(3):
        err = _call(services.addr["planner"], made["a"], "/kvplan.v1.Planner/Plan", raw)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "more than the 2097152 a user key may send" in err.details()
    grown = _rss(services.pid("planner")) - before
    assert grown < 60 << 20, grown >> 20                                 # read (gRPC must), given back
    # an admin key (the executor's, with statistics) may send more: decoded, then refused by field
    err = _call(services.addr["planner"], made["admin"], "/kvplan.v1.Planner/Plan", _plan_bytes(3 << 20))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("model"), err.details()
    # a user's request within its limit is read as before
    err = _call(services.addr["planner"], made["a"], "/kvplan.v1.Planner/Plan", _plan_bytes(1 << 20))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_cachestore_takes_kv_payloads_of_every_role(services, keys):  # noqa: F811
    """A user's Put of 3 MB is no size error on the cachestore (its payloads are KV rows)."""
    _, made = keys
    raw = b"\x0a" + b"\x80\x80\xc0\x01" + b"x" * (3 << 20)          # field 1, 3 MiB long
    err = _call(services.addr["cachestore"], made["a"], "/kvplan.v1.CacheStore/Register", raw)
    assert err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
