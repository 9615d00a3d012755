"""`auto` on the tiny model: the plan fits its budget in predicted bytes and in the bytes the
executor's cache then really holds, spends bytes where the probe says they lose most, and says
what attention it expects to keep."""
import numpy as np
import pytest
import torch

from executor.prompt import Prompt
from executor.engine.sequence import Phase
from executor.runner import Runner
from planner import auto
from kvcore.statistics import Losses, ProbeStats
from planner.probe import Prober
from kvcore.request import InvalidRequest
from planner.request import ModelShape, PlanInput

TOKENS = list(range(1000, 1200))      # 200 context tokens


def _input(lm, ratio, probe, new_tokens=0, kv_tokens=None):
    shape = ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim)
    budget = dict(reserve_ratio=ratio) if kv_tokens is None else dict(kv_tokens=kv_tokens)
    return PlanInput(job_id="j", strategy="auto", prompt_tokens=len(TOKENS), model=shape, probe=probe,
                     new_tokens=new_tokens, **budget)


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_auto_plan_fits_its_budget_in_the_bytes_the_cache_holds(tiny_model, ratio):
    prober = Prober(lm=tiny_model, window=8)
    plan = auto.plan(_input(tiny_model, ratio, lambda **kw: prober.probe(TOKENS, "mean", **kw)), "p")
    assert plan.predicted_reserve_ratio <= ratio + 1e-9
    assert 0.0 < plan.predicted_retained_attention <= 1.0
    runner = Runner(tiny_model, torch.float16)
    cache = runner.new_cache(plan)
    with torch.inference_mode():
        runner.prefill(Prompt(TOKENS, []), cache)
    held = sum(b.kv_bytes for b in cache.layer_bytes())
    full = sum(b.full_kv_bytes for b in cache.layer_bytes())
    assert held / full <= plan.predicted_reserve_ratio + 1e-9      # the cost model is an upper bound


def _held_ratio(cache) -> float:
    return sum(b.kv_bytes for b in cache.layer_bytes()) / sum(b.full_kv_bytes for b in cache.layer_bytes())


@pytest.mark.parametrize("ratio,kv_tokens", [(0.4, None), (0.25, None), (None, 60), (None, 210)])
def test_the_budget_holds_at_every_decode_step(tiny_model, ratio, kv_tokens):
    """The rows a job generates come out of its budget: measured after the prompt and after
    every one of its new tokens, the cache holds at most the plan's predicted worst ratio, and
    that at most the requested one (kv_tokens N: N dense rows per head; 210 holds the prompt but
    not its new rows, so it still compresses)."""
    new = 24          # the tightest budget still fits sinks + window + these rows in every layer
    prober = Prober(lm=tiny_model, window=8)
    plan = auto.plan(_input(tiny_model, ratio, lambda **kw: prober.probe(TOKENS, "mean", **kw), new, kv_tokens), "p")
    assert any(lp.quant is not None or lp.eviction is not None for lp in plan.layers)
    runner = Runner(tiny_model, torch.float16)
    cache = runner.new_cache(plan)
    seen = []
    with torch.inference_mode():
        logits = runner.prefill(Prompt(TOKENS, []), cache)
        seen.append(_held_ratio(cache))
        for step in range(1, new + 1):
            logits = runner.forward([int(logits.argmax())], len(TOKENS) + step - 1, cache, Phase.AFTER)[-1]
            seen.append(_held_ratio(cache))
    assert max(seen) <= plan.predicted_reserve_ratio + 1e-9
    for i, got in enumerate(seen):
        limit = ratio if kv_tokens is None else kv_tokens / (len(TOKENS) + i)
        assert got <= limit + 1e-9, (i, got, limit)


def test_bytes_go_to_the_layer_that_loses_most():
    """Worked example, 2 layers: layer 0 loses much when squeezed, layer 1 nothing; quantizing
    costs too much error anywhere. At 0.65 of the bytes layer 0 keeps everything (its 100 rows in
    7 pool blocks of 16, layer 1's 8 rows in 1: 128 rows of the 130 the budget holds)."""
    f = np.array([1.0, 0.5, 0.0])
    lo = Losses(fractions=f, evict=np.array([[0.0, 0.5, 0.9], [0.0, 0.0, 0.0]]),
                retained=np.array([[1.0, 0.6, 0.2], [1.0, 0.99, 0.9]]), bits=np.array([16, 8, 4, 2]),
                quant=np.array([[0.0, 1.0, 1.0, 1.0]] * 2))
    stats = ProbeStats(tokens=100, window_scores=np.zeros((2, 1, 100), np.float32), k_similar=np.zeros(2),
                       v_similar=np.zeros(2), k_angle=np.zeros(1), v_angle=np.zeros(1), window=4, losses=lo)
    shape = ModelShape(2, 1, 1, 8)
    inp = PlanInput(job_id="j", strategy="auto", prompt_tokens=100, model=shape, reserve_ratio=0.65,
                    probe=lambda **kw: stats)
    plan = auto.plan(inp, "p")
    assert plan.layers[0].eviction is None and plan.layers[0].quant is None          # all kept, exact
    assert plan.layers[1].eviction.keep_tokens == 0                                  # sinks + window only
    assert plan.predicted_retained_attention == pytest.approx((1.0 + 0.9) / 2)
    assert plan.predicted_reserve_ratio <= 0.65


def test_auto_needs_the_prompt():
    shape = ModelShape(2, 1, 1, 8)
    with pytest.raises(InvalidRequest, match="token_ids"):
        auto.plan(PlanInput(job_id="j", strategy="auto", prompt_tokens=100, model=shape, reserve_ratio=0.5), "p")
