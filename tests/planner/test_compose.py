"""The compose planner: XKV budgets from probe statistics (or a profile's shares), parts laid over
the layers (codebook layer lists, merged pairs, quant), and the predicted ratios."""
import numpy as np
import pytest

from kvcore.plan import Merge
from planner import xkv
from planner.allocation import uniform_keep_counts
from kvcore.blocks import BLOCK_ROWS
from planner.budget import context_ratio
from planner.compose import Composed, apportion, merge_pairs, merged_share
from planner.definition import loads
from kvcore.request import InvalidRequest
from planner.request import ModelShape, PlanInput
from tests.planner.fakes import CountingProbe, stats

SHAPE = ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64, fingerprint="fp")
XKV = "{name: x, allocation: xkv, eviction: {scorer: snapkv, pool_kernel: 7, gqa_mode: repeat}}"


def composed(text: str) -> Composed:
    return Composed(loads(text, ["compose"]))


def inp(prompt=4096, ratio=0.2, **kw) -> PlanInput:
    return PlanInput(job_id="j", strategy="x", prompt_tokens=prompt, model=SHAPE, reserve_ratio=ratio, **kw)


def test_xkv_is_algorithm_1_over_the_context_with_the_window_always_kept():
    s = stats(t=4096)
    learned = []
    p = composed(XKV).plan(inp(probe=lambda: s, learn=learned.append), "p")
    r = context_ratio(inp(), 1.0, BLOCK_ROWS)             # the pool's pages leave each stream BLOCK_ROWS - 1 rows
    total = int(uniform_keep_counts(r, 4096, 32, 30).sum())
    ctx = [w[:, :4096 - 32] for w in s.window_scores]                                   # [H, T_c] per layer
    want = xkv.allocate(ctx, total=total, floor=1)
    assert [lp.eviction.keep_tokens for lp in p.layers] == want.keep.tolist()
    assert all((lp.eviction.window, lp.eviction.sink_tokens) == (32, 0) for lp in p.layers)
    mass = np.array([w.sum(-1).mean() for w in ctx])                                      # [m] context share
    assert p.predicted_retained_attention == pytest.approx(np.mean(1 - mass + mass * want.retained), rel=1e-9)
    assert len(learned) == 1 and learned[0] == pytest.approx(want.keep / want.keep.sum())


def test_xkv_excludes_sinks_too():
    s = stats(t=1000)
    d = "{name: x, allocation: xkv, eviction: {scorer: streaming_llm, window: 16, sink_tokens: 4}}"
    p = composed(d).plan(inp(prompt=1000, ratio=0.3, probe=lambda: s), "p")
    # its streams are pooled: the budget leaves BLOCK_ROWS - 1 = 15 rows a stream to whole blocks
    want = xkv.allocate([w[:, 4:1000 - 16] for w in s.window_scores], total=30 * (300 - 15 - 20), floor=1)
    assert [lp.eviction.keep_tokens for lp in p.layers] == want.keep.tolist()


def test_xkv_without_a_probe_asks_for_token_ids():
    with pytest.raises(InvalidRequest) as e:
        composed(XKV).plan(inp(), "p")
    assert e.value.field == "token_ids" and "strategy x probes the prompt: send token_ids" in str(e.value)


def test_xkv_from_a_profiles_shares_does_not_probe():
    probe = CountingProbe()
    shares = tuple(np.linspace(2, 1, 30) / np.linspace(2, 1, 30).sum())
    p = composed(XKV).plan(inp(probe=probe, layer_shares=shares), "p")
    keep = [lp.eviction.keep_tokens for lp in p.layers]
    r = context_ratio(inp(), 1.0, BLOCK_ROWS)
    assert probe.calls == [] and sum(keep) == int(uniform_keep_counts(r, 4096, 32, 30).sum())
    assert keep == sorted(keep, reverse=True) and keep[0] > 1.5 * keep[-1]
    assert p.predicted_retained_attention == 1.0                                        # not predicted without a probe


def test_xkv_budget_below_the_window_keeps_only_the_window():
    p = composed(XKV).plan(inp(ratio=None, kv_tokens=16, probe=lambda: stats()), "p")
    assert {lp.eviction.keep_tokens for lp in p.layers} == {0}


@pytest.mark.parametrize("total, shares, floor, cap, want", [
    (10, [1, 1], 0, 100, [5, 5]),
    (10, [2, 1, 1], 1, 100, [5, 3, 2]),          # 1 + (4, 1.5, 1.5): the last slot to the shallower .5
    (7, [1, 1, 1], 0, 100, [3, 2, 2]),           # ties go to the shallower layer
    (100, [1, 0], 1, 30, [30, 1]),               # capped
    (5, [0, 0], 0, 100, [3, 2]),                 # no information: even
])
def test_apportion(total, shares, floor, cap, want):
    assert apportion(total, np.array(shares, float), floor, cap).tolist() == want


