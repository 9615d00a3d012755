"""The planner over real gRPC on 127.0.0.1: plans, strategy listing, hot swap, bad input."""
import dataclasses

import grpc
import pytest

from kvplan import serving
from kvplan.config import PlannerConfig, from_env
from kvplan.plan import CompressionPlan
from planner import strategies
from planner.service import build_service
from protos import common_pb2, planner_pb2, planner_pb2_grpc

SHAPE = planner_pb2.ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64, fingerprint="f")


async def _planner(redis_url: str = ""):
    cfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0, redis_url=redis_url)
    svc = build_service(cfg)
    server, port = await serving.start(svc, cfg, with_metrics=False)
    assert await serving.wait_serving(f"127.0.0.1:{port}", 10)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, svc, ch, planner_pb2_grpc.PlannerStub(ch)


async def _close(server, svc, ch):
    await ch.close()
    await serving.shutdown(server, svc, 0.5)


async def test_full_plan_has_every_layer_full():
    server, svc, ch, stub = await _planner()
    try:
        msg = await stub.Plan(planner_pb2.PlanRequest(job_id="j", prompt_tokens=100, model=SHAPE), timeout=5)
        plan = CompressionPlan.from_proto(msg)
        assert plan.strategy == "full" and plan.model_fingerprint == "f" and plan.plan_id
        assert [lp.kind for lp in plan.layers] == ["full"] * 30 and [lp.layer for lp in plan.layers] == list(range(30))
        assert plan.predicted_reserve_ratio == 1.0
    finally:
        await _close(server, svc, ch)


@pytest.mark.parametrize("req, field", [
    (planner_pb2.PlanRequest(strategy="nope", model=SHAPE), "strategy"),
    (planner_pb2.PlanRequest(budget=common_pb2.Budget(reserve_ratio=0.0), model=SHAPE), "budget.reserve_ratio"),
    (planner_pb2.PlanRequest(budget=common_pb2.Budget(reserve_ratio=1.5), model=SHAPE), "budget.reserve_ratio"),
    (planner_pb2.PlanRequest(budget=common_pb2.Budget(kv_tokens=0), model=SHAPE), "budget.kv_tokens"),
    (planner_pb2.PlanRequest(model=planner_pb2.ModelShape(num_layers=0)), "model.num_layers"),
    (planner_pb2.PlanRequest(prompt_tokens=-1, model=SHAPE), "prompt_tokens"),
])
async def test_bad_plan_requests_are_invalid_argument_naming_the_field(req, field):
    server, svc, ch, stub = await _planner()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field + ":")
        ok = await stub.Plan(planner_pb2.PlanRequest(model=SHAPE), timeout=5)   # still serving
        assert len(ok.layers) == 30
    finally:
        await _close(server, svc, ch)


async def test_set_strategy_swaps_the_default_and_rejects_unknown(monkeypatch):
    monkeypatch.setitem(strategies.STRATEGIES, "full-b", dataclasses.replace(strategies.STRATEGIES["full"], name="full-b"))
    server, svc, ch, stub = await _planner()
    try:
        listed = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert listed.active == "full" and {"full", "full-b"} <= {s.name for s in listed.strategies}
        info = await stub.SetStrategy(planner_pb2.SetStrategyRequest(name="full-b"), timeout=5)
        assert info.active and info.name == "full-b"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SetStrategy(planner_pb2.SetStrategyRequest(name="nope"), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("name:")
        assert (await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)).active == "full-b"
    finally:
        await _close(server, svc, ch)


async def test_planner_replicas_share_the_active_strategy_through_redis(redis_db, monkeypatch):
    monkeypatch.setitem(strategies.STRATEGIES, "full-b", dataclasses.replace(strategies.STRATEGIES["full"], name="full-b"))
    a, b = await _planner(redis_db), await _planner(redis_db)
    try:
        await a[3].SetStrategy(planner_pb2.SetStrategyRequest(name="full-b"), timeout=5)
        got = await b[3].ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert got.active == "full-b"
    finally:
        await _close(*a[:3])
        await _close(*b[:3])


async def test_list_strategies_names_every_registered_one():
    server, svc, ch, stub = await _planner()
    try:
        listed = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        names = {s.name for s in listed.strategies}
        assert names == {"full", "streaming_llm", "h2o", "snapkv", "pyramidkv", "spindlekv", "spindlekv_paper"}
        assert all(s.version and s.description for s in listed.strategies)
    finally:
        await _close(server, svc, ch)


async def test_spindlekv_plan_over_the_wire():
    server, svc, ch, stub = await _planner()
    try:
        msg = await stub.Plan(planner_pb2.PlanRequest(job_id="j", strategy="spindlekv", prompt_tokens=4096, model=SHAPE,
                                                      budget=common_pb2.Budget(reserve_ratio=0.4)), timeout=5)
        plan = CompressionPlan.from_proto(msg)
        assert (plan.strategy, plan.strategy_version) == ("spindlekv", strategies.STRATEGIES["spindlekv"].version)
        assert [lp.kind for lp in plan.layers] == ["codebook"] * 30
        assert plan.layers[-1].eviction.gqa_mode == "repeat" and plan.layers[-1].eviction.keep_tokens > 0
        assert plan.predicted_reserve_ratio == pytest.approx(0.4, abs=1e-3)
    finally:
        await _close(server, svc, ch)
