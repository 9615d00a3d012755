"""KVCrush (executor/presses/kvcrush.py): head-behaviour bits, anchors, Hamming distances, equal-count
buckets and representatives on a hand-made example (spec kvcrush.md §2.2–2.4, §2.8), the
budget split and its edge cases, and an evicted layer of the tiny GQA model (4 query heads,
2 KV heads, D = 16) that keeps exactly its budget with KVCrush on, for both scorers and GQA modes."""
import pytest
import torch

from executor.presses import kvcrush
from kvcore.plan import CompressionPlan, Eviction, KVCrush, LayerPlan

# The hand-made layer: T = 11 tokens, 1 sink, window 1 -> candidate span C = tokens 1..9 (M = 9,
# local index i = token i + 1). Each query head's top ⌊9/2⌋ = 4 of C (value 1.0 vs 0.1):
TOP = [[1, 2, 3, 8], [0, 2, 6, 8], [2, 3, 4, 7], [0, 2, 5, 8]]      # local indices, heads 0..3
BASE = [1, 4, 7]                                                    # the base scorer's picks (local)
ELIGIBLE = [0, 2, 3, 5, 6, 8]                                       # C minus BASE
# bits of E (h0 h1 h2 h3) and distance to the alternate anchor 0101:
#   e0 0101 d0 | e2 1111 d2 | e3 1010 d4 | e5 0001 d1 | e6 0100 d1 | e8 1101 d1
# sorted by (d, position): e0, e5, e6, e8, e2, e3


def _stats() -> torch.Tensor:
    """[H=4, T=11]: the sink and window score 5.0 (outside C: they must not move thresholds)."""
    s = torch.full((4, 11), 0.1)
    s[:, 0] = s[:, 10] = 5.0
    for h, top in enumerate(TOP):
        s[h, torch.tensor(top) + 1] = 1.0
    return s


def _scores() -> torch.Tensor:
    """[1 stored head, T]: the base ranking, high on tokens 2, 5, 8 (local 1, 4, 7)."""
    s = torch.zeros(1, 11)
    s[0, torch.tensor(BASE) + 1] = torch.tensor([3.0, 2.0, 1.0])
    return s


def _ev(**crush) -> Eviction:
    return Eviction(keep_tokens=6, window=1, sink_tokens=1, scorer="snapkv", kvcrush=KVCrush(**crush))


def test_bits_are_each_heads_top_half_of_the_candidate_span():
    bits = kvcrush.head_bits(_stats()[:, 1:10])                    # [M, H]
    assert bits.shape == (9, 4) and bits.sum(0).tolist() == [4, 4, 4, 4]
    rows = {i: "".join(str(int(b)) for b in bits[i].tolist()) for i in ELIGIBLE}
    assert rows == {0: "0101", 2: "1111", 3: "1010", 5: "0001", 6: "0100", 8: "1101"}


def test_anchors():
    bits = kvcrush.head_bits(_stats()[:, 1:10])[torch.tensor(ELIGIBLE)]   # [S, H]
    assert kvcrush.anchor_bits(bits, "alternate").tolist() == [False, True, False, True]
    # majority over E: head 0 is set in 3 of 6 (a tie -> 0), heads 1 and 3 in 4 of 6, head 2 in 2 of 6
    assert kvcrush.anchor_bits(bits, "mean").tolist() == [False, True, False, True]
    rand = kvcrush.anchor_bits(bits, "random")
    assert torch.equal(rand, kvcrush.anchor_bits(bits, "random"))         # seeded: the same every call
    assert torch.equal(rand, torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(kvcrush.SEED)).bool())
    assert kvcrush.anchor_bits(bits, "ones").all() and not kvcrush.anchor_bits(bits, "zeros").any()


def test_hamming_distances_of_the_worked_example():
    bits = kvcrush.head_bits(_stats()[:, 1:10])[torch.tensor(ELIGIBLE)]
    d = kvcrush.distances(bits, torch.tensor([False, True, False, True]))
    assert d.dtype == torch.int32 and d.tolist() == [0, 2, 4, 1, 1, 1]


@pytest.mark.parametrize("rule, count, picks", [
    ("uniform", 3, [0, 2, 4]),       # buckets [0,2) [2,4) [4,6): middle members
    ("uniform", 2, [1, 4]),          # buckets [0,3) [3,6)
    ("uniform", 4, [0, 1, 3, 4]),    # edges 0 1 3 4 6
    ("linspace", 3, [0, 2, 5]),      # ⌊linspace(0, 5, 3)⌋, both extremes
])
def test_bucket_picks(rule, count, picks):
    assert kvcrush.bucket_picks(6, count, rule).tolist() == picks


