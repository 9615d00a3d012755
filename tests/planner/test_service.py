"""The planner over real gRPC on 127.0.0.1: plans, strategy listing, hot swap by name or by
definition, probing strategies (a counting fake prober), profile mode, bad input."""
import dataclasses

import grpc
import pytest

from kvcore import serving
from kvcore.config import PlannerConfig, from_env
from kvcore.plan import CompressionPlan
from planner import predict, strategies
from planner.service import build_service
from protos import common_pb2, planner_pb2, planner_pb2_grpc
from tests.planner.fakes import CountingProbe

SHAPE = planner_pb2.ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64, fingerprint="f")
MINE = """
name: mine
description: snapkv with a smaller pool
eviction: {scorer: snapkv, pool_kernel: 5}
"""


async def _planner(redis_url: str = "", prober=None, **overrides):
    cfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0, redis_url=redis_url,
                              **{"warm_probe": False, **overrides})
    svc = build_service(cfg, prober)
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
        assert names == set(strategies.STRATEGIES) and {"xkv", "minicache", "spindlekv+xkv"} <= names
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
        assert 0.39 <= plan.predicted_reserve_ratio <= 0.4    # whole coded and entry pages: a little under
    finally:
        await _close(server, svc, ch)


def _ratio_req(**kw) -> planner_pb2.PlanRequest:
    return planner_pb2.PlanRequest(**{"job_id": "j", "prompt_tokens": 4096, "model": SHAPE,
                                      "budget": common_pb2.Budget(reserve_ratio=0.2), **kw})


async def test_set_strategy_with_a_definition_registers_it_and_makes_it_active():
    server, svc, ch, stub = await _planner()
    try:
        info = await stub.SetStrategy(planner_pb2.SetStrategyRequest(definition=MINE, activate=True), timeout=5)
        assert (info.name, info.version, info.active) == ("mine", "1", True)
        listed = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert listed.active == "mine" and "mine" in {s.name for s in listed.strategies}
        plan = CompressionPlan.from_proto(await stub.Plan(_ratio_req(), timeout=5))
        assert (plan.strategy, plan.strategy_version) == ("mine", "1")
        assert {(lp.eviction.pool_kernel, lp.eviction.scorer) for lp in plan.layers} == {(5, "snapkv")}

        again = await stub.SetStrategy(planner_pb2.SetStrategyRequest(name="mine", definition=MINE), timeout=5)
        assert again.version == "1"                                         # the same parts: the same version
        changed = MINE.replace("pool_kernel: 5", "pool_kernel: 3")
        assert (await stub.SetStrategy(planner_pb2.SetStrategyRequest(definition=changed), timeout=5)).version == "2"
        plan = CompressionPlan.from_proto(await stub.Plan(_ratio_req(strategy="mine"), timeout=5))
        assert plan.strategy_version == "2" and plan.layers[0].eviction.pool_kernel == 3
        with pytest.raises(grpc.aio.AioRpcError) as e:                      # a version names one set of parts
            await stub.SetStrategy(planner_pb2.SetStrategyRequest(definition=MINE + 'version: "2"\n'), timeout=5)
        assert e.value.details().startswith("definition.version:")
    finally:
        await _close(server, svc, ch)


async def test_a_definition_without_activate_is_registered_but_not_the_default():
    server, svc, ch, stub = await _planner()
    try:
        info = await stub.SetStrategy(planner_pb2.SetStrategyRequest(definition=MINE), timeout=5)
        assert (info.name, info.version, info.active) == ("mine", "1", False)
        listed = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert listed.active == "full" and "mine" in {s.name for s in listed.strategies}
        plan = CompressionPlan.from_proto(await stub.Plan(_ratio_req(strategy="mine"), timeout=5))
        assert plan.strategy == "mine"                                      # usable by name at once
    finally:
        await _close(server, svc, ch)


async def test_a_compressing_budget_without_a_strategy_is_planned_by_auto_not_full():
    """The default is `full`: a job asking 0.2 and naming no strategy must not silently hold 1.0."""
    server, svc, ch, stub = await _planner(prober=CountingProbe())
    try:
        plan = CompressionPlan.from_proto(await stub.Plan(_ratio_req(token_ids=list(range(4096))), timeout=10))
        assert plan.strategy == "auto" and plan.budget_met and plan.predicted_reserve_ratio <= 0.2
        plain = CompressionPlan.from_proto(await stub.Plan(planner_pb2.PlanRequest(prompt_tokens=100, model=SHAPE),
                                                           timeout=5))
        assert plain.strategy == "full" and plain.budget_met                # no budget asked: the default
        await stub.SetStrategy(planner_pb2.SetStrategyRequest(name="snapkv"), timeout=5)
        assert CompressionPlan.from_proto(await stub.Plan(_ratio_req(), timeout=5)).strategy == "snapkv"
    finally:
        await _close(server, svc, ch)


