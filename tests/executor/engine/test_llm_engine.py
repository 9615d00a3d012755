"""The engine on the tiny model: a job's tokens and bytes are the same alone or batched with jobs of
every other layer kind; the bytes the caches hold never pass the budget nor a sequence its
reservation; a long prompt prefills a chunk per step beside running decodes; admission waits for
room; a job too large for the whole budget is refused; cancel ends a job and frees its bytes."""
import dataclasses
import random

import pytest
import torch

from executor.engine import KVBudget, LLMEngine, OverBudget, Sampling, Status
from kvcore.statistics import LayerStatistics
from executor.prompt import Prompt
from executor.runner import Runner
from kvcore.plan import (Codebook, CompressionPlan, Eviction, LayerPlan, Merge, OffloadPlan, Quant,
                         full_plan)

REPEAT = Eviction(keep_tokens=20, window=8, scorer="snapkv", gqa_mode="repeat", span_tokens=4, sink_tokens=2)
MEAN = Eviction(keep_tokens=20, window=8, scorer="snapkv", gqa_mode="mean")


def _plans(m: int) -> dict[str, CompressionPlan]:
    def each(**parts):
        return CompressionPlan("p", "t", tuple(LayerPlan(i, **parts) for i in range(m)))
    return {
        "full": full_plan(m, "f"),
        "snapkv-repeat": each(eviction=REPEAT),
        "snapkv-mean": each(eviction=MEAN),
        "h2o": each(eviction=dataclasses.replace(MEAN, scorer="h2o")),
        "codebook": each(eviction=REPEAT, codebook=Codebook(0.6, 0.5)),
        "quant": each(eviction=MEAN, quant=Quant(bits=4, group_size=16, residual=8)),
        "merge": CompressionPlan("p", "t", (LayerPlan(0), LayerPlan(1, merge=Merge(0, 0.6, 0.1, 0.1)))),
        "offload": dataclasses.replace(full_plan(m, "o"), offload=OffloadPlan(
            enabled=True, low_bits=2, group_size=32, top_k=16, recent_window=8, sink_tokens=2, value_group_size=16,
            rerank=1)),
    }


def _jobs(m: int, seed: int = 0) -> list[tuple[str, CompressionPlan, Prompt]]:
    rng = random.Random(seed)
    jobs = []
    for name, plan in _plans(m).items():
        context = [rng.randint(100, 40000) for _ in range(rng.randint(60, 140))]
        jobs.append((name, plan, Prompt(context, [rng.randint(100, 40000) for _ in range(rng.randint(0, 9))])))
    return jobs


