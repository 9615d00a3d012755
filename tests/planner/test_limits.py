"""Limits before work on the planner (issue 23), over real gRPC on 127.0.0.1: every bad request of
the hostile-client table is answered with a clear status before any planning or probing, naming the field,
and the planner keeps serving; stored definitions are validated when read; DeleteStrategy."""
from __future__ import annotations

import dataclasses
import logging

import grpc
import pytest

from kvcore import serving
from kvcore.config import PlannerConfig, from_env
from planner.active import DEFINITIONS_KEY, ACTIVE_KEY
from planner.probe import Prober
from planner.service import build_service
from protos import common_pb2, planner_pb2, planner_pb2_grpc
from tests.metrics import summed

SHAPE = planner_pb2.ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64, fingerprint="f")


@pytest.fixture
async def planner(tiny_prober):
    """(stub, raw channel) of an in-process planner on port 0 probing with the tiny model."""
    cfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0)
    svc = build_service(cfg, tiny_prober)
    server, port = await serving.start(svc, cfg, with_metrics=False)
    assert await serving.wait_serving(f"127.0.0.1:{port}", 10)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=serving.channel_options())
    try:
        yield planner_pb2_grpc.PlannerStub(ch), ch
    finally:
        await ch.close()
        await serving.shutdown(server, svc, 0.5)


@pytest.fixture(scope="module")
def tiny_prober(tiny_model):
    return Prober(lm=tiny_model, window=8)


def _work_done() -> tuple[float, float]:
    """Plans made and probes run so far, from the planner's own counters (all strategies)."""
    return summed("kvplan_planner_plans"), summed("kvplan_planner_probes")


async def _rejected(call, code: grpc.StatusCode, field: str) -> None:
    """The call fails with `code`, its message naming `field`, before any planning or probing
    (counted, not timed: a slow host must not fail it)."""
    before = _work_done()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == code, e.value.details()
    assert e.value.details().startswith(field), e.value.details()
    assert _work_done() == before, ("the planner planned or probed before refusing", before, _work_done())


async def _still_plans(stub) -> None:
    """The planner still plans, and the counters `_rejected` reads move when it does."""
    plans, _ = _work_done()
    ok = await stub.Plan(planner_pb2.PlanRequest(prompt_tokens=100, model=SHAPE), timeout=5)
    assert len(ok.layers) == 30
    assert _work_done()[0] == plans + 1


BOUNDED = [
    (dict(new_tokens=2**31 - 1, prompt_tokens=100), "new_tokens"),            # grew to 22 GB before
    (dict(prompt_tokens=2**40), "prompt_tokens"),
    (dict(suffix_tokens=2**31 - 1), "suffix_tokens"),
    (dict(model=planner_pb2.ModelShape(num_layers=10**6, num_kv_heads=3, num_query_heads=9, head_dim=64)),
     "model.num_layers"),                                                       # 65 s before
    (dict(model=planner_pb2.ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=10**6)),
     "model.head_dim"),
    (dict(prompt_tokens=3, token_ids=[1, -5, 2]), "token_ids"),
    (dict(job_id="j\n2026-01-01 INFO kvplan.planner: forged"), "job_id"),      # a forged log line
]