@pytest.mark.parametrize("strategy, prompt, ratio, new, floor", [
    ("snapkv", 4096, 0.2, 0, 32),              # the window fits the budget
    ("streaming_llm", 200, 0.2, 0, 25),        # its window is what the budget leaves after 4 sinks (and 15 rows
                                               # a stream for whole pool blocks: 40 - 15 = 25)
    ("full", 4096, 1.0, 0, 4096),
])
async def test_a_plan_that_holds_the_budget_says_so(strategy, prompt, ratio, new, floor):
    server, svc, ch, stub = await _planner()
    try:
        req = planner_pb2.PlanRequest(job_id="j", prompt_tokens=prompt, model=SHAPE, strategy=strategy,
                                      budget=common_pb2.Budget(reserve_ratio=ratio), new_tokens=new)
        plan = CompressionPlan.from_proto(await stub.Plan(req, timeout=5))
        assert (plan.budget_met, plan.budget_floor_tokens) == (True, floor)
    finally:
        await _close(server, svc, ch)


@pytest.mark.parametrize("strategy, prompt, budget, new, words", [
    # 26 tokens asked, the window alone is 32 (whole blocks: the budget leaves 11)
    ("snapkv", 52, common_pb2.Budget(reserve_ratio=0.5), 0,
     "snapkv cannot hold reserve ratio 0.5 on this job (52 prompt tokens, 0 new tokens): the budget leaves the "
     "prompt 11 tokens per KV head in blocks of 16 rows, and snapkv keeps at least 32; reserve ratio 0.91 fits"),
    ("snapkv", 37, common_pb2.Budget(reserve_ratio=0.2), 0, "keeps at least 32; reserve ratio 1 fits"),
    # 150 asked, but 256 new rows come out of it first
    ("snapkv", 300, common_pb2.Budget(reserve_ratio=0.5), 256,
     "the budget leaves the prompt 7 tokens per KV head once the rows the job adds — kept whole, in blocks of 16 "
     "— are paid for, and snapkv keeps at least 32; reserve ratio 0.55 fits, or at most 206 new tokens fit "
     "reserve ratio 0.5"),
    ("full", 4096, common_pb2.Budget(reserve_ratio=0.5), 0, "full keeps at least 4096; reserve ratio 1 fits"),
    ("snapkv", 300, common_pb2.Budget(kv_tokens=40), 0, "snapkv cannot hold kv_tokens 40 on this job"),
])
async def test_a_budget_the_plan_cannot_hold_is_refused_with_what_would_fit(strategy, prompt, budget, new, words):
    """Before: the plan said budget_met=false and the job ran anyway, answering garbage."""
    server, svc, ch, stub = await _planner()
    try:
        req = planner_pb2.PlanRequest(job_id="j", prompt_tokens=prompt, model=SHAPE, strategy=strategy,
                                      budget=budget, new_tokens=new)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(req, timeout=5)
        field = "budget.reserve_ratio" if budget.WhichOneof("kind") == "reserve_ratio" else "budget.kv_tokens"
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field + ": ")
        assert words in e.value.details()
    finally:
        await _close(server, svc, ch)