def test_random_bucket_picks_stay_in_their_bucket_and_are_seeded():
    got = kvcrush.bucket_picks(100, 7, "random")
    edges = torch.arange(8) * 100 // 7
    assert ((got >= edges[:-1]) & (got < edges[1:])).all()
    assert torch.equal(got, kvcrush.bucket_picks(100, 7, "random"))


@pytest.mark.parametrize("crush, reps", [
    (dict(anchor="alternate"), [0, 2, 6]),                  # sorted e0 e5 e6 e8 e2 e3 -> picks 0, 2, 4
    (dict(anchor="mean"), [0, 2, 6]),                       # the mean anchor is 0101 here too
    (dict(anchor="alternate", bucket_rule="linspace"), [0, 3, 6]),
    (dict(anchor="zeros"), [0, 5, 8]),                      # d = popcount: 2 4 2 1 1 3 -> e5 e6 e0 e3 e8 e2
])
def test_representatives_of_the_worked_example(crush, reps):
    bits = kvcrush.head_bits(_stats()[:, 1:10])
    eligible = torch.zeros(9, dtype=torch.bool)
    eligible[torch.tensor(ELIGIBLE)] = True
    got = kvcrush.representatives(bits, eligible, 3, KVCrush(rep_fraction=0.5, **crush))
    assert got.tolist() == reps


def test_select_splits_the_budget_between_base_picks_and_representatives():
    got = kvcrush.select(_scores(), _stats(), 11, 6, _ev(rep_fraction=0.5, anchor="alternate"))
    # sink 0, base tokens 2 5 8, representatives = local 0 2 6 = tokens 1 3 7, window 10
    assert got.reps.tolist() == [1, 3, 7]
    assert got.rows.tolist() == [[0, 1, 2, 3, 5, 7, 8, 10]]


def test_select_without_representatives_is_plain_eviction():
    from kvcore import scoring
    got = kvcrush.select(_scores(), _stats(), 11, 6, _ev(rep_fraction=0.0))
    assert got.reps.numel() == 0
    assert torch.equal(got.rows, scoring.select(_scores(), 11, 6, 1, 1, 1))
    everything = kvcrush.select(_scores(), _stats(), 11, 50, _ev())       # keep covers C: all kept
    assert everything.rows.tolist() == [list(range(11))]


def test_small_eligible_set_keeps_all_of_it_and_heads_backfill_their_own_ranking():
    """2 stored heads with disjoint picks over C = tokens 1..7 (window 3): the union leaves S = 1 <
    B_rep = 3; it is kept and each head takes its next-best tokens, so every head still holds
    exactly `keep`."""
    scores = torch.zeros(2, 11)
    scores[0, 1:8] = torch.tensor([9., 8., 7., 6., 0., 1., 0.])       # B_imp = 3: tokens 1 2 3
    scores[1, 1:8] = torch.tensor([1., 2., 0., 9., 8., 7., 0.])       # tokens 4 5 6
    ev = Eviction(keep_tokens=6, window=3, sink_tokens=1, kvcrush=KVCrush(rep_fraction=0.5))
    got = kvcrush.select(scores, _stats(), 11, 6, ev)
    assert got.reps.tolist() == [7]                                   # E = token 7
    assert got.rows.tolist() == [[0, 1, 2, 3, 4, 6, 7, 8, 9, 10], [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]]


def test_h2o_bits_use_count_normalised_attention():
    acc = torch.ones(2, 5)
    assert torch.allclose(kvcrush.bit_statistic(acc, "h2o"), 1 / torch.tensor([5., 4., 3., 2., 1.]).expand(2, -1))
    assert kvcrush.bit_statistic(acc, "snapkv") is acc


def test_rep_budget_rounds():
    assert kvcrush.rep_budget(20, KVCrush(0.25)) == 5
    assert kvcrush.rep_budget(7, KVCrush(0.25)) == 2
    assert kvcrush.rep_budget(3, KVCrush(1.0)) == 3


@pytest.mark.parametrize("bad, field", [(dict(anchor="centroid"), "anchor"),
                                        (dict(bucket_rule="kmeans"), "bucket_rule"),
                                        (dict(rep_fraction=1.5), "rep_fraction")])
