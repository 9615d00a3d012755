"""Compress instead of preempt, in the engine on the tiny model: a running job planned dense from its
own prefill's statistics is shrunk mid-decode to a plan of every layer kind the planner makes: its
tokens so far are the unshrunk run's, it goes on to max_new_tokens, its cache afterwards is what
that plan makes compressing at the context's end (the rows since appended, not compressed as
context), its bytes and reservation drop, and a job waiting for those bytes is admitted."""
import dataclasses

import pytest
import torch

from executor.engine import KVBudget, LLMEngine, Sampling, Status
from kvcore.statistics import LayerStatistics
from kvcore.plan import full_plan
from tests.executor.engine.test_llm_engine import _jobs

NEW, AT = 14, 5          # tokens generated, and the shrink after this many


def _dense(engine, prompt, max_new=NEW):
    """A job planned after its context, its plan all `full` at ratio 1.0 (memory was free)."""
    seq = engine.sequence(prompt, None, Sampling(max_new, ignore_eos=True), statistics=LayerStatistics("repeat", losses=False))
    engine.add(seq)
    while seq.status is not Status.PLANNING:
        engine.step()
    m = engine.lm.num_layers
    engine.apply_plan(seq, dataclasses.replace(full_plan(m, "f"), budget_ratio=1.0, budget_reason="fits"))
    return seq


def _lower(plan):
    return dataclasses.replace(plan, budget_ratio=0.5, budget_reason="pressure")


@pytest.mark.parametrize("name", ["snapkv-repeat", "snapkv-mean", "codebook", "quant", "merge"])
def test_a_shrunk_job_keeps_its_text_goes_on_and_holds_what_its_new_plan_makes(tiny_model, name):
    _, plan, prompt = next(j for j in _jobs(tiny_model.num_layers) if j[0] == name)
    plain = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    unshrunk = _dense(plain, prompt)
    plain.run_all()
    first = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)   # the plan from the start
    planned = first.sequence(prompt, plan, Sampling(NEW, ignore_eos=True))
    first.add(planned)
    first.run_all()

    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    seq = _dense(engine, prompt)
    while len(seq.generated) < AT:
        engine.step()
    assert engine.shrinkable(seq) and seq.queries is not None
    before, reserved = seq.kv_bytes(), seq.reserved
    engine.shrink(seq, _lower(plan))
    engine.step()
    assert [s.ratio for s in seq.shrinks] == [0.5] and not engine.shrinkable(seq)
    s = seq.shrinks[0]
    assert (s.generated_tokens, s.kv_bytes_before, s.reserved_before) == (AT, before, reserved)
    if name != "merge":                      # a merged pair's directions and retained rows: as much as 90 dense rows here
        assert s.kv_bytes_after < s.kv_bytes_before and s.reserved_after <= s.reserved_before   # (whole pages)
    assert s.kv_bytes_after <= s.reserved_after == engine.budget.held(seq.seq_id)
    while engine.has_work():
        engine.step()
        assert seq.status is Status.FINISHED or seq.kv_bytes() <= seq.reserved
    assert seq.generated[:AT] == unshrunk.generated[:AT] and len(seq.generated) == NEW
    assert seq.finish_reason == "length"
    # the context compressed as the plan compresses it at the context's end; the rows since appended:
    # the same kept tokens per layer as that run's (it fed as many rows), and as many bytes where a
    # row's bytes do not depend on its values
    got, want = seq.cache.layer_bytes(), planned.cache.layer_bytes()
    assert [x.kept_tokens for x in got] == [x.kept_tokens for x in want]
    assert [x.kind for x in got] == [x.kind for x in want]
    if name != "codebook":                   # a codebook's entries: the rows' values decide its bytes
        assert [x.kv_bytes for x in got] == [x.kv_bytes for x in want]


def test_a_shrink_admits_the_job_waiting_for_its_bytes(tiny_model):
    jobs = _jobs(tiny_model.num_layers)
    _, plan, prompt = next(j for j in jobs if j[0] == "snapkv-mean")
    probe = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    waiting = probe.sequence(prompt, None, Sampling(NEW, ignore_eos=True), statistics=LayerStatistics("repeat", losses=False))
    held = probe.reservation(full_plan(tiny_model.num_layers, "f"), prompt, Sampling(NEW))
    # room for one dense job and a bit: the second waits for bytes
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(held + waiting.reserved // 2), prefill_chunk=32)
    running = _dense(engine, prompt)
    while len(running.generated) < AT:
        engine.step()
    other = engine.sequence(prompt, None, Sampling(NEW, ignore_eos=True), statistics=LayerStatistics("repeat", losses=False))
    engine.add(other)
    for _ in range(3):
        engine.step()
    assert other.status is Status.WAITING and engine.blocked() == [running]
    engine.shrink(running, _lower(plan))
    engine.step()
    assert other.status is not Status.WAITING and running.status is Status.DECODE
    assert engine.budget.reserved <= engine.budget.total and not engine.blocked()
    while other.status is not Status.PLANNING:
        engine.step()
    engine.apply_plan(other, _lower(plan))
    engine.run_all()
    assert len(running.generated) == len(other.generated) == NEW


def test_no_shrink_to_an_offload_plan_nor_of_a_compressed_or_probed_job(tiny_model):
    jobs = {name: (plan, prompt) for name, plan, prompt in _jobs(tiny_model.num_layers)}
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=32)
    plan, prompt = jobs["full"]
    dense = _dense(engine, prompt)
    probed = engine.sequence(prompt, plan, Sampling(NEW, ignore_eos=True))      # its plan came first: no queries
    engine.add(probed)
    while len(dense.generated) < AT or len(probed.generated) < AT:
        engine.step()
    assert engine.shrinkable(dense) and not engine.shrinkable(probed)
    engine.shrink(dense, _lower(jobs["offload"][0]))
    engine.shrink(probed, _lower(jobs["snapkv-mean"][0]))
    engine.step()
    assert dense.shrinks == probed.shrinks == [] and {lp.kind for lp in dense.cache.plan.layers} == {"full"}
    engine.shrink(dense, _lower(jobs["snapkv-mean"][0]))
    engine.shrink(dense, _lower(jobs["quant"][0]))          # a second: it is no longer dense
    engine.run_all()
    assert [s.ratio for s in dense.shrinks] == [0.5] and dense.plan.layers[0].kind == "evicted"
