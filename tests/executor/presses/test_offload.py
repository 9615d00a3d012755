"""SpeCache's press on the tiny model: every row goes to the store and a low-bit copy (key groups of
32 rows) to the pool, the sinks exact beside it and skipped in it; with exact rows for every
candidate, decoding equals the full cache's token for token; the prefetch takes the low-bit top-k
or re-ranks candidates by their exact keys; the bytes are the pages held and fit the budget; a
store lost mid-job (in process, or a killed cachestore over shared memory) leaves the job on its
low-bit copy, degraded, not failed."""
import dataclasses

import pytest
import torch

from cachestore.handle import LocalHandle, StoreUnavailable, Unavailable
from executor.presses import offload
from executor.presses.context import UnsupportedPlan
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvcore import offload_budget
from kvcore.plan import OffloadPlan, full_plan
from tests.executor.presses.helpers import streams

PROMPT = Prompt(list(range(100, 171)), [])          # 71 tokens


def offload_plan(m: int, **part):
    off = OffloadPlan(enabled=True, **{"low_bits": 2, "group_size": 32, "top_k": 64, "recent_window": 0,
                                       "sink_tokens": 0, **part})
    return dataclasses.replace(full_plan(m, "t"), strategy="specache", offload=off)


def test_the_press_puts_every_row_to_the_store_and_keeps_the_sinks_exact(tiny_model):
    runner = Runner(tiny_model, torch.float16)
    plan = offload_plan(tiny_model.num_layers, sink_tokens=3, recent_window=4, top_k=8)
    store = LocalHandle()
    seq = runner.engine.sequence(PROMPT, plan, Sampling(4), store=store)
    runner.engine.add(seq)
    while not seq.offload_state:
        runner.engine.step()
    t, slot = runner.engine.runner.tables, seq.cache.slot
    lay = t.layout
    g = lay.quant_forms[int(t.qform[0, slot])].rows
    assert lay.quant_forms[int(t.qform[0, slot])].key_group == 32
    for layer in range(tiny_model.num_layers):
        k_all, v_all = store.read(layer)
        assert k_all.shape[1] == 71                                          # every row offloaded
        n = int(t.qn[layer, slot, 0])
        assert n * g + int(t.dend[layer, slot, 0] - t.dstart[layer, slot, 0]) == 71
        for h, (k, v, _) in enumerate(streams(runner, seq.cache, layer)):
            assert torch.equal(k[n * g - 3:n * g], k_all[h, :3].float())     # the sinks, exact, after the low-bit rows
            assert k.shape[0] == 71                                          # skipped in the copy: 71 rows in all
    runner.engine.run_all()
    store.release()


@torch.inference_mode()
def test_scores_over_the_low_bit_keys_equal_the_streams_dequantized_rows(tiny_model):
    """`lowbit_keys` reads the copy's key codes out of its pages as `kernels.lowbit_scores` takes
    them: the scores against them are q · the rows attention dequantizes from the same pages."""
    from kernels import lowbit_scores
    runner = Runner(tiny_model, torch.float16)
    seq = runner.engine.sequence(PROMPT, offload_plan(tiny_model.num_layers, top_k=8), Sampling(4), store=LocalHandle())
    runner.engine.add(seq)
    while not seq.offload_state:
        runner.engine.step()
    t, slot = runner.engine.runner.tables, seq.cache.slot
    codes, scale, zero, bits = offload.lowbit_keys(t, 0, slot)            # [H_kv, n, D, B], [H_kv, n, D] x2
    rows = codes.shape[1] * 32                                             # key groups of 32 rows
    assert bits == 2 and rows == 64                                        # 71 rows: two whole groups
    q = torch.randn(t.H, 3, tiny_model.head_dim, generator=torch.Generator().manual_seed(0))
    want = torch.stack([q[h] @ k[:rows].T for h, (k, _, _) in enumerate(streams(runner, seq.cache, 0))])
    assert torch.allclose(lowbit_scores(q, codes, scale, zero, bits), want, rtol=1e-4, atol=1e-4)
    runner.engine.run_all()


def test_exact_rows_for_every_candidate_reproduce_full_kv(tiny_model):
    """top_k >= every quantized row: each step's mixed cache is exact, so greedy decoding equals
    the full cache's token for token, and every prefetch holds the oracle's rows."""
    runner = Runner(tiny_model, torch.float16, prefetch_wait_s=30.0)     # the `wait` policy: none is late
    full = runner.run(PROMPT, full_plan(tiny_model.num_layers, "t"), Sampling(8))
    store = LocalHandle()
    got = runner.run(PROMPT, offload_plan(tiny_model.num_layers, low_bits=2, top_k=128), Sampling(8),
                     store=store, measure_recall=True)
    assert got.token_ids == full.token_ids and len(got.token_ids) == 8
    assert got.offload["recall"] == 1.0 and got.offload["stats"]["late"] == 0
    assert got.offload["stats"]["prefetches"] == tiny_model.num_layers * 8     # predecode + 7 steps, per layer
    assert got.layers[0].kind == "offload" and not got.degraded
    k, _ = store.read(0)
    assert k.shape == (tiny_model.num_kv_heads, 71 + 7, tiny_model.head_dim)     # every committed row offloaded
    store.release()


