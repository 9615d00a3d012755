"""Fair admission across tenants (issue 33): the pure policy (`executor.fairness`, deficit round
robin by tokens), and both job backends claiming by it over a real redis-server. Before, the
queue was one FIFO stream: with one tenant's 100 jobs queued, another tenant's job waited
behind all of them (69.9 s for 4 tokens)."""
import collections

import pytest

from executor.fairness import FairQueue, Waiting
from executor.memory_jobs import MemoryJobs
from executor.redis_jobs import RedisJobs


def drain(fair: FairQueue, items: list[Waiting], n: int | None = None) -> list[Waiting]:
    """Pick `n` items (all by default), each time from what still waits."""
    left, out = list(items), []
    while left and (n is None or len(out) < n):
        got = fair.pick(left)
        left.remove(got)
        out.append(got)
    return out


def test_nothing_waiting_is_none_and_one_tenant_is_served_in_order():
    fair = FairQueue()
    assert fair.pick([]) is None
    items = [Waiting(f"a{i}", "a", 100 * (i + 1)) for i in range(5)]
    assert drain(fair, items) == items


def test_a_newcomer_waits_at_most_one_turn_of_a_flooding_tenant():
    fair = FairQueue(quantum=256)
    flood = [Waiting(f"f{i}", "flood", 200) for i in range(100)]
    served = drain(fair, flood, 3)                           # the flood runs alone a while
    late = Waiting("b0", "b", 200)
    order = drain(fair, [*flood[3:], late], 3)
    assert late in order                                     # not behind 97 jobs


def test_equal_weights_share_tokens_and_job_sizes_do_not_buy_more():
    """Tenant a sends jobs 4x the size of b's: over a backlog both get the same tokens."""
    fair = FairQueue(quantum=100)
    items = [Waiting(f"a{i}", "a", 400) for i in range(50)] + [Waiting(f"b{i}", "b", 100) for i in range(200)]
    tokens = collections.Counter()
    for it in drain(fair, items, 100):
        tokens[it.tenant] += it.cost
    assert tokens["a"] == pytest.approx(tokens["b"], rel=0.1)


def test_weights_scale_the_shares():
    weights = {"gold": 3.0, "free": 1.0}
    fair = FairQueue(weight=weights.get, quantum=64)
    items = [Waiting(f"g{i}", "gold", 50) for i in range(400)] + [Waiting(f"f{i}", "free", 50) for i in range(400)]
    tokens = collections.Counter(it.tenant for it in drain(fair, items, 400))
    assert tokens["gold"] / tokens["free"] == pytest.approx(3.0, rel=0.1)


def test_an_idle_tenant_banks_nothing():
    """b was idle while a worked alone: when b comes back it gets its share, not a catch-up."""
    fair = FairQueue(quantum=100)
    a = [Waiting(f"a{i}", "a", 100) for i in range(300)]
    drain(fair, a[:100], 100)
    b = [Waiting(f"b{i}", "b", 100) for i in range(100)]
    tenants = collections.Counter(it.tenant for it in drain(fair, [*a[100:], *b], 40))
    assert tenants["a"] == tenants["b"] == 20


def test_a_huge_job_is_served_after_its_turns_without_spinning():
    fair = FairQueue(quantum=1)
    items = [Waiting("big", "a", 10**12), Waiting("small", "b", 10**11)]
    assert [it.key for it in drain(fair, items)] == ["small", "big"]


def test_a_bad_weight_is_refused():
    with pytest.raises(ValueError, match="weight"):
        FairQueue(weight=lambda t: 0.0).pick([Waiting("x", "a", 1)])
    with pytest.raises(ValueError, match="quantum"):
        FairQueue(quantum=0)


@pytest.fixture(params=["memory", "redis"])
async def backend(request):
    weights = {"gold": 3.0}
    if request.param == "memory":
        b = MemoryJobs(weight=lambda t: weights.get(t, 1.0))
    else:
        b = RedisJobs(request.getfixturevalue("redis_db"), claim_idle_ms=60_000, weight=lambda t: weights.get(t, 1.0))
    await b.open()
    yield b
    await b.close()


async def test_the_queue_claims_a_late_tenants_job_before_a_floods_backlog(backend):
    for i in range(100):
        await backend.submit(f"flood{i}", b"r", b"s", "flood", cost=64)
    await backend.submit("late", b"r", b"s", "late", cost=64)
    order = [(await backend.claim("e1", block_ms=100)).job_id for _ in range(6)]
    # at most one turn of the flood (a quantum of 256 tokens: 4 of its jobs) before the late one
    assert "late" in order[:5] and order.count("late") == 1
    assert await backend.depth() == 101


async def test_the_queue_claims_by_weight(backend):
    for i in range(60):
        await backend.submit(f"g{i}", b"r", b"s", "gold", cost=100)
        await backend.submit(f"f{i}", b"r", b"s", "free", cost=100)
    claims = [await backend.claim("e1", block_ms=100) for _ in range(40)]
    got = collections.Counter(c.tenant for c in claims)
    assert got["gold"] == pytest.approx(3 * got["free"], abs=2)
    for c in claims:                                     # claimed jobs finish and their counts drop
        await backend.finish(c, ttl_s=60)
    assert await backend.depth() == 80


async def test_a_tenant_holding_its_share_of_slots_is_left_waiting(backend):
    """The worker leaves out tenants at KVPLAN_TENANT_MAX_SHARE of its slots: their jobs stay
    queued (for other executors, or for later) and the other tenants' are claimed at once."""
    for i in range(3):
        await backend.submit(f"flood{i}", b"r", b"s", "flood", cost=64)
    assert await backend.claim("e1", block_ms=100, exclude=frozenset({"flood"})) is None
    await backend.submit("late", b"r", b"s", "late", cost=64)
    assert (await backend.claim("e1", block_ms=100, exclude=frozenset({"flood"}))).job_id == "late"
    assert (await backend.claim("e1", block_ms=100)).job_id == "flood0"
