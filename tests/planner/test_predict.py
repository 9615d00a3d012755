"""The common retained-attention yardstick on a worked example."""
import numpy as np
import pytest

from kvcore.plan import CompressionPlan, Eviction, LayerPlan, Quant
from planner.predict import annotate, copy_retained_attention, retained_attention
from kvcore.statistics import ProbeStats


def _stats(scores):
    m = scores.shape[0]
    return ProbeStats(tokens=scores.shape[-1], window_scores=scores, k_similar=np.zeros(m), v_similar=np.zeros(m),
                      k_angle=np.zeros(m - 1), v_angle=np.zeros(m - 1))


def test_worked_example():
    # 2 layers, 2 query heads on 1 KV head, 6 tokens; rows sum to 1
    s = np.array([[[0.1, 0.4, 0.0, 0.2, 0.1, 0.2],
                   [0.1, 0.0, 0.5, 0.1, 0.1, 0.2]],
                  [[0.2, 0.1, 0.1, 0.1, 0.1, 0.4]] * 2])
    ev = Eviction(keep_tokens=1, window=1, sink_tokens=1, scorer="snapkv", gqa_mode="repeat")
    plan = CompressionPlan("p", "t", (LayerPlan(0, eviction=ev), LayerPlan(1, quant=Quant())))
    # layer 0, repeat: head 0 keeps sink .1 + window .2 + top .4 = .7; head 1: .1 + .2 + .5 = .8
    assert retained_attention(plan, _stats(s), 1) == pytest.approx(((0.7 + 0.8) / 2 + 1.0) / 2)
    mean = Eviction(keep_tokens=1, window=1, sink_tokens=1, scorer="snapkv", gqa_mode="mean")
    plan = CompressionPlan("p", "t", (LayerPlan(0, eviction=mean), LayerPlan(1, eviction=mean)))
    # mean mode, layer 0: head mean [.1, .2, .25, .15, .1, .2]: .1 + .2 + .25; layer 1: .2 + .4 + .1
    assert retained_attention(plan, _stats(s), 1) == pytest.approx((0.55 + 0.7) / 2)
    sl = Eviction(keep_tokens=3, window=1, sink_tokens=1, scorer="streaming_llm", gqa_mode="mean")
    plan = CompressionPlan("p", "t", (LayerPlan(0, eviction=sl), LayerPlan(1)))
    assert retained_attention(plan, _stats(s), 1) == pytest.approx((0.3 + 1.0) / 2)


def test_copy_aware_worked_example_credits_what_follows_the_attended_token():
    # 1 layer, 1 head, 8 tokens; sink 0 and window 7 always kept; the answer starts at token 1
    s = np.array([[[0.05, 0.5, 0.05, 0.05, 0.05, 0.1, 0.1, 0.1]]])
    copy = 2                                # a token counts for the share of it and the 2 after it kept

    def plan(keep, span):
        ev = Eviction(keep_tokens=keep, window=1, sink_tokens=1, pool_kernel=1, scorer="snapkv", gqa_mode="repeat",
                      span_tokens=span)
        return CompressionPlan("p", "t", (LayerPlan(0, eviction=ev),))

    # keep 1 by score -> {0, 1, 7}; shares of j..j+2 kept: 2/3, 1/3, 0, 0, 0, 1/3, 2/3, 1 (past the end: kept)
    assert copy_retained_attention(plan(1, 0), _stats(s), 1, copy) == pytest.approx(0.4)
    # keep 3 by score -> {0, 1, 5, 6, 7}: more mass (0.85) but the answer's next tokens are gone
    assert retained_attention(plan(3, 0), _stats(s), 1) == pytest.approx(0.85)
    assert copy_retained_attention(plan(3, 0), _stats(s), 1, copy) == pytest.approx(0.55)
    # keep 3 with a copy span of 2 (the executor's selection) -> {0, 1, 2, 3, 7}: less mass, the run kept
    assert retained_attention(plan(3, 2), _stats(s), 1) == pytest.approx(0.85)     # the plain yardstick ignores spans
    assert copy_retained_attention(plan(3, 2), _stats(s), 1, copy) == pytest.approx(0.8)
    # StreamingLLM keeps the sink and the window only: .05/3 + .1/3 + .1·2/3 + .1
    sl = Eviction(keep_tokens=3, window=1, sink_tokens=1, scorer="streaming_llm", gqa_mode="mean")
    assert copy_retained_attention(CompressionPlan("p", "t", (LayerPlan(0, eviction=sl),)), _stats(s), 1, copy) \
        == pytest.approx(0.05 / 3 + 0.1 / 3 + 0.2 / 3 + 0.1)
    # no eviction keeps everything
    assert copy_retained_attention(CompressionPlan("p", "t", (LayerPlan(0),)), _stats(s), 1, copy) == 1.0


def test_annotate_fills_both_figures():
    s = np.full((2, 2, 6), 1 / 6)
    ev = Eviction(keep_tokens=1, window=1, sink_tokens=1, scorer="snapkv", gqa_mode="mean")
    plan = CompressionPlan("p", "t", (LayerPlan(0, eviction=ev), LayerPlan(1)))
    got = annotate(plan, _stats(s), 1)
    assert got.predicted_retained_attention == pytest.approx(retained_attention(plan, _stats(s), 1)) == (3 / 6 + 1) / 2
    assert got.predicted_copy_retained_attention == pytest.approx(copy_retained_attention(plan, _stats(s), 1))
    assert got.predicted_copy_retained_attention < 1.0 and got.layers == plan.layers
