"""The executor's view of the planner: a plan with a deadline, or the local fallback plan
(`full`, marked degraded) when the planner cannot be reached."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from kvcore import defaults
from kvcore.model import LoadedModel
from kvcore.plan import CompressionPlan, full_plan
from kvcore.channels import aio_channel
from kvcore.serving import channel_options
from kvcore.request import InvalidRequest
from protos import common_pb2, planner_pb2, planner_pb2_grpc

log = logging.getLogger("kvplan.executor.planner")
PRECHECK_TOKENS = 128     # the prompt's first tokens a precheck sends (planner.precheck.PREFIX_TOKENS)
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}


@dataclass(frozen=True)
class PlanOutcome:
    plan: CompressionPlan
    degraded: bool
    reason: str = ""


class PlannerClient:
    def __init__(self, address: str, deadline_s: float, deadline_per_1k_s: float = 0.0):
        """A Plan call's deadline: deadline_s, plus deadline_per_1k_s per 1000 token ids sent (a
        probing strategy prefills them: its time grows with the prompt)."""
        self.deadline_s, self.deadline_per_1k_s = deadline_s, deadline_per_1k_s
        self.channel = aio_channel(address, options=channel_options())
        self.stub = planner_pb2_grpc.PlannerStub(self.channel)
        self._known: tuple[str, dict[str, planner_pb2.StrategyInfo]] | None = None

    async def close(self) -> None:
        await self.channel.close()

    async def strategies(self) -> list[str] | None:
        """Known strategy names: the planner's, or the last it gave when it does not answer in
        time (so a name it never had is refused while it is down); None: never asked yet."""
        got = await self._catalog()
        return None if got is None else list(got[1])

    async def strategy_for(self, named: str, budget: common_pb2.Budget) -> planner_pb2.StrategyInfo | None:
        """The strategy a job will be planned with (its own, or the default its budget gets:
        `kvcore.defaults`), as the planner last described it; None when unknown."""
        got = await self._catalog()
        if got is None:
            return None
        kind = budget.WhichOneof("kind")
        name = defaults.strategy_for(named, got[0], budget.reserve_ratio if kind == "reserve_ratio" else None,
                                     budget.kv_tokens if kind == "kv_tokens" else None, kind == "adaptive")
        return got[1].get(name)

    async def _catalog(self) -> tuple[str, dict[str, planner_pb2.StrategyInfo]] | None:
        """(active default, name -> StrategyInfo): the planner's, or the last it gave."""
        try:
            got = await self.stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=min(2.0, self.deadline_s))
        except grpc.aio.AioRpcError:
            return self._known
        self._known = (got.active, {s.name: s for s in got.strategies})
        return self._known

    async def plan(self, job_id: str, tenant: str, strategy: str, budget: common_pb2.Budget, profile: str,
                   prompt_tokens: int, lm: LoadedModel, token_ids: list[int] | None = None,
                   suffix_tokens: int = 0, new_tokens: int = 0, stats=None, load=None,
                   precheck: bool = False) -> PlanOutcome:
        """token_ids: the context's ids (prompt_tokens of them), for strategies that probe the
        prompt; stats: instead, the statistics the executor's prefill gathered (`ProbeStatistics`);
        suffix_tokens, new_tokens: the rows the job adds after it (the budget holds them); load: the
        executor's KV memory now (`planner_pb2.KVLoad`: what an adaptive budget plans for);
        precheck: before the prefill, a plan from a stand-in of the statistics (token_ids: the
        prompt's first PRECHECK_TOKENS), refused (InvalidRequest) as the job's would be."""
        req = planner_pb2.PlanRequest(
            job_id=job_id, tenant=tenant, strategy=strategy, budget=budget, profile=profile,
            prompt_tokens=prompt_tokens, token_ids=token_ids or [],
            suffix_tokens=suffix_tokens, new_tokens=new_tokens, stats=stats, load=load, precheck=precheck,
            model=planner_pb2.ModelShape(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads,
                                         num_query_heads=lm.num_query_heads, head_dim=lm.head_dim,
                                         fingerprint=lm.fingerprint))
        try:
            msg = await self.stub.Plan(req, timeout=self.deadline(len(req.token_ids)))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                field, _, message = (e.details() or "").partition(": ")
                raise InvalidRequest(field or "strategy", message or "rejected by the planner") from None
            if e.code() not in _UNREACHABLE:
                raise
            log.warning("job %s: planner unreachable (%s); local full plan, degraded", job_id, e.code().name)
            met = _full_fits(budget, prompt_tokens + suffix_tokens + new_tokens)
            return PlanOutcome(full_plan(lm.num_layers, f"local-{job_id}", "full", lm.fingerprint, met, prompt_tokens),
                               True, f"planner {e.code().name}")
        return PlanOutcome(CompressionPlan.from_proto(msg), False)

    def deadline(self, token_ids: int) -> float:
        return self.deadline_s + self.deadline_per_1k_s * token_ids / 1000


def _full_fits(budget: common_pb2.Budget, tokens: int) -> bool:
    """Whether the local full plan holds the job's budget: none asked, a ratio of 1, or a token
    budget for every row the job will hold."""
    kind = budget.WhichOneof("kind")
    if kind == "reserve_ratio":
        return budget.reserve_ratio >= 1.0
    return kind != "kv_tokens" or budget.kv_tokens >= tokens
