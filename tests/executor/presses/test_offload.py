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
    codes, scale, zero, bits = offload.lowbit_keys(t, 0, [slot])          # [H_kv, n, D, B], [H_kv, n, D] x2
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
    codes, scale, zero, bits = offload.lowbit_keys(ctx.tables, 1, [seq.cache.slot])
    from kernels import lowbit_scores
    scores = lowbit_scores(q, codes, scale, zero, bits) * ctx.scaling                 # [H_kv, h_n, Q]
    lse = torch.logsumexp(scores, -1)
    offload.select(ctx, [seq], 1, q[None], lse[None], steps=[3])
    got = store.take(1, 3, wait_s=5.0).idx.sort(-1).values                            # [H_kv, 4]
    if rerank == 1:
        expect = torch.exp(scores - lse[..., None]).mean(1).topk(4, dim=-1).indices
    else:
        keys = store.read(1)[0].float()[:, :scores.shape[-1]]                         # [H_kv, Q, D] exact
        expect = torch.softmax(torch.einsum("ghd,gld->ghl", q * ctx.scaling, keys), -1).mean(1).topk(4, -1).indices
    assert torch.equal(got, expect.sort(-1).values)
    runner.engine.run_all()
    store.release()


def _batch(m: int) -> list[tuple[Prompt, object]]:
    """SpeCache jobs of two low-bit widths (two quant forms), prompt lengths, top-k and re-ranking."""
    return [(Prompt(list(range(100, 171)), []), offload_plan(m, top_k=8, sink_tokens=2, recent_window=8)),
            (Prompt(list(range(300, 420)), []), offload_plan(m, top_k=16, rerank=4, recent_window=8)),
            (Prompt(list(range(500, 580)), []), offload_plan(m, low_bits=1, top_k=8, sink_tokens=3)),
            (Prompt(list(range(700, 840)), []), offload_plan(m, top_k=4, rerank=2, sink_tokens=1))]


@torch.inference_mode()
def test_a_batch_of_offload_sequences_gives_each_ones_tokens_alone(tiny_model):
    """SpeCache jobs decoding together (each layer's placing, scoring and prefetching done for all of
    them at once) give each job's greedy tokens alone, prefetches waited for (none late)."""
    from executor.engine import KVBudget, LLMEngine, Status
    jobs = _batch(tiny_model.num_layers)
    runner = Runner(tiny_model, torch.float16, prefetch_wait_s=30.0)
    solo = [runner.run(prompt, plan, Sampling(10)) for prompt, plan in jobs]
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefetch_wait_s=30.0)
    seqs = [engine.sequence(prompt, plan, Sampling(10)) for prompt, plan in jobs]
    for seq in seqs:
        engine.add(seq)
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, sum(s.status is Status.DECODE for s in engine.scheduler.running))
    assert most == len(jobs)                                             # they really decoded together
    for seq, alone in zip(seqs, solo):
        assert seq.generated == alone.token_ids and len(alone.token_ids) == 10
        assert alone.offload["stats"]["late"] == 0


@torch.inference_mode()
def test_batched_select_and_place_match_each_sequence_alone(tiny_model):
    """`select` over several sequences (padded low-bit copies, two quant forms) prefetches for each
    the rows the published rule picks for it alone — the top rerank·k of its group's mean attention
    over its own low-bit keys, sinks excepted — and `place` puts each one's rows into its slots,
    exact, and hides them (and the sinks) in its low-bit copy."""
    from executor.engine import KVBudget, LLMEngine, Status
    from kernels import lowbit_scores
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40))
    jobs = _batch(tiny_model.num_layers)
    stores = [LocalHandle() for _ in jobs]
    seqs = [engine.sequence(prompt, plan, Sampling(32), store=store) for (prompt, plan), store in zip(jobs, stores)]
    for seq in seqs:
        engine.add(seq)
    while not all(seq.offload_state for seq in seqs):
        engine.step()
    assert all(seq.status is not Status.FINISHED for seq in seqs)       # none finished: their slots theirs
    ctx, hk, d, layer = engine.runner.press, tiny_model.num_kv_heads, tiny_model.head_dim, 1
    hn = tiny_model.num_query_heads // hk
    q = torch.randn(len(seqs), hk, hn, d, generator=torch.Generator().manual_seed(7))
    lse = torch.randn(len(seqs), hk, hn, generator=torch.Generator().manual_seed(8)) + 3
    offload.select(ctx, seqs, layer, q, lse, steps=[90 + i for i in range(len(seqs))])
    for i, (seq, store) in enumerate(zip(seqs, stores)):                 # the per-sequence reference
        if not int(ctx.tables.qn[layer, seq.cache.slot, 0]):                 # no low-bit rows yet: nothing to fetch
            assert store.take(layer, 90 + i, wait_s=0.0) is None
            continue
        codes, scale, zero, bits = offload.lowbit_keys(ctx.tables, layer, [seq.cache.slot])
        probs = torch.exp(lowbit_scores(q[i], codes, scale, zero, bits) * ctx.scaling - lse[i, ..., None]).mean(1)
        off, sinks = seq.plan.offload, seq.offload_state[layer]["sinks"]
        kk = min(off.top_k, probs.shape[1] - sinks)
        expect = probs[:, sinks:].topk(min(kk * off.rerank, probs.shape[1] - sinks), dim=-1).indices + sinks
        if off.rerank > 1:                                               # narrowed by the exact keys
            keys = store.read(layer)[0].float()
            pick = torch.softmax(torch.einsum("ghd,gcd->ghc", q[i] * ctx.scaling, keys.gather(
                1, expect[..., None].expand(-1, -1, d))), -1).mean(1).topk(kk, -1).indices
            expect = expect.gather(1, pick)
        got = store.take(layer, 90 + i, wait_s=5.0)
        assert torch.equal(got.idx.sort(-1).values, expect.sort(-1).values), i
        store._pending[(layer, 90 + i)] = _done(got)                      # put back for `place`
    offload.place(ctx, seqs, layer, steps=[90 + i for i in range(len(seqs))])
    for seq, store in zip(seqs, stores):
        fetched = seq.offload_state[layer]["fetched"]                    # [H_kv, k] positions
        if fetched is None:
            continue
        k_all, _ = store.read(layer)
        sinks = seq.offload_state[layer]["sinks"]
        for h in range(hk):
            k, _, _ = ctx.tables.stream(layer, seq.cache.slot, h, engine.runner.rope_tables)   # [U, D] as attention sees them
            assert k.shape[0] == k_all.shape[1]                           # each row seen once: exact or low-bit
            exact = k_all[h, torch.cat([torch.arange(sinks), fetched[h].long()])].float()   # [sinks + k, D]
            assert (k[None] == exact[:, None]).all(-1).any(-1).all()      # the sinks and the rows brought, exact
    engine.run_all()
    for store in stores:
        store.release()


def _done(value):
    from concurrent.futures import Future
    fut = Future()
    fut.set_result(value)
    return fut


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
