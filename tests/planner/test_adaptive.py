"""An adaptive budget: the largest ratio whose plan fits the job's fair share of the executor's KV
memory (1.0 when it all fits), never below the floor — worked on `snapkv` and `auto` plans of a
4096-token prompt on SmolLM2's shape, whose bytes `kvcore.plan_cost` states."""
import dataclasses

import pytest

from planner import adaptive
from kvcore.request import InvalidRequest
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES
from protos import common_pb2, planner_pb2
from tests.planner.fakes import CountingProbe

SHAPE = ModelShape(30, 3, 9, 64, "f")


def _inp(strategy: str) -> PlanInput:
    return PlanInput("j", strategy, 4096, SHAPE, reserve_ratio=1.0, new_tokens=64, probe=CountingProbe(),
                     adaptive=(0.0, 0.0))


def _at(inp: PlanInput):
    return lambda r: STRATEGIES[inp.strategy].plan(dataclasses.replace(inp, reserve_ratio=r), "p")


def _bytes(inp: PlanInput, r: float) -> int:
    return adaptive.kv_bytes(_at(inp)(r), inp, adaptive.Load(1, 1, 1))


def test_alone_with_room_the_job_gets_the_full_cache():
    inp = _inp("snapkv")
    full = _bytes(inp, 1.0)
    got = adaptive.plan(_at(inp), inp, adaptive.Load(4 * full, 4 * full, 1), 0.0, 0.9)
    assert (got.budget_ratio, got.budget_reason) == (1.0, "fits")
    assert adaptive.kv_bytes(got, inp, adaptive.Load(1, 1, 1)) == full > 2 * _bytes(inp, 0.5)


@pytest.mark.parametrize("jobs", [2, 3, 5, 12])
def test_under_load_the_largest_ratio_that_fits_the_fair_share(jobs):
    inp = _inp("snapkv")
    budget = 4 * _bytes(inp, 1.0)
    load = adaptive.Load(budget, budget, jobs)
    got = adaptive.plan(_at(inp), inp, load, 0.0, 0.9)
    fits = [r for r in adaptive.RATIOS if _bytes(inp, r) <= budget // jobs]
    assert got.budget_ratio == fits[0] and got.budget_reason == ("fits" if fits[0] == 1.0 else "pressure")
    assert adaptive.kv_bytes(got, inp, load) <= load.share


def test_free_bytes_bound_the_share_when_earlier_jobs_hold_more():
    inp = _inp("snapkv")
    budget = 4 * _bytes(inp, 1.0)
    got = adaptive.plan(_at(inp), inp, adaptive.Load(budget, _bytes(inp, 0.25), 2), 0.0, 0.9)
    assert got.budget_ratio == 0.25 and got.budget_reason == "pressure"


def test_below_the_floor_ratio_the_job_gets_the_floor():
    inp = _inp("snapkv")
    load = adaptive.Load(_bytes(inp, 0.05), _bytes(inp, 0.05), 1)          # only the tiniest plan fits
    got = adaptive.plan(_at(inp), inp, load, 0.3, 0.9)
    assert (got.budget_ratio, got.budget_reason) == (0.35, "floor")         # 0.25 would fit less than asked


def test_autos_floor_is_where_its_predicted_retained_attention_falls_below_the_bound():
    inp = _inp("auto")
    retained = {r: _at(inp)(r).predicted_retained_attention for r in adaptive.RATIOS}
    bound = sorted(retained.values())[len(retained) // 2]                  # some ratios pass, some do not
    floor = min(r for r in adaptive.RATIOS if all(retained[x] >= bound for x in adaptive.RATIOS if x >= r))
    got = adaptive.plan(_at(inp), inp, adaptive.Load(1, 1, 1), 0.0, bound)  # nothing fits
    assert (got.budget_ratio, got.budget_reason) == (floor, "floor")
    assert got.predicted_retained_attention >= bound


def test_without_a_load_nothing_presses():
    inp = _inp("snapkv")
    got = adaptive.plan(_at(inp), inp, None, 0.0, 0.9)
    assert (got.budget_ratio, got.budget_reason) == (1.0, "fits")
    assert adaptive.Load.from_proto(planner_pb2.KVLoad()) is None


@pytest.mark.parametrize("field, value", [("floor_ratio", 1.5), ("floor_ratio", -0.1), ("min_retained", float("nan"))])
def test_a_bad_adaptive_budget_names_its_field(field, value):
    from kvcore.request import adaptive_of
    with pytest.raises(InvalidRequest) as e:
        adaptive_of(common_pb2.Budget(adaptive=common_pb2.Adaptive(**{field: value})))
    assert e.value.field == f"budget.adaptive.{field}"
