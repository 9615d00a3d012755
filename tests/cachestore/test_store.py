"""BlockStore: round trips, appends, gathers, capacity + LRU across jobs, pins, release,
tenant isolation and prefetch staging."""
from __future__ import annotations

import threading

import pytest
import torch

from cachestore import BlockKey, BlockStore, CapacityError, JobKey

D = 8
ROW_BYTES = 8 + 2 * D * 2   # one row: int64 position + fp16 K and V


def rows(t: int, start: int = 0, seed: int = 0, dtype=torch.float16, d: int = D):
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(start, start + t)                 # [T]
    k = torch.randn(t, d, generator=g).to(dtype)               # [T, D]
    v = torch.randn(t, d, generator=g).to(dtype)               # [T, D]
    return positions, k, v


def key(job="j", tenant="acme", layer=0, head=0) -> BlockKey:
    return BlockKey(tenant, job, layer, head)


def test_put_get_round_trip_is_byte_exact_and_counts_real_bytes():
    store = BlockStore(1 << 20)
    p, k, v = rows(5)
    assert store.put(key(), p, k, v) == (5, 5 * ROW_BYTES)
    got = store.get(key())
    assert got.k.numpy().tobytes() == k.numpy().tobytes()
    assert got.v.numpy().tobytes() == v.numpy().tobytes()
    assert got.positions.tolist() == [0, 1, 2, 3, 4] and got.staged is False
    assert store.stats().used_bytes == 5 * ROW_BYTES


def test_put_copies_by_default():
    store = BlockStore(1 << 20)
    p, k, v = rows(3)
    store.put(key(), p, k, v)
    k.zero_()
    assert store.get(key()).k.abs().sum() > 0


def test_append_keeps_order_and_checks_shape_and_dtype():
    store = BlockStore(1 << 20)
    p1, k1, v1 = rows(3, seed=1)
    p2, k2, v2 = rows(4, start=3, seed=2)
    store.put(key(), p1, k1, v1)
    assert store.put(key(), p2, k2, v2) == (7, 7 * ROW_BYTES)
    got = store.get(key())
    assert torch.equal(got.k, torch.cat([k1, k2])) and torch.equal(got.v, torch.cat([v1, v2]))
    assert got.positions.tolist() == list(range(7))
    with pytest.raises(ValueError, match=r"k.shape: D=4 does not match the block's D=8"):
        store.put(key(), *rows(2, d=4))
    with pytest.raises(ValueError, match=r"k.dtype: float32 does not match the block's float16"):
        store.put(key(), *rows(2, dtype=torch.float32))
    assert store.get(key()).k.shape == (7, D), "a rejected append leaves the block as it was"


@pytest.mark.parametrize("mutate, message", [
    (lambda p, k, v: (p, k, v[:, :4]), r"v.shape: \[3, 4\] does not match k.shape \[3, 8\]"),
    (lambda p, k, v: (p, k, v.float()), "v.dtype: float32 does not match k.dtype float16"),
    (lambda p, k, v: (p[:2], k, v), "positions: 2 values for 3 rows of k"),
    (lambda p, k, v: (p, k[0], v[0]), r"k.shape: must be \[T, D\]"),
    (lambda p, k, v: (p, k.long(), v.long()), "k.dtype: must be a floating dtype"),
])
def test_put_rejects_malformed_rows_naming_the_field(mutate, message):
    store = BlockStore(1 << 20)
    with pytest.raises(ValueError, match=message):
        store.put(key(), *mutate(*rows(3)))
    assert store.stats().blocks == 0


def test_key_validation_names_the_field():
    with pytest.raises(ValueError, match="key.tenant: must not be empty"):
        BlockKey("", "j", 0, 0)
    with pytest.raises(ValueError, match="key.layer: must be >= 0"):
        BlockKey("t", "j", -1, 0)
    with pytest.raises(ValueError, match="^tenant: must not be empty"):
        BlockStore(100).release("", "j")


def test_gather_by_token_indices():
    store = BlockStore(1 << 20)
    p, k, v = rows(6, start=100)
    store.put(key(), p[:2], k[:2], v[:2])
    store.put(key(), p[2:], k[2:], v[2:])        # gather spans both appended chunks
    got = store.get(key(), token_indices=[5, 0, 3, 3])
    assert got.positions.tolist() == [105, 100, 103, 103]
    assert torch.equal(got.k, k[[5, 0, 3, 3]]) and torch.equal(got.v, v[[5, 0, 3, 3]])
    with pytest.raises(ValueError, match="token_indices: index 7 out of range for 6 rows"):
        store.get(key(), token_indices=[1, 7])


