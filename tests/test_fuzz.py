"""Fuzzing every RPC (issue 23) with hypothesis, over real gRPC on 127.0.0.1: the planner, the
cachestore and the executor (the tiny model, so accepted jobs cost little) in this process. Each
method gets messages built from its descriptor (every field, extreme numbers, NaN and inf, long
and control-character strings, nested messages, repeated fields) and raw bytes. Never UNKNOWN or
INTERNAL; every service still SERVING; this process's memory bounded."""
from __future__ import annotations

import dataclasses
import math

import grpc
import psutil
import pytest
from google.protobuf import descriptor as pd
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan.embedded import Embedded
from kvcore.serving import channel_options, check_health
from protos import cachestore_pb2, executor_pb2, planner_pb2

SERVICES = {"planner": planner_pb2, "executor": executor_pb2, "cachestore": cachestore_pb2}
METHODS = [(name, m) for name, mod in SERVICES.items() for s in mod.DESCRIPTOR.services_by_name.values()
           for m in s.methods]
EXAMPLES = 120                    # per method and kind (messages, raw bytes)
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
COUNT = {"examples": 0}

F = pd.FieldDescriptor
INT32 = st.one_of(st.sampled_from([0, 1, -1, 2, 3, 7, 16, 64, 4096, 2**31 - 1, -2**31]), st.integers(-2**31, 2**31 - 1))
INT64 = st.one_of(INT32, st.sampled_from([2**40, 2**63 - 1, -2**63]), st.integers(-2**63, 2**63 - 1))
FLOATS = st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, 1e-40, 1e38, math.nan, math.inf, -math.inf]),
                   st.floats(width=32))
WORDS = ["", "full", "snapkv", "auto", "specache", "default", "user", "system", "assistant", "acme", "a\nb",
         "x" * 5000, "name: x\neviction: {scorer: snapkv, window: .nan}", "float16", "bfloat16", "int8", "j1"]
TEXT = st.one_of(st.sampled_from(WORDS), st.text(max_size=40))
SCALARS = {
    F.TYPE_INT32: INT32, F.TYPE_SINT32: INT32, F.TYPE_SFIXED32: INT32,
    F.TYPE_INT64: INT64, F.TYPE_SINT64: INT64, F.TYPE_SFIXED64: INT64,
    F.TYPE_UINT32: st.integers(0, 2**32 - 1), F.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1), F.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    F.TYPE_FLOAT: FLOATS, F.TYPE_DOUBLE: FLOATS, F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: TEXT, F.TYPE_BYTES: st.binary(max_size=64),
}


def _value(f: pd.FieldDescriptor, depth: int):
    if f.type == F.TYPE_MESSAGE:
        return messages(f.message_type, depth + 1)
    if f.type == F.TYPE_ENUM:
        return st.integers(-3, 8)
    return SCALARS[f.type]


def messages(desc: pd.Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of type `desc` with any subset of their fields set (depth-limited nesting)."""
    cls = GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    fields = {}
    for f in desc.fields:
        value = _value(f, depth)
        fields[f.name] = st.lists(value, max_size=40 if f.type != F.TYPE_MESSAGE else 3) if f.is_repeated else value

    def build(values: dict):
        msg = cls()
        for name, v in values.items():
            f = desc.fields_by_name[name]
            if f.is_repeated and f.type == F.TYPE_MESSAGE:
                for item in v:
                    getattr(msg, name).add().CopyFrom(item)
            elif f.is_repeated:
                getattr(msg, name).extend(v)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    return st.fixed_dictionaries({}, optional=fields).map(build)


@pytest.fixture(scope="module")
def cluster(model_cfg, tiny_model_dir):
    mp = pytest.MonkeyPatch()
    for k, v in {"KVPLAN_MAX_QUEUED": "4", "KVPLAN_CACHESTORE_CAPACITY_BYTES": str(16 << 20),
                 "KVPLAN_PLANNER_WARM_PROBE": "0"}.items():
        mp.setenv(k, v)
    try:
        with Embedded(dataclasses.replace(model_cfg, model=str(tiny_model_dir))) as e:
            yield e
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def channels(cluster):
    chans = {name: grpc.insecure_channel(cluster.addresses[name], options=channel_options()) for name in SERVICES}
    yield chans
    for ch in chans.values():
        ch.close()


def _call(channels, service: str, method: pd.MethodDescriptor, raw: bytes) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    ch = channels[service]
    COUNT["examples"] += 1
    try:
        if method.server_streaming:
            for _ in ch.unary_stream(path, request_serializer=None, response_deserializer=None)(raw, timeout=3):
                pass
        else:
            ch.unary_unary(path, request_serializer=None, response_deserializer=None)(raw, timeout=5)
    except grpc.RpcError as e:
        assert e.code() not in BAD, f"{path}: {e.code().name}: {e.details()}"
        assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or method.server_streaming, f"{path} hung"


def _settings():
    return settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.mark.parametrize("service, method", METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_fuzz_every_rpc(channels, cluster, service, method):
    rss0 = psutil.Process().memory_info().rss

    @_settings()
    @given(msg=messages(method.input_type))
    def fields(msg):
        _call(channels, service, method, msg.SerializeToString())

    @_settings()
    @given(raw=st.binary(max_size=256))
    def raw_bytes(raw):
        _call(channels, service, method, raw)

    fields()
    raw_bytes()
    for name, addr in cluster.addresses.items():
        assert check_health(addr) == "SERVING", name
    RSS[f"{service}.{method.name}"] = (psutil.Process().memory_info().rss - rss0) >> 20


RSS: dict[str, int] = {}          # MiB this process grew over each method's first round


def test_fuzz_memory_is_bounded_and_the_count(channels, cluster):
    """A second round over every method (the first one warmed up what a first job allocates:
    the engine's buffers, allocator pools) grows this process's memory by little; the examples
    both rounds sent are printed for the record (run with -s)."""
    rss0 = psutil.Process().memory_info().rss
    for service, method in METHODS:
        @settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(msg=messages(method.input_type), raw=st.binary(max_size=256))
        def again(msg, raw):
            _call(channels, service, method, msg.SerializeToString())
            _call(channels, service, method, raw)

        again()
    grown = (psutil.Process().memory_info().rss - rss0) >> 20
    print(f"\nfuzz: {COUNT['examples']} examples over {len(METHODS)} methods; RSS growth, first round (MiB): "
          f"{RSS}; second round: {grown} MiB; RSS now {psutil.Process().memory_info().rss >> 20} MiB")
    assert grown < 256, f"memory grew {grown} MiB over the second round"
    assert COUNT["examples"] >= EXAMPLES * len(METHODS)
    for name, addr in cluster.addresses.items():
        assert check_health(addr) == "SERVING", name
