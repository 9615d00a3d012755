"""`auto` on the tiny model: the plan fits its budget in predicted bytes and in the bytes the
executor's cache then really holds, spends bytes where the probe says they lose most, and says
what attention it expects to keep."""
import numpy as np
import pytest
import torch

from executor.prompt import Prompt
from executor.runner import Runner
from planner import auto
from planner.probe import Losses, Prober, ProbeStats
from planner.request import InvalidRequest, ModelShape, PlanInput

TOKENS = list(range(1000, 1200))      # 200 context tokens


def _input(lm, ratio, probe):
    shape = ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim)
    return PlanInput(job_id="j", strategy="auto", prompt_tokens=len(TOKENS), model=shape, reserve_ratio=ratio,
                     probe=probe)


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_auto_plan_fits_its_budget_in_the_bytes_the_cache_holds(tiny_model, ratio):
    prober = Prober(lm=tiny_model, window=8)
    plan = auto.plan(_input(tiny_model, ratio, lambda **kw: prober.probe(TOKENS, "mean", **kw)), "p")
    assert plan.predicted_reserve_ratio <= ratio + 1e-9
    assert 0.0 < plan.predicted_retained_attention <= 1.0
    runner = Runner(tiny_model, torch.float16)
    cache = runner.new_cache(plan)
    with torch.inference_mode():
        runner._prefill(Prompt(TOKENS, []), cache, lambda *a: None, lambda: False)
    held = sum(b.kv_bytes for b in cache.layer_bytes())
    full = sum(b.full_kv_bytes for b in cache.layer_bytes())
    assert held / full <= plan.predicted_reserve_ratio + 1e-9      # the cost model is an upper bound


def test_bytes_go_to_the_layer_that_loses_most():
    """Worked example, 2 layers: layer 0 loses much when squeezed, layer 1 nothing; quantizing
    costs too much error anywhere. At half the bytes layer 0 keeps everything."""
    f = np.array([1.0, 0.5, 0.0])
    lo = Losses(fractions=f, evict=np.array([[0.0, 0.5, 0.9], [0.0, 0.0, 0.0]]),
                retained=np.array([[1.0, 0.6, 0.2], [1.0, 0.99, 0.9]]), bits=np.array([16, 8, 4, 2]),
                quant=np.array([[0.0, 1.0, 1.0, 1.0]] * 2))
    stats = ProbeStats(tokens=100, window_scores=np.zeros((2, 1, 100), np.float32), k_similar=np.zeros(2),
                       v_similar=np.zeros(2), k_angle=np.zeros(1), v_angle=np.zeros(1), window=4, losses=lo)
    shape = ModelShape(2, 1, 1, 8)
    inp = PlanInput(job_id="j", strategy="auto", prompt_tokens=100, model=shape, reserve_ratio=0.55,
                    probe=lambda **kw: stats)
    plan = auto.plan(inp, "p")
    assert plan.layers[0].eviction is None and plan.layers[0].quant is None          # all kept, exact
    assert plan.layers[1].eviction.keep_tokens == 0                                  # sinks + window only
    assert plan.predicted_retained_attention == pytest.approx((1.0 + 0.9) / 2)
    assert plan.predicted_reserve_ratio <= 0.55


def test_auto_needs_the_prompt():
    shape = ModelShape(2, 1, 1, 8)
    with pytest.raises(InvalidRequest, match="token_ids"):
        auto.plan(PlanInput(job_id="j", strategy="auto", prompt_tokens=100, model=shape, reserve_ratio=0.5), "p")