def test_lru_evicts_least_recently_used_job_with_all_its_blocks():
    store = BlockStore(capacity_bytes=12 * ROW_BYTES)
    for job in ("a", "b", "c"):
        store.put(key(job, layer=0), *rows(2))
        store.put(key(job, layer=1), *rows(2))     # each job: 2 blocks, 4 rows
    store.get(key("a"))                            # a is now the most recently used
    store.put(key("d"), *rows(4))                  # needs one job's room: b is the LRU
    assert not store.contains(key("b", layer=0)) and not store.contains(key("b", layer=1))
    assert all(store.contains(key(j)) for j in ("a", "c", "d"))
    s = store.stats()
    assert (s.evictions, s.jobs, s.blocks, s.used_bytes) == (1, 3, 5, 12 * ROW_BYTES)
    assert store.get(key("b")) is None and store.stats().misses == 1


def test_pinned_job_is_never_evicted_even_when_least_recently_used():
    store = BlockStore(capacity_bytes=8 * ROW_BYTES)
    store.put(key("old"), *rows(4), pin=True)      # least recently used, but pinned
    store.put(key("new"), *rows(4))
    store.put(key("next"), *rows(4))               # must evict "new", not "old"
    assert store.contains(key("old")) and not store.contains(key("new"))
    with pytest.raises(CapacityError):
        store.put(key("next"), *rows(1))           # only "old" (pinned) and itself are left
    assert store.get(key("old")).k.shape == (4, D) and store.stats().evictions == 1


def test_capacity_error_when_only_pinned_jobs_fill_it():
    store = BlockStore(capacity_bytes=8 * ROW_BYTES)
    store.put(key("p1"), *rows(4), pin=True)
    store.put(key("p2"), *rows(4), pin=True)
    with pytest.raises(CapacityError, match="pinned"):
        store.put(key("x"), *rows(1))
    s = store.stats()
    assert (s.jobs, s.pinned_jobs, s.evictions, s.used_bytes) == (2, 2, 0, 8 * ROW_BYTES)
    assert not store.contains(key("x"))


def test_failed_put_evicts_nothing_and_own_job_is_not_a_victim():
    store = BlockStore(capacity_bytes=8 * ROW_BYTES)
    store.put(key("pinned"), *rows(4), pin=True)
    store.put(key("idle"), *rows(2))
    store.put(key("grow"), *rows(2))
    with pytest.raises(CapacityError):
        store.put(key("grow"), *rows(3))          # would need "idle" and its own job's rows
    assert store.contains(key("idle")) and store.get(key("grow")).k.shape == (2, D)
    assert store.stats().evictions == 0


def test_release_unpins_and_frees_unless_keep():
    store = BlockStore(capacity_bytes=8 * ROW_BYTES)
    store.put(key("a", layer=0), *rows(2), pin=True)
    store.put(key("a", layer=1), *rows(2), pin=True)
    store.put(key("b"), *rows(4), pin=True)
    assert store.release("acme", "a") == 4 * ROW_BYTES
    assert not store.contains(key("a")) and store.stats().used_bytes == 4 * ROW_BYTES
    assert store.release("acme", "b", keep=True) == 0
    assert store.contains(key("b")) and store.stats().pinned_jobs == 0
    store.put(key("c"), *rows(8))                 # "b" is unpinned now, so it can be evicted
    assert not store.contains(key("b")) and store.stats().evictions == 1
    assert store.release("acme", "unknown") == 0


def test_tenant_isolation():
    store = BlockStore(1 << 20)
    store.put(key(tenant="a"), *rows(3, seed=1))
    assert store.get(key(tenant="b")) is None
    assert store.prefetch(key(tenant="b"), step=1) is False
    assert store.release("b", "j") == 0 and store.contains(key(tenant="a"))
    store.put(key(tenant="b"), *rows(2, seed=2))  # same job id, other tenant: its own block
    assert store.get(key(tenant="a")).k.shape[0] == 3 and store.get(key(tenant="b")).k.shape[0] == 2
    assert store.stats(tenant="b").misses == 1 and store.stats(tenant="a").misses == 0
    assert store.stats(tenant="a").used_bytes == 3 * ROW_BYTES


