"""Profile stores (in process and in a real Redis): deterministic sampling, job counting per key,
and the running mean of the learned shares."""
import numpy as np
import pytest

from planner.profiles import MemoryProfiles, RedisProfiles, key, sampled


@pytest.mark.parametrize("sample, probed", [
    (0.1, [0, 10, 20]), (0.25, [0, 4, 8, 12, 16, 20, 24]), (1.0, list(range(25))), (0.3, [0, 3, 6, 9, 12, 15, 18, 21, 24]),
])
def test_sampling_probes_the_first_job_then_every_round_1_over_sample_th(sample, probed):
    assert [i for i in range(25) if sampled(i, sample)] == probed


def test_keys_separate_strategy_versions_and_models():
    keys = {key("p", "xkv", "1", "fp", 30), key("p", "xkv", "2", "fp", 30), key("p", "xkv", "1", "fq", 30),
            key("q", "xkv", "1", "fp", 30), key("p", "xkv", "1", "fp", 32)}
    assert len(keys) == 5


async def _exercise(store):
    try:
        assert [await store.next_job("a") for _ in range(3)] == [0, 1, 2]
        assert await store.next_job("b") == 0
        assert await store.shares("a") is None
        await store.add("a", np.array([0.5, 0.25, 0.25]))
        await store.add("a", np.array([0.3, 0.3, 0.4]))
        assert np.allclose(await store.shares("a"), [0.4, 0.275, 0.325])
        assert await store.shares("b") is None
    finally:
        await store.close()


async def test_memory_profiles():
    await _exercise(MemoryProfiles())


async def test_redis_profiles_are_shared_by_replicas(redis_db):
    await _exercise(RedisProfiles(redis_db))
    other = RedisProfiles(redis_db)                       # another planner replica
    try:
        assert await other.next_job("a") == 3
        assert np.allclose(await other.shares("a"), [0.4, 0.275, 0.325])
    finally:
        await other.close()