@pytest.mark.parametrize("fields, field", BOUNDED, ids=[f for _, f in BOUNDED])
async def test_plan_fields_are_bounded_before_any_planning(planner, fields, field):
    stub, _ = planner
    req = planner_pb2.PlanRequest(strategy="snapkv", budget=common_pb2.Budget(reserve_ratio=0.5),
                                  **{"model": SHAPE, **fields})
    await _rejected(stub.Plan(req, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, field)
    await _still_plans(stub)


@pytest.mark.parametrize("ids, words", [
    (list(range(9000)), "9000 ids exceed the model's context of 4096"),       # 110 s and +876 MB before
    ([1, 2, 10**7], "the model's vocabulary"),                                  # UNKNOWN IndexError before
])
async def test_probed_token_ids_fit_the_model_before_the_probe(planner, ids, words):
    stub, _ = planner
    req = planner_pb2.PlanRequest(prompt_tokens=len(ids), token_ids=ids, predict=True, model=SHAPE)
    before = _work_done()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Plan(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value.details()
    assert _work_done() == before                  # no probe ran (refused before its prefill)
    await _still_plans(stub)


@pytest.mark.parametrize("method", ["Plan", "SetStrategy", "ListStrategies", "DeleteStrategy"])
async def test_undecodable_bytes_are_invalid_argument(planner, method):
    stub, ch = planner
    call = ch.unary_unary(f"/kvplan.v1.Planner/{method}", request_serializer=None, response_deserializer=None)
    await _rejected(call(b"\xff\xff\xff\x07garbage", timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "request:")
    await _still_plans(stub)


DEFINITIONS = [
    ("name: bad\ncodebook: {theta_k: .nan}\n", "definition.codebook.theta_k"),         # made active before
    ('{"name": "bad", "merge": {"t": Infinity}}', "definition.merge.t"),
    ("name: bad\neviction: {scorer: snapkv, window: 1000000000000000000}\n", "definition.eviction.window"),
    ("name: bad\neviction: {scorer: snapkv, pool_kernel: 1000000000000000000}\n", "definition.eviction.pool_kernel"),
    ("name: bad\neviction: {scorer: snapkv, sink_tokens: 1000000000000000000}\n", "definition.eviction.sink_tokens"),
    ("name: bad\neviction: {scorer: snapkv, span_tokens: 1000000000000000000}\n", "definition.eviction.span_tokens"),
    ("name: bad\nquant: {bits: 4, residual: 1000000000000000000}\n", "definition.quant.residual"),
    ("name: bad\ndescription: x\noptions: {a: '" + "x" * (70 << 10) + "'}\n", "definition:"),
    ("name: bad\noptions: " + "[" * 5000 + "]" * 5000, "definition:"),
    ("name: bad\noptions:\n  a: &a [1,1,1,1,1,1,1,1,1,1]\n  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
     "  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n  d: [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n", "definition:"),
]


@pytest.mark.parametrize("text, field", DEFINITIONS, ids=[f"{i}:{f}" for i, (_, f) in enumerate(DEFINITIONS)])
async def test_definitions_are_bounded_and_finite(planner, text, field):
    stub, _ = planner
    await _rejected(stub.SetStrategy(planner_pb2.SetStrategyRequest(definition=text, activate=True), timeout=5),
                    grpc.StatusCode.INVALID_ARGUMENT, field)
    listed = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
    assert listed.active == "full" and "bad" not in {s.name for s in listed.strategies}
    await _still_plans(stub)


async def test_a_stored_definition_that_no_longer_validates_falls_back_to_full_and_can_be_deleted(
        redis_db, request, caplog):
    """What an older planner (or a hand edit) left in Redis: a NaN definition, made active. Jobs
    naming no strategy plan `full` with a logged error instead of failing; DeleteStrategy
    removes it and the configured default is active again."""
    import redis as sync_redis
    r = sync_redis.Redis.from_url(redis_db)
    r.hset(DEFINITIONS_KEY, "bad", '{"name": "bad", "codebook": {"theta_k": NaN}}')
    r.set(ACTIVE_KEY, "bad")
    cfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0, redis_url=redis_db)
    svc = build_service(cfg, request.getfixturevalue("tiny_prober"))
    server, port = await serving.start(svc, cfg, with_metrics=False)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = planner_pb2_grpc.PlannerStub(ch)
    try:
        assert await serving.wait_serving(f"127.0.0.1:{port}", 10)
        with caplog.at_level(logging.ERROR, logger="kvplan.planner"):
            plan = await stub.Plan(planner_pb2.PlanRequest(prompt_tokens=50, model=SHAPE), timeout=5)
        assert plan.strategy == "full" and len(plan.layers) == 30
        assert any("cannot be used" in m for m in caplog.messages)
        listed = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert "bad" not in {s.name for s in listed.strategies}
        listed = await stub.DeleteStrategy(planner_pb2.DeleteStrategyRequest(name="bad"), timeout=5)
        assert listed.active == "full" and r.get(ACTIVE_KEY) == b"full" and not r.hexists(DEFINITIONS_KEY, "bad")
        await _rejected(stub.DeleteStrategy(planner_pb2.DeleteStrategyRequest(name="bad"), timeout=5),
                        grpc.StatusCode.NOT_FOUND, "name:")
        await _rejected(stub.DeleteStrategy(planner_pb2.DeleteStrategyRequest(name="snapkv"), timeout=5),
                        grpc.StatusCode.INVALID_ARGUMENT, "name:")
    finally:
        r.close()
        await ch.close()
        await serving.shutdown(server, svc, 0.5)


async def test_delete_strategy_of_the_active_definition_restores_the_default(planner):
    stub, _ = planner
    await stub.SetStrategy(planner_pb2.SetStrategyRequest(
        definition="name: mine\neviction: {scorer: snapkv, pool_kernel: 5}\n", activate=True), timeout=5)
    assert (await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)).active == "mine"
    listed = await stub.DeleteStrategy(planner_pb2.DeleteStrategyRequest(name="mine"), timeout=5)
    assert listed.active == "full" and "mine" not in {s.name for s in listed.strategies}