def test_prefetch_staging_is_served_once_for_the_same_step_and_indices():
    store = BlockStore(1 << 20)
    p, k, v = rows(6)
    store.put(key(), p, k, v)
    assert store.prefetch(key(), step=3, token_indices=[4, 1])
    store.put(key(), *rows(2, start=6))           # appending does not invalidate staged rows
    got = store.get(key(), token_indices=[4, 1], step=3)
    assert got.staged and torch.equal(got.k, k[[4, 1]]) and got.positions.tolist() == [4, 1]
    again = store.get(key(), token_indices=[4, 1], step=3)
    assert not again.staged and torch.equal(again.k, k[[4, 1]])
    s = store.stats()
    assert (s.prefetches, s.prefetch_hits, s.hits, s.staged_bytes) == (1, 1, 2, 0)


def test_prefetch_other_indices_or_stale_steps_are_dropped():
    store = BlockStore(1 << 20)
    store.put(key(), *rows(6))
    store.prefetch(key(), step=1, token_indices=[0])
    store.prefetch(key(), step=2, token_indices=[1])
    store.prefetch(key(), step=5, token_indices=[2])
    assert not store.get(key(), token_indices=[3], step=2).staged   # other indices: not served
    assert store.stats().staged_bytes > 0                            # step 5 is still waiting
    assert store.get(key(), token_indices=[2], step=5).staged
    assert not store.get(key(), token_indices=[0], step=1).staged   # dropped as stale at step 2
    assert store.stats().staged_bytes == 0 and store.stats().prefetch_hits == 1


def test_prefetch_rejects_bad_indices_and_eviction_drops_staging():
    store = BlockStore(capacity_bytes=4 * ROW_BYTES)
    store.put(key("a"), *rows(4))
    with pytest.raises(ValueError, match="token_indices: index 4 out of range for 4 rows"):
        store.prefetch(key("a"), step=1, token_indices=[4])
    assert store.prefetch(key("a"), step=1, token_indices=None)
    store.put(key("b"), *rows(4))                 # evicts "a" and its staged rows
    assert store.stats().staged_bytes == 0 and store.get(key("a"), step=1) is None


def test_concurrent_puts_and_gets_keep_accounting_consistent():
    store = BlockStore(capacity_bytes=64 * ROW_BYTES)

    def work(i: int):
        for n in range(20):
            store.put(key(f"job{i}", layer=n % 3), *rows(1, start=n))
            store.get(key(f"job{i}", layer=n % 3))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = store.stats()
    assert s.used_bytes <= s.capacity_bytes and s.used_bytes == (s.used_bytes // ROW_BYTES) * ROW_BYTES
    assert s.hits + s.misses == 120 and s.evictions > 0
    per_job = sum(store.stats(job_id=f"job{i}").used_bytes for i in range(6))
    assert per_job == s.used_bytes
    assert JobKey("acme", "job0") == key("job0").job


def test_spill_tier_keeps_an_evicted_jobs_rows_in_real_redis(redis_db):
    """LRU eviction writes the job's blocks to Redis; a later read reloads them byte-exact; the
    tenant is part of the key; Release drops the spilled rows."""
    from cachestore.spill import RedisSpill
    spill = RedisSpill(redis_db, ttl_s=60)
    store = BlockStore(12 * ROW_BYTES, spill=spill)
    p, k, v = rows(8, seed=3)
    store.put(key("a", layer=2, head=1), p, k, v)
    store.put(key("b"), *rows(8, seed=4))                 # evicts a (least recently used)
    assert not store.contains(key("a", layer=2, head=1)) and store.stats().spilled == 1
    assert store.get(key("a", tenant="other", layer=2, head=1)) is None     # another tenant: nothing
    got = store.get(key("a", layer=2, head=1), [0, 7, 3])                    # reloaded (evicting b)
    assert torch.equal(got.k, k[[0, 7, 3]]) and torch.equal(got.v, v[[0, 7, 3]])
    assert torch.equal(got.positions, p[[0, 7, 3]])
    assert store.stats().reloaded == 1 and store.stats(tenant="acme").spilled == 2   # b went out in turn
    store.release("acme", "a")
    assert spill.load(key("a", layer=2, head=1)) is None and spill.load(key("b")) is not None
    spill.close()