@pytest.mark.parametrize("sampling", [Sampling(12), Sampling(12, temperature=1.0, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_a_jobs_tokens_and_bytes_are_the_same_alone_or_batched_with_every_layer_kind(tiny_model, sampling):
    jobs = _jobs(tiny_model.num_layers)
    # SpeCache's prefetches wait until they land (the `wait` policy): on time alone or batched
    runner = Runner(tiny_model, torch.float16, prefill_chunk=32, prefetch_wait_s=30.0)
    solo = {name: runner.run(prompt, plan, sampling) for name, plan, prompt in jobs}
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), max_batched_tokens=40, prefill_chunk=32,
                       prefetch_wait_s=30.0)
    seqs = {name: engine.sequence(prompt, plan, sampling) for name, plan, prompt in jobs}
    for seq in seqs.values():
        engine.add(seq)
    most, prefilled = 0, None
    full = seqs["full"]
    while engine.has_work():
        engine.step()
        most = max(most, sum(s.status is Status.DECODE for s in engine.scheduler.running))
        if prefilled is None and full.status is Status.DECODE:       # its prompt's rows, before any decode row
            prefilled = engine.runner.tables.dense(0, full.cache.slot)
    assert most >= 4                                   # they really decoded together
    for name, seq in seqs.items():
        assert seq.generated == solo[name].token_ids, name
        assert seq.cache.layer_bytes() == solo[name].layers, name
        assert seq.final_text == solo[name].text
    alone = runner.new_cache(full_plan(tiny_model.num_layers, "f"))
    runner.prefill(jobs[0][2], alone)
    k, v = runner.engine.runner.tables.dense(0, alone.slot)
    alone.close()
    assert torch.equal(prefilled[0], k) and torch.equal(prefilled[1], v)      # bit for bit, in the pool


def test_bytes_held_never_pass_the_budget_nor_a_sequence_its_reservation(tiny_model):
    jobs = _jobs(tiny_model.num_layers, seed=1) * 2
    probe = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    needs = [probe.reservation(plan, prompt, Sampling(16)) for _, plan, prompt in jobs]
    budget = KVBudget(3 * max(needs))                                    # a few jobs at a time
    engine = LLMEngine(tiny_model, torch.float16, budget, max_batched_tokens=48, prefill_chunk=32)
    seqs = [engine.sequence(prompt, plan, Sampling(16)) for _, plan, prompt in jobs]
    for seq in seqs:
        engine.add(seq)
    peak, most, waited = 0, 0, False
    while engine.has_work():
        engine.step()
        held = {s.seq_id: s.kv_bytes() for s in engine.scheduler.running}
        for s in engine.scheduler.running:
            assert held[s.seq_id] <= budget.held(s.seq_id), (s.plan.plan_id, held[s.seq_id], budget.held(s.seq_id))
        assert sum(held.values()) <= budget.total and budget.reserved <= budget.total
        peak, most = max(peak, sum(held.values())), max(most, len(engine.scheduler.running))
        waited |= bool(engine.scheduler.waiting)
    assert waited and 2 <= most < len(jobs)                              # the budget, not the count, limited them
    assert budget.reserved == 0 and budget.peak_measured == peak > 0
    assert all(s.status is Status.FINISHED and len(s.generated) >= 1 for s in seqs)


def test_a_compressed_job_reserves_less_once_its_context_is_compressed(tiny_model):
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    _, plan, prompt = _jobs(tiny_model.num_layers)[1]                    # snapkv, repeat mode
    seq = engine.sequence(prompt, plan, Sampling(8))
    before = seq.reserved
    assert before >= engine.reservation(full_plan(tiny_model.num_layers, "f"), Prompt(prompt.context_ids, []),
                                        Sampling(1))                  # the prefill holds the dense context
    engine.add(seq)
    while seq.status is not Status.DECODE:
        engine.step()
    # coded rows (each group's union of 30 rows a head: a coded page and K and V entry pages) and the
    # growth of the dense tail: below the dense prefill's reservation, in whole pages of the tiny model
    assert seq.kv_bytes() <= seq.reserved < before
    assert seq.reserved == seq.cache.bytes_bound([1] * (seq.sampling.max_new_tokens - 1))


def test_a_long_prompt_prefills_a_chunk_per_step_beside_running_decodes(tiny_model):
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), max_batched_tokens=32, prefill_chunk=32)
    short = [engine.sequence(Prompt(list(range(100 + i, 140 + i)), []), full_plan(2, "f"), Sampling(40))
             for i in range(3)]
    for seq in short:
        engine.add(seq)
    while any(s.status is not Status.DECODE for s in short):
        engine.step()
    long = engine.sequence(Prompt(list(range(2000, 2200)), []), full_plan(2, "f"), Sampling(4))
    engine.add(long)
    steps = 0
    while long.status is not Status.DECODE:
        before = [len(s.generated) for s in short]
        engine.step()
        steps += 1
        assert [len(s.generated) for s in short] == [b + 1 for b in before]      # every decode got its token
    assert steps == 7                     # 200 tokens in 32-token parts (the last holds the rest): never at once


