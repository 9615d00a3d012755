"""Adaptive budgets through the real services (the embedded default, real model): a job alone
gets the full cache; five at once under a budget of about two full caches get the largest ratio
that fits a fifth each, and every cache stays within the bytes reserved for it to the last token;
a floor of 1.0 keeps the jobs at full KV and they wait for room instead."""
import concurrent.futures as cf

import pytest

from kvplan.client import ExecutorClient, request
from kvplan.demo import DEMO_CONTEXT, DEMO_QUESTION
from protos import executor_pb2 as pb
from tests.executor.stack import demo_full_bytes, embedded_with

NEW = 8


@pytest.fixture(scope="module")
def full_bytes(real_model) -> int:
    return demo_full_bytes(real_model, NEW)


@pytest.fixture(scope="module")
def cluster(model_cfg, real_model_dir, full_bytes):
    with embedded_with(model_cfg, {"KVPLAN_KV_BUDGET_BYTES": str(int(2.2 * full_bytes))}) as e:
        yield e


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
