"""Eviction on the tiny model (4 query heads, 2 KV heads, D = 16): the kept rows are the
full-precision rows of the tokens the scorer keeps — per KV head as dense pages (GQA `mean`), per
query head as each group's union of exact coded rows with the heads that keep each (`repeat`) —
a decode query's attention equals dense attention over exactly the rows its head keeps, rows fed
later join every head, and keeping everything reproduces the full cache's tokens."""
import pytest
import torch

from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvcore.plan import Eviction, full_plan
from tests.executor.presses.helpers import (CONTEXT, QUESTION, decode_attend, dense_kv, plan_of, prefill, seen_by,
                                            streams)


@pytest.mark.parametrize("gqa", ["mean", "repeat"])
@pytest.mark.parametrize("scorer", ["snapkv", "h2o", "streaming_llm"])
def test_evicted_rows_are_the_full_rows_and_attention_matches_dense_on_them(tiny_model, gqa, scorer):
    ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer=scorer, gqa_mode=gqa, pool_kernel=3)
    runner, cache = prefill(tiny_model, plan_of(tiny_model.num_layers, eviction=ev))
    hq, hk = tiny_model.num_query_heads, tiny_model.num_kv_heads
    hn = hq // hk
    want_n = 2 + (20 if scorer != "streaming_llm" else 0) + 8
    q = torch.randn(hq, 16, generator=torch.Generator().manual_seed(1))
    for i, (k_full, v_full) in enumerate(dense_kv(tiny_model)):
        want = torch.empty(hq, 16)
        for g, (k, v, heads) in enumerate(streams(runner, cache, i)):
            for j in range(hn):
                mine = seen_by(heads, j)
                assert int(mine.sum()) == want_n                              # each head its own count
                match = (k[mine][:, None, :] == k_full[g][None]).all(-1)        # [n, T]
                assert match.any(1).all()                                       # every row is a full row
                rows = match.float().argmax(1)
                assert torch.equal(v[mine], v_full[g][rows])
                assert set(range(82, 90)) <= set(rows.tolist()) and {0, 1} <= set(rows.tolist())
                h = g * hn + j
                att = torch.softmax(q[h] @ k_full[g][rows].T * 0.25, -1) @ v_full[g][rows]
                want[h] = att
            if gqa == "mean":
                assert bool((heads == 0xFF).all()) and k.shape[0] == want_n   # dense pages, every head sees all
        got = decode_attend(runner, cache, i, q)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    cache.close()


def test_repeat_mode_stores_each_groups_union_once_with_the_heads_that_keep_each(tiny_model):
    ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="repeat", pool_kernel=3)
    runner, cache = prefill(tiny_model, plan_of(tiny_model.num_layers, eviction=ev))
    lay, hn = cache.tables.layout, tiny_model.num_query_heads // tiny_model.num_kv_heads
    for i, lb in enumerate(cache.layer_bytes()):
        unions = [k.shape[0] for k, _, _ in streams(runner, cache, i)]
        assert all(30 <= u <= hn * 30 for u in unions)                        # a union, never h_n copies
        m = int(cache.tables.cn[i, cache.slot, 0])                            # coded rows (padded to the largest)
        assert m == max(unions)
        pages = 1 + 2 * -(-m // lay.entry_rows)                                # a coded page, K and V entries
        assert lb.kv_bytes == tiny_model.num_kv_heads * pages * lay.page_bytes and lb.kind == "evicted"
    cache.close()


def test_rows_fed_later_join_every_head_and_keep_the_pages_growing_by_whole_pages(tiny_model):
    for gqa in ("mean", "repeat"):
        ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer="snapkv", gqa_mode=gqa)
        runner = Runner(tiny_model, torch.float16)
        run = runner.run(Prompt(CONTEXT, QUESTION), plan_of(tiny_model.num_layers, eviction=ev), Sampling(12))
        added = len(QUESTION) + len(run.token_ids) - 1
        for lb in run.layers:
            assert lb.kept_tokens >= 30 + added if gqa == "mean" else lb.kept_tokens >= 30
            if gqa == "mean":                # (a coded union's entry pages outweigh 107 tokens of the tiny model)
                assert lb.kv_bytes < lb.full_kv_bytes


def test_keeping_everything_reproduces_the_full_cache_run(tiny_model):
    ev = Eviction(keep_tokens=10_000, window=8, sink_tokens=0, scorer="snapkv", gqa_mode="repeat")
    runner = Runner(tiny_model, torch.float16)
    prompt = Prompt(CONTEXT, QUESTION)
    full = runner.run(prompt, full_plan(tiny_model.num_layers, "f"), Sampling(10))
    kept = runner.run(prompt, plan_of(tiny_model.num_layers, eviction=ev), Sampling(10))
    assert kept.token_ids == full.token_ids
