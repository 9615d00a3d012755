"""Planner service: Plan, ListStrategies, SetStrategy (hot swap: the next Plan uses it).

A job that names no strategy gets the active default; one that asks to compress while that
default is `full` gets `auto`. Every plan says whether it holds the job's budget (`budget_met`,
`budget_floor_tokens`); a budget asked explicitly that the plan cannot hold is refused
(INVALID_ARGUMENT naming it, with the ratio that would fit: `planner.fit`).

Strategies are the shipped presets plus the custom definitions SetStrategy registered (shared
through Redis when configured). A probing strategy gets a lazy probe of the job's token ids, or,
for a job whose profile has learned budget shares and that is not sampled, those shares instead
(planner/profiles.py). A `predict` request probes the job's tokens whatever the strategy and
fills both predicted retained-attention figures (planner/predict.py); one job never probes the
same prompt twice in the same mode."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid

import grpc
from prometheus_client import Counter

from kvcore.auth import Denied, acting_tenant
from kvcore.keyfile import printable
from kvcore.config import ModelConfig, PlannerConfig, from_env
from kvcore.serving import Service
from planner import adaptive, fit, precheck, predict, profiles, request
from kvcore import defaults, statistics
from kvcore.request import InvalidRequest, adaptive_of, validate_budget
from planner.probe import in_mode, once
from planner.active import open_active
from planner.strategies import STRATEGIES, Strategy, build, parse
from protos import common_pb2, planner_pb2, planner_pb2_grpc

log = logging.getLogger("kvplan.planner")
PLANS = Counter("kvplan_planner_plans_total", "plans made", ["strategy"])
ADAPTIVE = Counter("kvplan_planner_adaptive_total", "adaptive budgets planned, by why the ratio", ["reason"])
PROBES = Counter("kvplan_planner_probes_total", "probes run", ["strategy"])
PRECHECKS = Counter("kvplan_planner_prechecks_total", "budgets checked before the prefill (planner.precheck), "
                    "by outcome", ["outcome"])
GIVEN = Counter("kvplan_planner_given_statistics_total", "plans made from the executor's own prefill statistics",
                ["strategy"])


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, cfg: PlannerConfig, prober=None):
        if cfg.default_strategy not in STRATEGIES:
            raise ValueError(f"KVPLAN_DEFAULT_STRATEGY={cfg.default_strategy!r} is not a strategy ({_known(STRATEGIES)})")
        self.cfg = cfg
        self.active = open_active(cfg.redis_url, cfg.default_strategy, cfg.redis_max_connections,
                                  cfg.redis_pool_timeout_s)
        self.profiles = profiles.open_profiles(cfg.redis_url, cfg.redis_max_connections, cfg.redis_pool_timeout_s)
        self._prober = prober                      # planner.probe.Prober, made on the first probe
        self._built: dict[str, Strategy] = {}      # definition JSON -> its strategy
        self._tasks: set[asyncio.Task] = set()     # background probes of sampled profile jobs
        self._checked: dict[tuple[str, str], str] = {}   # (name, version) -> why it cannot compress this model
        self._reference = None                     # (model shape, lazy probe of planner.precheck.REFERENCE_TEXT)

    async def Plan(self, req: planner_pb2.PlanRequest, context) -> common_pb2.CompressionPlan:
        try:
            acting_tenant(req.tenant, "")
        except Denied as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            inp = request.parse(req, req.strategy or "default", self.cfg.max_tokens)   # bounded before any work
            name = req.strategy or await self._default(req.budget)
            strategy = await self._resolve(req.strategy, name)
            inp = dataclasses.replace(inp, strategy=strategy.name)
            if req.predict and not req.token_ids:
                raise InvalidRequest("token_ids", "predict probes the prompt: send token_ids")
            if req.precheck:                            # before the prefill: the stand-in's plan, refused as the job's
                return await self._precheck(strategy, inp, req)
            probe = self._given(req, inp, strategy) if req.HasField("stats") else \
                self._probe(strategy.name, list(req.token_ids))
            inp, pending = await self._probing(strategy, inp, probe)
            plan = await asyncio.to_thread(self._plan, strategy, inp, req)
            if req.predict:
                plan = await asyncio.to_thread(predict.from_probe, plan, probe, inp.model)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if pending and pending[1]:                      # a profile's sampled job probed: learn its shares
            await self.profiles.add(pending[0], pending[1][0])
        plan = dataclasses.replace(plan, strategy=strategy.name, strategy_version=strategy.version)
        PLANS.labels(name).inc()
        log.info("job %s: %s plan %s (%d layers)%s", req.job_id, name, plan.plan_id, len(plan.layers),
                 "" if plan.budget_met is not False else
                 f"; budget not met: it keeps at least {plan.budget_floor_tokens} prompt tokens per KV head")
        return plan.to_proto()

    async def _precheck(self, strategy: Strategy, inp: request.PlanInput, req: planner_pb2.PlanRequest):
        """A plan from the stand-in of the job's statistics (`planner.precheck`): a budget it cannot
        hold is refused (InvalidRequest) before the executor prefills the prompt."""
        if strategy.probe_mode:
            if not req.token_ids:
                raise InvalidRequest("token_ids", f"a precheck of {strategy.name} probes the prompt's first tokens: "
                                                  "send them")
            prefix = in_mode(once(lambda *a, **kw: self.prober.probe(*a, **kw), list(req.token_ids)),
                             strategy.probe_mode)                 # counted as a precheck, not a prompt's probe
            inp = precheck.standin_input(inp, prefix)
        try:
            plan = await asyncio.to_thread(self._plan, strategy, inp, req)
        except InvalidRequest:
            PRECHECKS.labels("refused").inc()
            raise
        PRECHECKS.labels("held").inc()
        return dataclasses.replace(plan, strategy=strategy.name, strategy_version=strategy.version).to_proto()

    def _plan(self, strategy: Strategy, inp: request.PlanInput, req: planner_pb2.PlanRequest):
        """The job's plan: at its budget, or — an adaptive budget, and the default of a compressing
        strategy asked for no budget — at the largest ratio the executor's load leaves room for."""
        plan_id = f"plan-{uuid.uuid4().hex[:12]}"
        if inp.adaptive is None and (req.budget.WhichOneof("kind") is not None or strategy.name == "full"):
            plan = strategy.plan(inp, plan_id)
            if req.budget.WhichOneof("kind") is not None and not fit.usable(plan, inp):
                raise fit.refusal(lambda i: strategy.plan(i, plan_id), inp, plan,     # never run to answer garbage
                                  precheck.note(strategy, plan))
            return plan
        floor_ratio, min_retained = inp.adaptive or (0.0, 0.0)
        plan = adaptive.plan(lambda r: strategy.plan(dataclasses.replace(inp, reserve_ratio=r, kv_tokens=None), plan_id),
                             inp, adaptive.Load.from_proto(req.load), floor_ratio,
                             min_retained or self.cfg.adaptive_min_retained)
        ADAPTIVE.labels(plan.budget_reason).inc()
        return plan

    async def ListStrategies(self, req, context) -> planner_pb2.StrategyList:
        active = await self.active.get()
        infos = [_info(s, active) for s in (await self._strategies()).values()]
        if req.check_model:
            for info, s in zip(infos, (await self._strategies()).values()):
                info.cannot_compress = await asyncio.to_thread(self._cannot_compress, s)
        return planner_pb2.StrategyList(active=active, strategies=infos)

    def _cannot_compress(self, s: Strategy) -> str:
        """Why `s` compresses nothing on the model the prober loads (`planner.precheck`), once per
        strategy version; the reference text is probed once."""
        key = (s.name, s.version)
        if key not in self._checked:
            if self._reference is None:
                self._reference = precheck.reference(self.prober)
            try:
                self._checked[key] = precheck.cannot_compress(s, *self._reference)
            except (InvalidRequest, ValueError) as e:     # a custom definition the stand-in cannot plan: unmarked
                log.warning("strategy %s: cannot tell whether it compresses this model: %s", printable(s.name), e)
                self._checked[key] = ""
        return self._checked[key]

    async def SetStrategy(self, req: planner_pb2.SetStrategyRequest, context) -> planner_pb2.StrategyInfo:
        try:
            if req.definition:
                strategy = await self._define(req.definition, req.name, req.activate)
            else:
                strategy = await self._lookup(req.name, "name")
                await self.active.set(strategy.name)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        active = await self.active.get()
        log.info("%s %s v%s", "active strategy is now" if active == strategy.name else "registered strategy",
                 strategy.name, strategy.version)
        return _info(strategy, active)

    async def _default(self, budget: common_pb2.Budget) -> str:
        """The strategy of a job that names none: the active default, except that a budget which
        asks to compress while the default is `full` (which never compresses) gets `auto`, so
        `--ratio 0.2` alone is never silently a full cache."""
        ratio, tokens = validate_budget(budget)
        return defaults.strategy_for("", await self.active.get(), ratio, tokens, adaptive_of(budget) is not None)

    async def DeleteStrategy(self, req: planner_pb2.DeleteStrategyRequest, context) -> planner_pb2.StrategyList:
        """Remove a custom definition (admin; the gate checks the role). When it was the active
        default, the configured default (KVPLAN_DEFAULT_STRATEGY) is active again."""
        if req.name in STRATEGIES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"name: {req.name!r} is a shipped strategy")
        if not await self.active.delete(req.name, self.cfg.default_strategy):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: no custom strategy {req.name!r}")
        log.info("deleted strategy definition %s", printable(req.name))
        return await self.ListStrategies(planner_pb2.ListStrategiesRequest(), context)

    async def _resolve(self, asked: str, name: str) -> Strategy:
        """The job's strategy. A default that cannot be read back (a stored definition that no
        longer validates) plans with `full`, with a logged error, instead of failing every job."""
        if asked:
            return await self._lookup(name, "strategy")
        try:
            return await self._lookup(name, "strategy")
        except InvalidRequest as e:
            log.error("the active strategy cannot be used (%s); planning with full until it is fixed "
                      "(kvplan strategies set NAME, or DeleteStrategy)", e)
            return STRATEGIES["full"]

    async def _strategies(self) -> dict[str, Strategy]:
        """The presets, then the custom definitions (shared through Redis when configured), each
        validated again when read: one that no longer validates is left out, with a logged error."""
        custom = {}
        for name, text in (await self.active.definitions()).items():
            if text not in self._built:
                try:
                    self._built[text] = build(parse(text))
                except (InvalidRequest, ValueError, TypeError) as e:
                    log.error("stored definition %s does not validate; leaving it out: %s", printable(name), e)
                    continue
            custom[name] = self._built[text]
        return {**STRATEGIES, **custom}

    async def _lookup(self, name: str, field: str) -> Strategy:
        known = STRATEGIES if name in STRATEGIES else await self._strategies()
        if not name:
            raise InvalidRequest(field, f"must name a strategy (known: {_known(known)})")
        if name not in known:
            raise InvalidRequest(field, f"unknown strategy {name!r} (known: {_known(known)})")
        return known[name]

    async def _define(self, text: str, name: str, activate: bool) -> Strategy:
        """Register (or replace) a custom definition; with `activate`, make it the default."""
        d = parse(text)
        if name and name != d.name:
            raise InvalidRequest("name", f"{name!r} is not the definition's name {d.name!r}")
        if d.name in STRATEGIES:
            raise InvalidRequest("definition.name", f"{d.name!r} is a shipped strategy; give yours another name")
        stored = (await self.active.definitions()).get(d.name)
        try:
            prev = parse(stored) if stored else None
        except InvalidRequest:          # a stored definition that no longer validates: replaced
            prev = None
        if not d.version:
            same = prev is not None and dataclasses.replace(d, version=prev.version) == prev
            d = dataclasses.replace(d, version=prev.version if same else _next_version(prev))
        elif prev is not None and d.version == prev.version and d != prev:
            raise InvalidRequest("definition.version", f"{d.name} v{d.version} is registered with other "
                                                               "parts: give a new version (or none)")
        strategy = build(d)
        await self.active.define(d.name, d.to_json(), activate)
        return strategy

    def _given(self, req: planner_pb2.PlanRequest, inp: request.PlanInput, strategy: Strategy):
        """The job's statistics as the executor's prefill gathered them, as a probe would give them."""
        if not strategy.probe_mode:
            return None
        m = inp.model
        heads = m.num_query_heads if strategy.probe_mode == "repeat" else m.num_kv_heads
        try:
            stats = statistics.from_proto(req.stats, m.num_layers, heads, inp.prompt_tokens)
        except ValueError as e:
            field, _, message = str(e).partition(": ")
            raise InvalidRequest(field, message) from None
        GIVEN.labels(strategy.name).inc()

        def probe(gqa_mode: str = strategy.probe_mode, losses: bool = False):
            if gqa_mode != strategy.probe_mode or (losses and stats.losses is None):
                raise InvalidRequest("stats", f"gathered in {strategy.probe_mode} mode"
                                             f"{'' if stats.losses is not None else ' without losses'}; the "
                                             f"strategy asks for {gqa_mode}{' with losses' if losses else ''}")
            return stats
        return probe

    def _probe(self, name: str, token_ids: list[int]):
        """This job's lazy probe (`planner.probe.once`; None without token ids)."""
        if not token_ids:
            return None
        return once(lambda *a, **kw: self.prober.probe(*a, **kw), token_ids, PROBES.labels(name).inc)

    async def _probing(self, strategy: Strategy, inp: request.PlanInput, probe):
        """(input, pending) for this job: a probing strategy's input gets the job's lazy probe (None
        without token ids) in its GQA mode, or its profile's shares when the job is not sampled;
        `pending` = (profile key, the list the probed allocation's shares land in), None when there
        is nothing to learn."""
        if not strategy.probe_mode:
            return inp, None
        inp = dataclasses.replace(inp, probe=in_mode(probe, strategy.probe_mode) if probe else None)
        if not inp.profile:
            return inp, None
        m = inp.model
        k = profiles.key(inp.profile, strategy.name, strategy.version, m.fingerprint, m.num_layers)
        sampled = profiles.sampled(await self.profiles.next_job(k), self.cfg.profile_sample)
        shares = await self.profiles.shares(k)
        if shares is not None:
            if sampled and inp.probe is not None:     # keep the shares fresh, off this job's critical path
                self._background(self._learn(strategy, inp, k))
            return dataclasses.replace(inp, layer_shares=tuple(shares.tolist()), probe=None), None
        learned: list = []                            # the profile's first job: probe inline, learn
        return dataclasses.replace(inp, learn=learned.append), (k, learned)

    async def _learn(self, strategy: Strategy, inp: request.PlanInput, k: str) -> None:
        """A sampled job of a profile that already has shares: its probe runs beside the job
        (the job was planned from the shares) and adds what it finds to the profile."""
        learned: list = []
        try:
            await asyncio.to_thread(strategy.plan, dataclasses.replace(inp, learn=learned.append), "learn")
            if learned:
                await self.profiles.add(k, learned[0])
        except Exception:                             # a failed background probe costs only freshness
            log.exception("background probe for profile %s failed", inp.profile)

    def _background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def prober(self):
        if self._prober is None:
            from planner.probe import Prober
            self._prober = Prober(from_env(ModelConfig))
        return self._prober

    async def close(self) -> None:
        for task in list(self._tasks):              # let running background probes finish their write
            if not task.done():
                await asyncio.wait_for(asyncio.shield(task), timeout=30)
        await self.active.close()
        await self.profiles.close()