@torch.inference_mode()
@pytest.mark.parametrize("rerank", [1, 32])
def test_the_prefetch_takes_the_low_bit_top_k_or_re_ranks_candidates_by_exact_keys(tiny_model, rerank):
    """rerank 1 (SpeCache as published): the top-k of the guess's attention over the low-bit keys.
    rerank 32: every low-bit row is a candidate, so the rows brought are the query's top-k over
    the exact keys whatever the low-bit scores say."""
    runner, store = Runner(tiny_model, torch.float16), LocalHandle()
    plan = offload_plan(tiny_model.num_layers, top_k=4, rerank=rerank)
    seq = runner.engine.sequence(PROMPT, plan, Sampling(4), store=store)
    runner.engine.add(seq)
    while not seq.offload_state:
        runner.engine.step()
    ctx, hk, d = runner.engine.runner.press, tiny_model.num_kv_heads, tiny_model.head_dim
    hn = tiny_model.num_query_heads // hk
    q = torch.randn(hk, hn, d, generator=torch.Generator().manual_seed(5))
    codes, scale, zero, bits = offload.lowbit_keys(ctx.tables, 1, seq.cache.slot)
    from kernels import lowbit_scores
    scores = lowbit_scores(q, codes, scale, zero, bits) * ctx.scaling                 # [H_kv, h_n, Q]
    lse = torch.logsumexp(scores, -1)
    offload.select(ctx, seq, 1, q, lse, step=3)
    got = store.take(1, 3, wait_s=5.0).idx.sort(-1).values                            # [H_kv, 4]
    if rerank == 1:
        expect = torch.exp(scores - lse[..., None]).mean(1).topk(4, dim=-1).indices
    else:
        keys = store.read(1)[0].float()[:, :scores.shape[-1]]                         # [H_kv, Q, D] exact
        expect = torch.softmax(torch.einsum("ghd,gld->ghl", q * ctx.scaling, keys), -1).mean(1).topk(4, -1).indices
    assert torch.equal(got, expect.sort(-1).values)
    runner.engine.run_all()
    store.release()


@torch.inference_mode()
def test_offload_bytes_are_the_pages_held_and_fit_the_budget(tiny_model):
    runner = Runner(tiny_model, torch.float16)
    prompt = Prompt(list(range(100, 400)), [])
    run = runner.run(prompt, offload_plan(tiny_model.num_layers, top_k=64, recent_window=64), Sampling(5), budget=0.9)
    part = OffloadPlan(**run.offload["part"])
    assert part.top_k < 64 or part.recent_window < 64          # shrunk to fit
    ratio = run.kv_bytes / run.full_kv_bytes
    assert ratio <= offload_budget.ratio(part, 300, 5, tiny_model.head_dim) + 1e-9
    page = runner.engine.runner.layout.page_bytes
    assert all(lb.kv_bytes % page == 0 and lb.kind == "offload" for lb in run.layers)


class DiesAfter(LocalHandle):
    """A store that goes away after `n` puts, as a killed cachestore does."""

    def __init__(self, n: int):
        super().__init__()
        self.left = n

    def _put(self, layer, k, v):
        self.left -= 1
        if self.left < 0:
            raise StoreUnavailable("cachestore at 127.0.0.1:1 went away")
        super()._put(layer, k, v)


@torch.inference_mode()
def test_a_store_lost_mid_job_finishes_on_the_low_bit_copy(tiny_model):
    runner = Runner(tiny_model, torch.float16)
    plan = offload_plan(tiny_model.num_layers)
    store = DiesAfter(tiny_model.num_layers + 3)        # the prompt's rows, then three decode rows
    run = runner.run(PROMPT, plan, Sampling(8), store=store)
    assert len(run.token_ids) == 8 and run.finish_reason == "length"
    assert run.degraded and "went away" in run.offload["error"]
    unreachable = runner.run(PROMPT, plan, Sampling(4), store=Unavailable("connection refused"))
    assert len(unreachable.token_ids) == 4 and unreachable.degraded and unreachable.offload["transport"] == "none"


def test_an_offload_part_the_pool_has_no_form_for_is_refused(tiny_model):
    with pytest.raises(UnsupportedPlan, match="group_size 16"):
        Runner(tiny_model, torch.float16).new_cache(offload_plan(tiny_model.num_layers, group_size=16))


@torch.inference_mode()
def test_cachestore_killed_mid_job_over_shared_memory_the_job_completes_degraded(tiny_model):
    """The real transport: a `python -m cachestore` process, the job's rows in its segment; it is
    SIGKILLed after the second token; the job still produces every token, reports degraded, and
    leaves nothing in /dev/shm once released."""
    from cachestore.process import spawn
    from cachestore.segment import leftovers

    with spawn(timeout_s=2) as (proc, client):
        plan = offload_plan(tiny_model.num_layers)
        store = client.open("acme", "killed-mid-job", tiny_model.num_layers, tiny_model.num_kv_heads,
                            tiny_model.head_dim, torch.float16, PROMPT.num_tokens + 10, plan.offload.top_k)
        assert store.transport == "shm"
        steps = []

        def cancelled():                      # asked per prefill chunk (one) and per token: kill after the second token
            steps.append(1)
            if len(steps) == 3:
                proc.kill()
                proc.wait(30)
            return False

        run = Runner(tiny_model, torch.float16, prefetch_wait_s=5.0).run(PROMPT, plan, Sampling(8), cancelled=cancelled,
                                                                        store=store)
        assert len(run.token_ids) == 8 and run.degraded and run.offload["transport"] == "shm"
        assert "UNAVAILABLE" in run.offload["error"]
        store.release()
        assert store.seg.name not in leftovers()
