"""Adaptive budgets through the real services (the embedded default, real model): a job alone
gets the full cache; five at once under a budget of about two full caches get the largest ratio
that fits a fifth each, and every cache stays within the bytes reserved for it to the last token;
a floor of 1.0 keeps the jobs at full KV and they wait for room instead."""
import concurrent.futures as cf

import pytest

from executor import prompt as prompts
from kvcore import plan_cost
from kvplan.client import ExecutorClient, request
from kvplan.demo import DEMO_CONTEXT, DEMO_QUESTION
from kvplan.embedded import Embedded
from kvplan.plan import full_plan
from protos import executor_pb2 as pb

NEW = 8


@pytest.fixture(scope="module")
def full_bytes(real_model) -> int:
    lm = real_model
    p = prompts.build(lm.tokenizer, [{"role": "user", "content": DEMO_CONTEXT}], DEMO_QUESTION)
    return plan_cost.plan_bytes(full_plan(lm.num_layers, "f"), lm.num_kv_heads, lm.num_query_heads, lm.head_dim,
                                len(p.context_ids), len(p.question_ids), NEW, 2, 512)


@pytest.fixture(scope="module")
def cluster(model_cfg, real_model_dir, full_bytes):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPLAN_KV_BUDGET_BYTES", str(int(2.2 * full_bytes)))
    try:
        with Embedded(model_cfg) as e:
            yield e
    finally:
        mp.undo()


def _job(floor: float = 0.0) -> pb.GenerateRequest:
    return request(DEMO_CONTEXT, question=DEMO_QUESTION, max_new_tokens=NEW, strategy="auto", adaptive=True,
                   floor_ratio=floor, ignore_eos=True)


def _run_at_once(cluster, reqs):
    def one(req):
        with ExecutorClient(cluster.executor_addr, timeout_s=300) as c:
            return c.run(req)
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(one, reqs))


def test_an_adaptive_job_alone_gets_the_full_cache(cluster):
    r = _run_at_once(cluster, [_job()])[0].result
    assert (r.budget_ratio, r.budget_reason) == (1.0, "fits")
    assert r.reserve_ratio == pytest.approx(1.0, abs=0.02) and r.generated_tokens == NEW


def test_jobs_at_once_get_the_ratio_that_fits_and_stay_within_their_reservations(cluster, full_bytes):
    results = [st.result for st in _run_at_once(cluster, [_job() for _ in range(5)])]
    assert all(r.generated_tokens == NEW and not r.degraded for r in results)
    pressed = [r for r in results if r.budget_reason == "pressure"]
    assert pressed, [(r.budget_ratio, r.budget_reason) for r in results]
    for r in pressed:
        assert r.budget_ratio < 1.0 and r.predicted_kv_bytes <= 2.2 * full_bytes / 2
        assert r.reserve_ratio <= r.budget_ratio + 0.05
    for r in results:
        assert 0 < r.kv_bytes <= r.kv_reserved_bytes


def test_a_floor_of_one_keeps_full_kv_and_the_jobs_wait_for_room(cluster):
    results = [st.result for st in _run_at_once(cluster, [_job(floor=1.0) for _ in range(3)])]
    assert {r.budget_ratio for r in results} == {1.0}
    assert "floor" in {r.budget_reason for r in results}
    assert all(r.reserve_ratio == pytest.approx(1.0, abs=0.02) for r in results)
    assert max(r.queue_s for r in results) > 0.0          # the third waited: two full caches fit the budget