def _next_version(prev) -> str:
    if prev is None:
        return "1"
    return str(int(prev.version) + 1) if prev.version.isdigit() else prev.version + ".1"


def _known(strategies) -> str:
    return ", ".join(sorted(strategies))


def _info(s: Strategy, active: str) -> planner_pb2.StrategyInfo:
    return planner_pb2.StrategyInfo(name=s.name, version=s.version, description=s.description, active=s.name == active,
                                    probe_mode=s.probe_mode or "", probe_losses=s.probe_losses)


def build_service(cfg: PlannerConfig, prober=None) -> Service:
    servicer = PlannerServicer(cfg, prober)

    async def warmup():
        active = await servicer.active.get()   # reach Redis before reporting SERVING
        strategy = STRATEGIES.get(active)
        if cfg.warm_probe or (strategy is not None and strategy.probe_mode is not None):
            # probing strategies (`auto` plans every job that asks a budget under the `full` default):
            # load the model now, not inside the first probing job's Plan deadline (a prober
            # given ready-made has nothing to load)
            load = getattr(servicer.prober, "model", None)
            if load is not None:
                await asyncio.to_thread(load)
            log.info("probe model loaded")

    return Service(
        name="planner", full_names=["kvplan.v1.Planner"],
        register=lambda server: planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server),
        warmup=warmup, stop=servicer.close,
    )