def test_a_job_larger_than_the_whole_budget_is_refused_naming_both_numbers(tiny_model):
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(10_000), prefill_chunk=32)
    assert engine.budget.total == 9 * 1024            # the budget in whole pages (head dim 16: 1,024 bytes a page)
    with pytest.raises(OverBudget) as e:
        engine.sequence(Prompt(list(range(100, 400)), []), full_plan(2, "f"), Sampling(8))
    assert "9216 bytes" in str(e.value) and str(e.value.need) in str(e.value)


def test_cancel_ends_a_running_job_and_frees_its_bytes(tiny_model):
    budget = KVBudget(1 << 40)
    engine = LLMEngine(tiny_model, torch.float16, budget, prefill_chunk=32)
    stop = {"now": False}
    a = engine.sequence(Prompt(list(range(100, 160)), []), full_plan(2, "f"), Sampling(50), cancelled=lambda: stop["now"])
    b = engine.sequence(Prompt(list(range(300, 360)), []), full_plan(2, "f"), Sampling(10))
    engine.add(a), engine.add(b)
    for _ in range(5):
        engine.step()
    stop["now"] = True
    ended = engine.step()
    assert a in ended and a.finish_reason == "cancelled" and budget.held(a.seq_id) == 0
    engine.run_all()
    assert b.finish_reason in ("eos", "length") and budget.reserved == 0


def test_ignore_eos_generates_max_new_tokens_past_the_end_token(tiny_model):
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    prompt = Prompt(list(range(100, 140)), [])
    first = Runner(tiny_model, torch.float16).run(prompt, full_plan(2, "f"), Sampling(1)).token_ids[0]
    engine.scheduler.stop_ids = {first}                      # the model's first token ends a job
    stops = engine.sequence(prompt, full_plan(2, "f"), Sampling(6))
    goes_on = engine.sequence(prompt, full_plan(2, "f"), Sampling(6, ignore_eos=True))
    engine.add(stops), engine.add(goes_on)
    engine.run_all()
    assert stops.finish_reason == "eos" and stops.generated == []
    assert goes_on.finish_reason == "length" and len(goes_on.generated) == 6 and goes_on.generated[0] == first


def test_min_tokens_holds_the_end_token_back_until_then(tiny_model):
    """vLLM's `min_tokens`: every token ends a job here, yet not before the job has its three."""
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    prompt = Prompt(list(range(100, 140)), [])
    engine.scheduler.stop_ids = set(range(1 << 20))
    at_once, held = (engine.sequence(prompt, full_plan(2, "f"), Sampling(6, min_tokens=k)) for k in (0, 3))
    engine.add(at_once), engine.add(held)
    engine.run_all()
    assert at_once.finish_reason == "eos" and at_once.generated == []
    assert held.finish_reason == "eos" and len(held.generated) == 3


@pytest.mark.parametrize("name", ["full", "snapkv-repeat", "snapkv-mean", "codebook", "quant", "merge", "offload"])
def test_a_plan_that_comes_after_the_context_compresses_the_same_cache(tiny_model, name):
    """The plan from the executor's own prefill statistics: the context runs dense, its last chunk
    gathers the statistics, the plan arrives and compresses the cache with the queries that chunk
    kept — the same tokens and bytes as the plan given first and compressing inside that chunk."""
    _, plan, prompt = next(j for j in _jobs(tiny_model.num_layers) if j[0] == name)
    first = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32, prefetch_wait_s=30.0)
    a = first.sequence(prompt, plan, Sampling(10))
    first.add(a)
    first.run_all()
    after = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32, prefetch_wait_s=30.0)
    got = {}
    b = after.sequence(prompt, None, Sampling(10), emit=lambda k, x: got.setdefault(k, x),
                       statistics=LayerStatistics("repeat", losses=True))
    after.add(b)
    while b.status is not Status.PLANNING:
        after.step()
    assert b.cache.plan.strategy == "full" and after.has_work()
    stats = got["context"]
    assert stats.tokens == len(prompt.context_ids) and stats.window_scores.shape == (2, 4, stats.tokens)
    assert stats.losses is not None and stats.losses.evict.shape[0] == tiny_model.num_layers
    for _ in range(3):
        after.step()                                  # it waits: nothing of it runs
    assert b.status is Status.PLANNING and b.steps == 0
    after.apply_plan(b, plan)
    after.run_all()
    assert b.generated == a.generated and b.cache.layer_bytes() == a.cache.layer_bytes()