@pytest.mark.parametrize("req, details", [
    (planner_pb2.SetStrategyRequest(definition=MINE.replace("scorer: snapkv", "scorer: foo")),
     "definition.eviction.scorer: 'foo' is not one of ['snapkv', 'h2o', 'streaming_llm']"),
    (planner_pb2.SetStrategyRequest(definition=MINE + "offload: {top_k: 0}\n"),
     "definition.offload.top_k: 0 is less than the minimum of 1"),
    (planner_pb2.SetStrategyRequest(definition="name: snapkv\n"), "definition.name: 'snapkv' is a shipped strategy"),
    (planner_pb2.SetStrategyRequest(name="other", definition=MINE), "name: 'other' is not the definition's name"),
    (planner_pb2.SetStrategyRequest(definition="{name: mine"), "definition: not valid JSON or YAML"),
])
async def test_a_bad_definition_is_invalid_argument_and_the_old_strategy_stays(req, details):
    server, svc, ch, stub = await _planner()
    try:
        await stub.SetStrategy(planner_pb2.SetStrategyRequest(name="snapkv"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SetStrategy(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(details)
        listed = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert listed.active == "snapkv" and "mine" not in {s.name for s in listed.strategies}
    finally:
        await _close(server, svc, ch)


async def test_planner_replicas_share_custom_definitions_through_redis(redis_db):
    a, b = await _planner(redis_db), await _planner(redis_db)
    try:
        await a[3].SetStrategy(planner_pb2.SetStrategyRequest(definition=MINE, activate=True), timeout=5)
        listed = await b[3].ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert listed.active == "mine" and "mine" in {s.name for s in listed.strategies}
        plan = CompressionPlan.from_proto(await b[3].Plan(_ratio_req(), timeout=5))
        assert plan.strategy == "mine" and plan.layers[0].eviction.pool_kernel == 5
        await b[3].SetStrategy(planner_pb2.SetStrategyRequest(definition=MINE.replace("5}", "3}")), timeout=5)
        plan = CompressionPlan.from_proto(await a[3].Plan(_ratio_req(), timeout=5))
        assert plan.strategy_version == "2" and plan.layers[0].eviction.pool_kernel == 3
    finally:
        await _close(*a[:3])
        await _close(*b[:3])


async def test_a_probing_strategy_probes_the_jobs_token_ids():
    prober = CountingProbe()
    server, svc, ch, stub = await _planner(prober=prober)
    try:
        msg = await stub.Plan(_ratio_req(strategy="xkv", token_ids=list(range(4096))), timeout=10)
        plan = CompressionPlan.from_proto(msg)
        assert prober.calls == [(list(range(4096)), "mean")]
        assert len({lp.eviction.keep_tokens for lp in plan.layers}) > 1 and 0 < plan.predicted_retained_attention < 1
        for bad in (_ratio_req(strategy="xkv"), _ratio_req(strategy="xkv", token_ids=[1, 2, 3])):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Plan(bad, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids:")
        await stub.Plan(_ratio_req(strategy="snapkv", token_ids=list(range(4096))), timeout=5)
        assert len(prober.calls) == 1                                      # snapkv never probes
    finally:
        await _close(server, svc, ch)


async def test_predict_fills_both_figures_for_any_strategy_from_one_repeat_mode_probe():
    prober = CountingProbe()
    server, svc, ch, stub = await _planner(prober=prober)
    ids = list(range(4096))
    try:
        want = predict.annotate(CompressionPlan.from_proto(await stub.Plan(_ratio_req(strategy="snapkv"), timeout=5)),
                                prober.s, SHAPE.num_kv_heads)
        assert prober.calls == []                                          # no predict: no probe
        plan = CompressionPlan.from_proto(await stub.Plan(_ratio_req(strategy="snapkv", token_ids=ids, predict=True),
                                                          timeout=10))
        assert prober.calls == [(ids, "repeat")]
        assert plan.predicted_retained_attention == pytest.approx(want.predicted_retained_attention, rel=1e-6)
        assert plan.predicted_copy_retained_attention == pytest.approx(want.predicted_copy_retained_attention, rel=1e-6)
        assert 0 < plan.predicted_copy_retained_attention < plan.predicted_retained_attention < 1
        prober.calls.clear()
        await stub.Plan(_ratio_req(strategy="auto", token_ids=ids, predict=True), timeout=10)
        assert prober.calls == [(ids, "repeat")]                           # auto's own probe serves predict
        prober.calls.clear()
        await stub.Plan(_ratio_req(strategy="xkv", token_ids=ids, predict=True), timeout=10)
        assert prober.calls == [(ids, "mean"), (ids, "repeat")]            # xkv probes per KV group
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(_ratio_req(strategy="snapkv", predict=True), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids:")
        small = planner_pb2.ModelShape(num_layers=4, num_kv_heads=3, num_query_heads=9, head_dim=64)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(_ratio_req(strategy="snapkv", token_ids=ids, predict=True, model=small), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("model:")
        full = CompressionPlan.from_proto(await stub.Plan(          # full asks no budget (one it cannot hold is refused)
            _ratio_req(strategy="full", token_ids=ids, predict=True, budget=common_pb2.Budget()), timeout=5))
        assert (full.predicted_retained_attention, full.predicted_copy_retained_attention) == (1.0, 1.0)
    finally:
        await _close(server, svc, ch)


async def test_profile_mode_probes_a_sample_and_plans_the_rest_from_the_learned_shares():
    """The profile's first job waits for its probe; later sampled jobs (4, 8) are planned from the
    learned shares at once and probed beside the job, refreshing the shares (no added latency)."""
    prober = CountingProbe()
    server, svc, ch, stub = await _planner(prober=prober, profile_sample=0.25)
    try:
        plans = []
        for i in range(9):
            req = _ratio_req(strategy="xkv", profile="reports", job_id=f"j{i}")
            if i % 4 == 0:                                   # only the sampled jobs need their tokens
                req.token_ids.extend(range(4096))
            plans.append(CompressionPlan.from_proto(await stub.Plan(req, timeout=10)))
        keeps = [[lp.eviction.keep_tokens for lp in p.layers] for p in plans]
        assert all(k == keeps[0] for k in keeps)             # identical probes: identical shares and budgets
        assert [p.predicted_retained_attention < 1 for p in plans] == [i == 0 for i in range(9)]
        await stub.Plan(_ratio_req(strategy="xkv", token_ids=list(range(4096))), timeout=10)
    finally:
        await _close(server, svc, ch)                        # waits for the background probes
    assert len(prober.calls) == 4                            # jobs 0, 4, 8 + one without a profile


async def test_profiles_are_shared_by_replicas_through_redis(redis_db):
    pa, pb = CountingProbe(), CountingProbe()
    a, b = await _planner(redis_db, prober=pa), await _planner(redis_db, prober=pb)
    try:
        ids = list(range(4096))
        await a[3].Plan(_ratio_req(strategy="xkv", profile="p", token_ids=ids), timeout=10)
        for _ in range(3):
            await b[3].Plan(_ratio_req(strategy="xkv", profile="p"), timeout=10)
        assert (len(pa.calls), len(pb.calls)) == (1, 0)
    finally:
        await _close(*a[:3])
        await _close(*b[:3])


async def test_a_plan_from_the_executors_statistics_runs_no_probe():
    """auto planned from statistics the executor's prefill gathered: the same plan as from the
    planner's own probe of them, and no probe; the strategies say who needs which statistics."""
    from kvcore import statistics
    from tests.planner import fakes
    prober = CountingProbe()
    server, svc, ch, stub = await _planner(prober=prober)
    try:
        listed = {s.name: s for s in (await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)).strategies}
        assert (listed["auto"].probe_mode, listed["auto"].probe_losses) == ("repeat", True)
        assert (listed["xkv"].probe_mode, listed["xkv"].probe_losses) == ("mean", False)
        assert listed["snapkv"].probe_mode == ""
        probed = CompressionPlan.from_proto(await stub.Plan(_ratio_req(token_ids=list(range(4096))), timeout=10))
        assert len(prober.calls) == 1
        given = CompressionPlan.from_proto(await stub.Plan(_ratio_req(stats=statistics.to_proto(fakes.stats())),
                                                           timeout=10))
        assert len(prober.calls) == 1 and given.layers == probed.layers
        for mutate, field in ((lambda m: setattr(m, "tokens", 4000), "stats.tokens"),
                              (lambda m: setattr(m, "window_scores", m.window_scores[:-2]), "stats.window_scores"),
                              (lambda m: m.losses.quant.__setitem__(0, float("nan")), "stats.losses"),
                              (lambda m: m.ClearField("losses"), "stats")):
            msg = statistics.to_proto(fakes.stats())
            mutate(msg)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Plan(_ratio_req(stats=msg), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field), \
                e.value.details()
        assert len(prober.calls) == 1
    finally:
        await _close(server, svc, ch)


async def test_an_adaptive_budget_plans_for_the_executors_load():
    """Alone with room: 1.0 ("fits"); twelve jobs sharing four full caches' bytes: the largest
    ratio whose plan fits a twelfth ("pressure"); a compressing strategy asked for no budget is
    planned adaptively too; `full` asked for none stays a plain full plan."""
    server, svc, ch, stub = await _planner(prober=CountingProbe())
    try:
        def req(load, budget=common_pb2.Budget(adaptive=common_pb2.Adaptive()), strategy="auto"):
            return planner_pb2.PlanRequest(job_id="j", prompt_tokens=4096, model=SHAPE, strategy=strategy,
                                           budget=budget, new_tokens=64, token_ids=list(range(4096)), load=load)
        alone = CompressionPlan.from_proto(await stub.Plan(req(planner_pb2.KVLoad()), timeout=10))
        full = alone.predicted_kv_bytes or 30 * 3 * 4 * 64 * 4160
        assert (alone.budget_ratio, alone.budget_reason) == (1.0, "fits")
        assert all(lp.kind == "full" for lp in alone.layers)
        busy = planner_pb2.KVLoad(budget_bytes=4 * full, free_bytes=4 * full, jobs=12, itemsize=2, chunk=512)
        pressed = CompressionPlan.from_proto(await stub.Plan(req(busy), timeout=10))
        assert pressed.budget_reason == "pressure" and 0.05 <= pressed.budget_ratio <= 0.35
        assert pressed.predicted_reserve_ratio <= pressed.budget_ratio + 0.02
        named = CompressionPlan.from_proto(await stub.Plan(req(busy, common_pb2.Budget(), "snapkv"), timeout=10))
        assert named.budget_reason == "pressure" and named.budget_ratio <= 0.35
        plain = CompressionPlan.from_proto(await stub.Plan(req(busy, common_pb2.Budget(), "full"), timeout=10))
        assert plain.budget_reason == "" and all(lp.kind == "full" for lp in plain.layers)
    finally:
        await _close(server, svc, ch)


class _Model:
    """What a prober's loaded model tells `planner.precheck.reference`: its shape and a tokenizer."""
    num_layers, num_kv_heads, num_query_heads, head_dim, fingerprint = 30, 3, 9, 64, "f"

    @staticmethod
    def tokenizer(text):
        return {"input_ids": list(range(len(text.split())))}


class _UnlikeLayers(CountingProbe):
    """A prober of a model whose adjacent layers are nearly orthogonal (SmolLM2's)."""
    def __init__(self):
        s = fakes_stats(t=128)
        super().__init__(dataclasses.replace(s, k_angle=s.k_angle + 0.5, v_angle=s.v_angle + 0.5))

    def model(self):
        return _Model()


def fakes_stats(**kw):
    from tests.planner.fakes import stats
    return stats(**kw)


async def test_a_precheck_probes_only_the_prefix_and_refuses_as_the_plan_would():
    """Before the prefill (issue 41): the executor sends the prompt's first tokens; a budget the
    strategy cannot hold is INVALID_ARGUMENT with the plan's own words, one it holds is planned."""
    prober = CountingProbe(fakes_stats(t=128))
    server, svc, ch, stub = await _planner(prober=prober)
    try:
        short = dict(strategy="auto", prompt_tokens=349, new_tokens=128, token_ids=list(range(128)), precheck=True)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(_ratio_req(**short), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("budget.reserve_ratio: auto cannot hold reserve ratio 0.2 on this job "
                                            "(349 prompt tokens, 128 new tokens)")
        assert prober.calls == [(list(range(128)), "repeat")]                 # the prefix, no more
        plan = CompressionPlan.from_proto(await stub.Plan(_ratio_req(**{**short, "prompt_tokens": 2954}), timeout=10))
        assert plan.budget_met and any(lp.kind != "full" for lp in plan.layers)
        with pytest.raises(grpc.aio.AioRpcError) as e:                        # a probing precheck needs the prefix
            await stub.Plan(_ratio_req(**{**short, "token_ids": []}), timeout=10)
        assert e.value.details().startswith("token_ids: a precheck of auto probes the prompt's first tokens")
        with pytest.raises(grpc.aio.AioRpcError) as e:                        # a prefix is shorter than the prompt
            await stub.Plan(_ratio_req(**{**short, "token_ids": list(range(400))}), timeout=10)
        assert e.value.details().startswith("token_ids: has 400 ids, prompt_tokens says 349")
    finally:
        await _close(server, svc, ch)


async def test_check_model_marks_what_the_model_cannot_compress():
    """Before: `kvplan strategies` listed minicache without a caveat; every job asking it a budget
    below 1 was refused on SmolLM2, whose adjacent layers are nearly orthogonal."""
    server, svc, ch, stub = await _planner(prober=_UnlikeLayers())
    try:
        plain = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
        assert not any(s.cannot_compress for s in plain.strategies)               # not asked: no model loaded
        checked = await stub.ListStrategies(planner_pb2.ListStrategiesRequest(check_model=True), timeout=30)
        marked = {s.name: s.cannot_compress for s in checked.strategies if s.cannot_compress}
        assert marked == {"minicache": "its plans keep every layer whole; a budget below 1 is refused"}
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(_ratio_req(strategy="minicache", prompt_tokens=2954, token_ids=list(range(128)),
                                       precheck=True, budget=common_pb2.Budget(reserve_ratio=0.5)), timeout=10)
        assert "minicache compresses nothing here; `kvplan strategies` marks it" in e.value.details()
    finally:
        await _close(server, svc, ch)