@pytest.mark.parametrize("seed", range(5))
def test_the_shares_of_an_allocation_give_it_back(seed):
    s = stats(t=2000, seed=seed)
    for total in (30, 31, 1000, 12345):
        keep = xkv.allocate([w[:, :1968] for w in s.window_scores], total=total, floor=1).keep
        assert apportion(total, keep / keep.sum(), 1, 1968).tolist() == keep.tolist()


def test_merge_pairs_start_in_the_middle_by_default():
    assert merge_pairs(None, 30) == {16: 15, 18: 17, 20: 19, 22: 21, 24: 23, 26: 25, 28: 27}
    assert merge_pairs(None, 32) == {17: 16, 19: 18, 21: 20, 23: 22, 25: 24, 27: 26, 29: 28, 31: 30}
    assert merge_pairs(26, 30) == {27: 26, 29: 28} and merge_pairs(29, 30) == {}


def test_merged_share_counts_directions_magnitudes_and_retained_rows():
    assert merged_share(Merge(retention_k=0.0, retention_v=0.0), 192) == pytest.approx((1 + 2 / 192) / 2)
    assert merged_share(Merge(retention_k=0.05, retention_v=0.05), 192) == pytest.approx(
        (1 + 2 / 192 + 0.05 * (2 + 2 / 192)) / 2)


def test_merged_pairs_are_gated_by_the_probes_layer_similarity():
    """Pairs (26, 27) and (28, 29): the probe finds layers 26/27 alike (cos 0.9 ≥ 0.5) and 28/29
    not (their values at cos 0.3): only the first pair merges; without token ids it cannot tell."""
    s = stats(t=4096)
    k_angle = np.full(29, np.arccos(0.9) / np.pi)
    v_angle = k_angle.copy()
    v_angle[28] = np.arccos(0.3) / np.pi
    s = type(s)(**{**s.__dict__, "k_angle": k_angle, "v_angle": v_angle})
    c = composed("{name: x, merge: {start_layer: 26}}")
    assert c.probe_mode == "repeat"
    p = c.plan(inp(ratio=0.5, probe=lambda: s), "p")
    assert [lp.kind for lp in p.layers[26:]] == ["full", "merge", "full", "full"]
    with pytest.raises(InvalidRequest, match="token_ids"):
        c.plan(inp(ratio=0.5), "p")


def test_merge_with_eviction_leaves_merged_pairs_alone():
    d = "{name: x, eviction: {scorer: snapkv}, merge: {start_layer: 26, t: 0.5, min_cos: null}}"
    p = composed(d).plan(inp(ratio=0.3), "p")
    assert [lp.kind for lp in p.layers] == ["evicted"] * 26 + ["full", "merge", "full", "merge"]
    assert (p.layers[27].merge.with_layer, p.layers[29].merge.with_layer, p.layers[29].merge.t) == (26, 28, 0.5)
    kept = [min(4096, 32 + lp.eviction.keep_tokens) / 4096 for lp in p.layers[:26]]
    want = (sum(kept) + 4 * merged_share(Merge(t=0.5), 192)) / 30
    assert p.predicted_reserve_ratio == pytest.approx(want)


def test_codebook_on_listed_layers_and_quant_on_the_others():
    d = "{name: x, eviction: {scorer: snapkv}, codebook: {layers: [0, 1, 99]}, quant: {bits: 4, group_size: 64}}"
    p = composed(d).plan(inp(ratio=0.5), "p")
    assert [lp.kind for lp in p.layers] == ["codebook"] * 2 + ["quant"] * 28
    assert all(lp.eviction is not None for lp in p.layers)
    kept = [32 + lp.eviction.keep_tokens for lp in p.layers]       # the window and the scored tokens kept
    assert kept[0] == 2048 - 15                          # the budget leaves each stream a page's 15 spare rows
    quant_held = [32 + (k - 32) * 16 / 48 for k in kept[2:]]   # the residual dense, the rest 48 rows a page of 16 rows' bytes
    # a codebook layer: 2033 rows' fields in 9 coded pages (240 rows a page), at most an entry a
    # row for K and for V in 2 × 64 entry pages (32 entries a page): 137 pages of 16 rows' bytes
    coded_held = [16 * (9 + 2 * 64)] * 2
    assert p.predicted_reserve_ratio == pytest.approx((sum(coded_held) + sum(quant_held)) / 30 / 4096)


def test_kvcrush_rides_on_every_evicted_layer():
    d = "{name: x, eviction: {scorer: h2o}, kvcrush: {rep_fraction: 0.5, anchor: alternate, bucket_rule: range}}"
    p = composed(d).plan(inp(ratio=0.3), "p")
    assert {(lp.eviction.kvcrush.rep_fraction, lp.eviction.kvcrush.anchor, lp.eviction.kvcrush.bucket_rule)
            for lp in p.layers} == {(0.5, "alternate", "range")}


def test_quant_without_eviction_quantizes_the_whole_prompt():
    p = composed("{name: x, quant: {bits: 2, residual: 0}}").plan(inp(ratio=0.5), "p")
    assert [lp.kind for lp in p.layers] == ["quant"] * 30
    assert p.predicted_reserve_ratio == pytest.approx(16 / 96)     # a 2-bit page: 96 rows in 16 dense rows' bytes