def test_admission_is_fair_across_tenants_when_bytes_are_short(tiny_model):
    """One tenant's backlog queued first, another's job after it: when room comes, the second
    tenant's job is admitted before the rest of the backlog (deficit round robin by tokens), and
    a tenant's own jobs go in their order."""
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), max_batched_tokens=64, prefill_chunk=32,
                       tenant_weight=lambda t: 1.0)
    plan = full_plan(tiny_model.num_layers, "f")
    prompt = Prompt(list(range(100, 360)), [])                       # 264 tokens a job: one a 256-token turn
    need = engine.reservation(plan, prompt, Sampling(4))
    engine.budget.total = need                                       # one job at a time
    flood = [engine.sequence(prompt, plan, Sampling(4), tenant="flood") for _ in range(4)]
    late = engine.sequence(prompt, plan, Sampling(4), tenant="late")
    for seq in flood + [late]:
        engine.add(seq)
    order = []
    while engine.has_work():
        engine.step()
        for seq in engine.scheduler.running:
            if seq not in order:
                order.append(seq)
    assert order.index(late) <= 1 and [s for s in order if s is not late] == flood


def test_a_pool_smaller_than_the_reservations_preempts_the_newest_and_nobody_fails(tiny_model):
    """The pool is made to hold fewer pages than the budget reserves (a defect the reservations
    cannot see): the step that finds too few free pages preempts the newest sequence, which is
    recomputed once there is room and ends with the tokens it has alone; the others go on."""
    rng = random.Random(3)
    prompts = [Prompt([rng.randint(100, 40000) for _ in range(90)], []) for _ in range(3)]
    plan, sampling = full_plan(tiny_model.num_layers, "f"), Sampling(40, ignore_eos=True)
    runner = Runner(tiny_model, torch.float16, prefill_chunk=32)
    solo = [runner.run(p, plan, sampling).token_ids for p in prompts]
    probe = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 30), prefill_chunk=32)
    need = probe.reservation(plan, prompts[0], sampling)
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(3 * need), max_batched_tokens=300, prefill_chunk=32)
    pool = engine.runner.pool
    stolen = pool.alloc(pool.free_pages - (5 * need) // (2 * pool.page_bytes))   # room for 2.5 of the 3 jobs
    seqs = [engine.sequence(p, plan, sampling) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    done = engine.run_all()
    assert engine.stats.preempted >= 1 and seqs[-1].preemptions >= 1          # the newest gave way
    assert [s.finish_reason for s in seqs] == ["length"] * 3                   # nobody failed
    assert [s.generated for s in seqs] == solo
    assert {s.seq_id for s in done} == {s.seq_id for s in seqs}
    pool.release(stolen)
    assert pool.used_pages == 0


def test_every_byte_a_job_holds_is_a_page_of_the_pool_on_the_models_device(tiny_model):
    """A job of each plan kind, alone, mid-decode: the bytes it reports are the pool's pages in use
    (nothing held outside the arena), and the arena is on the model's device."""
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 30), prefill_chunk=32)
    assert engine.runner.pool.arena.device == tiny_model.device
    for name, plan, prompt in _jobs(tiny_model.num_layers):
        seq = engine.sequence(prompt, plan, Sampling(6, ignore_eos=True))
        engine.add(seq)
        while len(seq.generated) < 3:
            engine.step()
        assert seq.kv_bytes() == engine.runner.pool.bytes_in_use > 0, name
        assert engine.measured() == engine.runner.pool.bytes_in_use
        engine.run_all()
        assert engine.runner.pool.used_pages == 0, name
