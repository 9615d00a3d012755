"""Planner service: Plan, ListStrategies, SetStrategy (hot swap: the next Plan uses it)."""
from __future__ import annotations

import dataclasses
import logging
import uuid

import grpc
from prometheus_client import Counter

from kvplan.config import PlannerConfig
from kvplan.serving import Service
from planner import request
from planner.active import open_active
from planner.strategies import STRATEGIES
from protos import common_pb2, planner_pb2, planner_pb2_grpc

log = logging.getLogger("kvplan.planner")
PLANS = Counter("kvplan_planner_plans_total", "plans made", ["strategy"])


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, cfg: PlannerConfig):
        if cfg.default_strategy not in STRATEGIES:
            raise ValueError(f"KVPLAN_DEFAULT_STRATEGY={cfg.default_strategy!r} is not a strategy ({_known()})")
        self.active = open_active(cfg.redis_url, cfg.default_strategy)

    async def Plan(self, req: planner_pb2.PlanRequest, context) -> common_pb2.CompressionPlan:
        try:
            name = req.strategy or await self.active.get()
            strategy = _lookup(name, "strategy")
            inp = request.parse(req, name)
        except request.InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        plan = strategy.plan(inp, f"plan-{uuid.uuid4().hex[:12]}")
        plan = dataclasses.replace(plan, strategy=strategy.name, strategy_version=strategy.version)
        PLANS.labels(name).inc()
        log.info("job %s: %s plan %s (%d layers)", req.job_id, name, plan.plan_id, len(plan.layers))
        return plan.to_proto()

    async def ListStrategies(self, req, context) -> planner_pb2.StrategyList:
        active = await self.active.get()
        return planner_pb2.StrategyList(active=active, strategies=[_info(s, active) for s in STRATEGIES.values()])

    async def SetStrategy(self, req: planner_pb2.SetStrategyRequest, context) -> planner_pb2.StrategyInfo:
        try:
            strategy = _lookup(req.name, "name")
        except request.InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self.active.set(strategy.name)
        log.info("active strategy is now %s v%s", strategy.name, strategy.version)
        return _info(strategy, strategy.name)


def _known() -> str:
    return ", ".join(sorted(STRATEGIES))


def _lookup(name: str, field: str):
    if not name:
        raise request.InvalidRequest(field, f"must name a strategy (known: {_known()})")
    if name not in STRATEGIES:
        raise request.InvalidRequest(field, f"unknown strategy {name!r} (known: {_known()})")
    return STRATEGIES[name]


def _info(s, active: str) -> planner_pb2.StrategyInfo:
    return planner_pb2.StrategyInfo(name=s.name, version=s.version, description=s.description, active=s.name == active)


def build_service(cfg: PlannerConfig) -> Service:
    servicer = PlannerServicer(cfg)

    async def warmup():
        await servicer.active.get()   # reach Redis before reporting SERVING

    return Service(
        name="planner", full_names=["kvplan.v1.Planner"],
        register=lambda server: planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server),
        warmup=warmup, stop=servicer.active.close,
    )
