"""The pool's guarantee as a property: for random workloads on the tiny model — prompt lengths,
new tokens, every strategy family (eviction per KV head and per query head, KIVI at every width,
codebooks, merged pairs, SpeCache's offload), kept shares, budgets, arrival order — the engine
never finds too few free pages for a step (no preemption: the reservations hold), the pages in
use never pass the budget, and every sequence's greedy tokens batched are its tokens alone.

A few dozen workloads in `make test`; `pytest -m soak tests/executor/engine/test_pool_property.py`
runs a few hundred."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.engine import KVBudget, LLMEngine, Sampling
from executor.prompt import Prompt
from executor.runner import Runner
from kvcore.plan import Codebook, CompressionPlan, Eviction, LayerPlan, Merge, OffloadPlan, Quant, full_plan

SCORERS = ("snapkv", "h2o", "streaming_llm")


@st.composite
def layer_plans(draw, layer: int, context: int):
    """One layer's part: full, eviction per KV head (any scorer, any kept count), KIVI at any width,
    or both."""
    ev = q = None
    if draw(st.booleans()):
        keep = draw(st.integers(0, context))
        ev = Eviction(keep_tokens=keep, window=draw(st.integers(1, 12)), scorer=draw(st.sampled_from(SCORERS)),
                      gqa_mode="mean", sink_tokens=draw(st.integers(0, 4)), pool_kernel=draw(st.sampled_from([1, 3])))
    if draw(st.booleans()):
        q = Quant(bits=draw(st.sampled_from([1, 2, 4, 8])), group_size=32, residual=draw(st.integers(0, 40)))
    return LayerPlan(layer, eviction=ev, quant=q)


@st.composite
def plans(draw, layers: int, context: int):
    """A plan of one family: full; per-layer eviction / KIVI; per-query-head eviction with or
    without codebooks; a merged pair; SpeCache's offload."""
    family = draw(st.sampled_from(["full", "layers", "repeat", "codebook", "merge", "offload"]))
    if family == "full":
        return full_plan(layers, "f")
    if family == "layers":
        return CompressionPlan("p", "t", tuple(draw(layer_plans(i, context)) for i in range(layers)))
    if family in ("repeat", "codebook"):
        ev = Eviction(keep_tokens=draw(st.integers(0, context)), window=draw(st.integers(1, 12)), gqa_mode="repeat",
                      sink_tokens=draw(st.integers(0, 4)), span_tokens=draw(st.sampled_from([0, 4])))
        theta = draw(st.sampled_from([0.5, 0.9, 0.99999]))
        cb = Codebook(theta, theta) if family == "codebook" else None
        return CompressionPlan("p", "t", tuple(LayerPlan(i, eviction=ev, codebook=cb) for i in range(layers)))
    if family == "merge":
        share = draw(st.sampled_from([0.0, 0.1, 1.0]))
        return CompressionPlan("p", "t", (LayerPlan(0), LayerPlan(1, merge=Merge(0, 0.6, share, share)),
                                          *(LayerPlan(i) for i in range(2, layers))))
    off = OffloadPlan(enabled=True, low_bits=draw(st.sampled_from([1, 2])), group_size=32,
                      top_k=draw(st.sampled_from([4, 16])), recent_window=draw(st.sampled_from([0, 8])),
                      sink_tokens=draw(st.integers(0, 3)), value_group_size=draw(st.sampled_from([64, 32])), rerank=1)
    return dataclasses.replace(full_plan(layers, "o"), offload=off)


@st.composite
def workloads(draw, layers: int):
    jobs = []
    for _ in range(draw(st.integers(2, 5))):
        context = draw(st.integers(8, 160))
        question = draw(st.integers(0, 12))
        ids = draw(st.lists(st.integers(100, 40000), min_size=context + question, max_size=context + question))
        plan = draw(plans(layers, context))
        new = draw(st.integers(1, 24))
        jobs.append((Prompt(ids[:context], ids[context:]), plan, Sampling(new, ignore_eos=True)))
    arrivals = draw(st.lists(st.integers(0, 6), min_size=len(jobs), max_size=len(jobs)))   # steps before each arrives
    share = draw(st.floats(0.0, 1.0))               # the budget between the largest job's and all of them at once
    chunk = draw(st.sampled_from([16, 32, 64]))
    return jobs, arrivals, share, chunk


def _check(tiny_model, work) -> None:
    jobs, arrivals, share, chunk = work
    runner = Runner(tiny_model, torch.float16, prefill_chunk=chunk, prefetch_wait_s=30.0)   # SpeCache: no late prefetch
    solo = [runner.run(p, plan, s).token_ids for p, plan, s in jobs]
    probe = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), prefill_chunk=chunk)
    need = [probe.reservation(probe.fit(plan, p, s, None), p, s) for p, plan, s in jobs]
    budget = int(max(need) + share * (sum(need) - max(need)))
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(budget), max_batched_tokens=2 * chunk, prefill_chunk=chunk,
                       prefetch_wait_s=30.0)
    seqs = [engine.sequence(p, plan, s) for p, plan, s in jobs]
    order = sorted(range(len(jobs)), key=lambda i: arrivals[i])
    step = 0
    while order or engine.has_work():
        while order and arrivals[order[0]] <= step:
            engine.add(seqs[order.pop(0)])
        engine.step()
        step += 1
        assert engine.runner.pool.bytes_in_use <= engine.budget.total
    assert engine.stats.preempted == 0, "a step found fewer free pages than the reservations promised"
    assert engine.runner.pool.peak_bytes <= engine.budget.total
    assert [s.finish_reason for s in seqs] == ["length"] * len(seqs)
    assert [s.generated for s in seqs] == solo
    assert engine.runner.pool.used_pages == 0


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.function_scoped_fixture])


@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_random_workloads_never_run_short_of_pages_and_batch_like_alone(tiny_model, data):
    _check(tiny_model, data.draw(workloads(tiny_model.num_layers)))


@pytest.mark.soak
@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_random_workloads_never_run_short_of_pages_many(tiny_model, data):
    _check(tiny_model, data.draw(workloads(tiny_model.num_layers)))


def test_a_workload_whose_streams_free_pages_in_every_order_fits_its_budget(tiny_model):
    """A worked example of what fragmented the old per-form chunks: quant streams at every width
    flushing group by group beside evicted streams freeing whole contexts, at a budget of exactly
    the reservations."""
    m = tiny_model.num_layers
    forms = [CompressionPlan("p", "t", tuple(LayerPlan(i, quant=Quant(bits=b, group_size=32, residual=3))
                                             for i in range(m))) for b in (1, 2, 4, 8)]
    forms.append(CompressionPlan("p", "t", tuple(LayerPlan(i, eviction=Eviction(keep_tokens=10, window=4))
                                                 for i in range(m))))
    jobs = [(Prompt(list(range(100 + 7 * j, 100 + 7 * j + 120)), []), plan, Sampling(60, ignore_eos=True))
            for j, plan in enumerate(forms)]
    _check(tiny_model, (jobs, [0, 0, 1, 2, 2], 1.0, 32))
    _check(tiny_model, (jobs, [0, 1, 2, 3, 4], 0.4, 16))
