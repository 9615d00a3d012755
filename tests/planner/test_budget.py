import itertools

import pytest

from kvcore.cost import ROW_CHUNK, held_after
from planner.budget import added_steps, context_tokens, row_cost
from planner.request import ModelShape, PlanInput

SHAPE = ModelShape(4, 2, 4, 16)


def _inp(l=1000, r=0.5, suffix=0, new=0, kv_tokens=None):
    return PlanInput("j", "snapkv", l, SHAPE, reserve_ratio=None if kv_tokens else r, kv_tokens=kv_tokens,
                     suffix_tokens=suffix, new_tokens=new)


def test_held_after_grows_a_chunk_at_a_time_and_a_big_append_at_once():
    assert ROW_CHUNK == 16
    assert held_after([1] * 17) == [16] * 16 + [32]
    assert held_after([20, 1, 1]) == [20, 36, 36]          # the question exactly, then a chunk for decode
    assert held_after([]) == []


def test_a_job_that_adds_nothing_keeps_the_whole_ratio():
    assert context_tokens(_inp(1000, 0.5)) == 500
    assert context_tokens(_inp(1000, 0.2)) == pytest.approx(200)
    assert context_tokens(_inp(100, None, kv_tokens=40)) == 40
    assert context_tokens(_inp(100, None, kv_tokens=400)) == 100          # at most the prompt


def test_worked_example_the_worst_step_is_just_past_a_chunk():
    # r = 0.2, 32 new tokens: after 17 rows the stores hold 32, so kept <= 200 + 0.2·17 − 32 = 171.4
    assert added_steps(_inp(new=3, suffix=5)) == [5, 1, 1, 1]
    assert context_tokens(_inp(1000, 0.2, new=32)) == pytest.approx(171.4)
    # r = 0.5: the same step gives 500 + 8.5 − 32 = 476.5
    assert context_tokens(_inp(1000, 0.5, new=32)) == pytest.approx(476.5)
    # kv_tokens: the most the added rows hold, 48 rows for 33 tokens
    assert context_tokens(_inp(1000, kv_tokens=300, new=33)) == 300 - 48
    # a mask byte per head raises each added row's cost
    c = row_cost(16, mask_bytes=2)
    assert c == pytest.approx(1 + 2 / 64)
    assert context_tokens(_inp(1000, 0.5, new=32), c) == pytest.approx(500 + 8.5 - 32 * c)


@pytest.mark.parametrize("r", [0.1, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("suffix,new", [(0, 1), (0, 40), (23, 0), (23, 64), (3, 17)])
def test_at_every_step_the_job_holds_at_most_its_ratio(r, suffix, new):
    l = 700
    kept = context_tokens(_inp(l, r, suffix, new))
    steps = added_steps(_inp(l, r, suffix, new))
    added = list(itertools.accumulate(steps))
    if kept == 0:          # the added rows alone outgrow the budget: nothing of the prompt fits
        assert any(h > r * (l + a) for h, a in zip(held_after(steps), added))
        return
    for a, held in zip(added, held_after(steps)):
        assert kept + held <= r * (l + a) + 1e-9
    assert kept <= r * l


def test_a_negative_count_is_rejected_naming_the_field():
    from kvcore.request import InvalidRequest
    from planner.request import parse
    from protos import common_pb2, planner_pb2
    req = planner_pb2.PlanRequest(prompt_tokens=10, new_tokens=-1, budget=common_pb2.Budget(reserve_ratio=0.5),
                                  model=planner_pb2.ModelShape(num_layers=2, num_kv_heads=1, num_query_heads=2,
                                                               head_dim=4))
    with pytest.raises(InvalidRequest, match="new_tokens: must be >= 0"):
        parse(req, "snapkv")
    req.new_tokens, req.suffix_tokens = 8, 3
    inp = parse(req, "snapkv")
    assert (inp.new_tokens, inp.suffix_tokens) == (8, 3)