def test_layer_refuses_an_unknown_kvcrush_setting(tiny_model, bad, field):
    from executor.runner import Runner
    plan = CompressionPlan("t", "test", tuple(LayerPlan(i, eviction=Eviction(keep_tokens=8, kvcrush=KVCrush(**bad)))
                                             for i in range(tiny_model.num_layers)))
    with pytest.raises(ValueError, match=f"kvcrush.{field}"):
        Runner(tiny_model, torch.float16).new_cache(plan)


# -- an evicted layer of the tiny model with KVCrush on -------------------------------------------

CONTEXT = list(range(1000, 1090))          # 90 context tokens


@pytest.mark.parametrize("anchor", ["random", "mean", "alternate"])
@pytest.mark.parametrize("gqa", ["mean", "repeat"])
@pytest.mark.parametrize("scorer", ["snapkv", "h2o"])
def test_evicted_layer_keeps_its_budget_with_representatives_outside_the_base_set(
        tiny_model, monkeypatch, scorer, gqa, anchor):
    from tests.executor.presses.helpers import dense_kv, prefill, seen_by, streams

    calls = []
    real = kvcrush.select

    def spy(scores, stats, t, keep, ev):
        out = real(scores, stats, t, keep, ev)
        calls.append((scores, out))
        return out

    monkeypatch.setattr(kvcrush, "select", spy)
    keep, sinks, window = 20, 2, 8
    ev = Eviction(keep_tokens=keep, window=window, sink_tokens=sinks, scorer=scorer, gqa_mode=gqa, pool_kernel=3,
                  kvcrush=KVCrush(rep_fraction=0.25, anchor=anchor))
    plan = CompressionPlan("t", "test", tuple(LayerPlan(i, eviction=ev) for i in range(tiny_model.num_layers)))
    runner, cache = prefill(tiny_model, plan, CONTEXT)
    assert len(calls) == tiny_model.num_layers

    hq, hk = tiny_model.num_query_heads, tiny_model.num_kv_heads
    heads = hq if gqa == "repeat" else hk
    n_rep = round(0.25 * keep)
    full = dense_kv(tiny_model, CONTEXT)
    for i, (lb, (scores, got)) in enumerate(zip(cache.layer_bytes(), calls)):
        assert got.rows.shape == (heads, sinks + keep + window) and got.reps.numel() == n_rep
        base = scores[:, sinks:90 - window].topk(keep - n_rep, dim=-1).indices + sinks   # [heads, B_imp]
        fixed = set(range(sinks)) | set(range(90 - window, 90))
        for h in range(heads):
            row = got.rows[h].tolist()
            assert len(set(row)) == len(row)                                              # no duplicates
            assert set(row) == fixed | set(base[h].tolist()) | set(got.reps.tolist())
        assert not (set(got.reps.tolist()) & set(base.flatten().tolist()))               # outside every head's picks
        # the pool really stores those tokens' full rows, each seen by the heads that kept it
        per = heads // hk
        for g, (k, _, seen) in enumerate(streams(runner, cache, i)):
            for j in range(per):
                mine = k[seen_by(seen, j)] if gqa == "repeat" else k
                match = (mine[:, None, :] == full[i][0][g][None]).all(-1)                 # [n, T]
                assert match.any(1).all()
                assert sorted(match.float().argmax(1).tolist()) == got.rows[g * per + j].tolist()
        if gqa == "mean":                                       # 30 rows: two pages of 16
            assert lb.kv_bytes == hk * 2 * cache.tables.layout.page_bytes
    cache.close()


def test_kvcrush_layer_selection_is_deterministic(tiny_model):
    from tests.executor.presses.helpers import prefill

    ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="repeat", kvcrush=KVCrush())
    plan = CompressionPlan("t", "test", tuple(LayerPlan(i, eviction=ev) for i in range(tiny_model.num_layers)))
    rows = []
    for _ in range(2):
        runner, cache = prefill(tiny_model, plan, CONTEXT)
        t, s = cache.tables, cache.slot
        from kernels.paged_decode import coded_fields
        rows.append([coded_fields(t.pool.arena, t.ctable[i, s, h], int(t.cn[i, s, h]), t.layout)["heads"].clone()
                     for i in range(tiny_model.num_layers) for h in range(t.H)])
        cache.close()
    assert all(torch.equal(a, b) for a, b in zip(*rows))
