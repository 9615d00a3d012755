"""Each shipped strategy's plan for the SmolLM2 shape (30 layers, 9 q / 3 kv heads, d_h 64).
The presets that replaced the recipe code plan exactly what it planned (golden plans recorded
from it: data/preset_plans.json). The presets whose layers the executor's pool holds
(streaming_llm, h2o, snapkv, pyramidkv) were recorded again when the pool came: their streams
hold whole blocks of `kvcore.blocks.BLOCK_ROWS` rows, so each keeps up to BLOCK_ROWS - 1 tokens
fewer to hold the same budget (`planner.budget`); spindlekv and spindlekv_paper again when every
form came into the pool (their kept rows priced as the pool's coded rows, the rows a job adds as
dense pages); the rest are the recipe code's."""
import json
from pathlib import Path

import numpy as np
import pytest

from kvcore.plan import Codebook, CompressionPlan
from planner.allocation import pyramid_keep_counts
from planner.request import ModelShape, PlanInput
from planner.strategies import PLANNERS, PRESETS, STRATEGIES, Strategy, build, parse
from tests.planner.fakes import CountingProbe, stats

SHAPE = ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64, fingerprint="fp")
EVICTING = ["streaming_llm", "h2o", "snapkv", "pyramidkv", "spindlekv", "spindlekv_paper"]
PROBING = ["xkv", "xkv+kvcrush", "spindlekv+xkv"]
GOLDEN = json.loads((Path(__file__).parent / "data" / "preset_plans.json").read_text())
STATS = stats()


def plan(name, prompt=4096, ratio=None, kv_tokens=None) -> CompressionPlan:
    if ratio is None and kv_tokens is None:
        ratio = 0.4
    inp = PlanInput(job_id="j", strategy=name, prompt_tokens=prompt, model=SHAPE, reserve_ratio=ratio,
                    kv_tokens=kv_tokens, probe=lambda **kw: STATS)
    return STRATEGIES[name].plan(inp, "plan-1")


def evictions(p):
    return [lp.eviction for lp in p.layers]


def test_registry_holds_the_shipped_presets():
    assert set(STRATEGIES) == {"full", *EVICTING, *PROBING, "minicache", "auto", "specache", "specache-1bit"}
    assert [d.name for d in PRESETS] == list(STRATEGIES)
    for name, s in STRATEGIES.items():
        assert s.name == name and s.version and s.description and "\n" not in s.description
        assert s.definition.name == name and (s.probe_mode is not None) == (name in PROBING + ["auto", "minicache"])
    assert STRATEGIES["spindlekv"].version == "2"


@pytest.mark.parametrize("case", GOLDEN, ids=lambda g: f"{g['strategy']}-{g['prompt']}-{g.get('ratio', g.get('kv_tokens'))}")
def test_presets_plan_exactly_what_the_recipe_code_planned(case):
    p = plan(case["strategy"], prompt=case["prompt"], ratio=case.get("ratio"), kv_tokens=case.get("kv_tokens"))
    assert STRATEGIES[case["strategy"]].version == case["version"]
    assert [lp.eviction.keep_tokens if lp.eviction else None for lp in p.layers] == case["keep"]
    for lp in p.layers:
        ev = lp.eviction
        if ev is not None:
            assert [ev.window, ev.sink_tokens, ev.pool_kernel, ev.scorer, ev.gqa_mode, ev.span_tokens] == case["eviction"]
            assert (ev.keep_ratio, ev.kvcrush) == (None, None)
        assert lp.codebook == (Codebook(*case["codebook"]) if case["codebook"] else None)
        assert (lp.merge, lp.quant) == (None, None)
    assert p.predicted_reserve_ratio == case["predicted_reserve_ratio"]


def test_every_preset_has_golden_plans_or_is_new():
    assert {g["strategy"] for g in GOLDEN} == {"full", *EVICTING}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_plan_covers_every_layer_and_round_trips(name):
    p = plan(name)
    assert p.plan_id == "plan-1" and p.strategy == name and p.model_fingerprint == "fp"
    assert [lp.layer for lp in p.layers] == list(range(30))
    back = CompressionPlan.from_proto(p.to_proto())
    assert back.layers == p.layers   # keep_tokens=0 survives the proto oneof
    assert back.predicted_reserve_ratio == pytest.approx(p.predicted_reserve_ratio, rel=1e-6)


POOLED = 1638 - 15      # 0.4 of 4096 tokens, less the 15 rows a pooled stream may hold past its last row


def test_streaming_llm_keeps_sinks_and_a_recent_window():
    p = plan("streaming_llm")
    ev = evictions(p)[0]
    assert set(evictions(p)) == {ev}
    assert (ev.keep_tokens, ev.sink_tokens, ev.window) == (0, 4, POOLED - 4)
    assert (ev.scorer, ev.gqa_mode, ev.keep_ratio) == ("streaming_llm", "mean", None)
    assert p.predicted_reserve_ratio == pytest.approx(POOLED / 4096)
    assert all(lp.codebook is None for lp in p.layers)


@pytest.mark.parametrize("name, scorer, pool", [("h2o", "h2o", 1), ("snapkv", "snapkv", 7)])
def test_uniform_strategies(name, scorer, pool):
    p = plan(name)
    ev = evictions(p)[0]
    assert set(evictions(p)) == {ev}
    assert (ev.keep_tokens, ev.window, ev.sink_tokens, ev.pool_kernel) == (POOLED - 32, 32, 0, pool)
    assert (ev.scorer, ev.gqa_mode) == (scorer, "mean")
    assert p.predicted_reserve_ratio == pytest.approx(POOLED / 4096)
    assert all(lp.codebook is None for lp in p.layers)


def test_pyramidkv_follows_the_worked_example():
    p = plan("pyramidkv")
    keep = [ev.keep_tokens for ev in evictions(p)]
    assert keep == pyramid_keep_counts(POOLED / 4096, 4096, 32, 30).tolist()
    assert (keep[0], keep[29]) == (2978, 203)
    assert all((ev.window, ev.pool_kernel, ev.scorer, ev.gqa_mode) == (32, 7, "snapkv", "mean") for ev in evictions(p))
    assert p.predicted_reserve_ratio == pytest.approx((POOLED - 0.5) / 4096, abs=1e-5)


@pytest.mark.parametrize("r", [0.15, 0.25, 0.4, 0.55])
@pytest.mark.parametrize("name, span", [("spindlekv", 16), ("spindlekv_paper", 0)])
def test_spindlekv_gives_pyramid_byte_budgets_and_codebooks_every_layer(r, name, span):
    p = plan(name, ratio=r)
    assert all(lp.codebook == Codebook(theta_k=0.98, theta_v=0.95) for lp in p.layers)
    r = _pooled_ratio(r)                     # the pool's pages leave each stream BLOCK_ROWS - 1 rows
    keep = [lp.eviction.keep_tokens if lp.eviction else 4096 for lp in p.layers]
    assert keep == sorted(keep, reverse=True) and keep[0] > keep[-1]       # the pyramid: deep layers keep least
    for lp in p.layers:
        if lp.eviction is not None:
            ev = lp.eviction
            assert (ev.window, ev.pool_kernel, ev.scorer, ev.gqa_mode, ev.sink_tokens, ev.span_tokens) == \
                   (32, 7, "snapkv", "repeat", 0, span)
    # the codebook layers' pages (fields and entries in whole pages) fill the budget from below
    assert p.predicted_reserve_ratio == pytest.approx(np.mean([_coded_held(lp) for lp in p.layers]) / 4096)
    assert r - 0.01 <= p.predicted_reserve_ratio <= r + 1e-9


def _coded_held(lp) -> float:
    """A layer's rows' worth of dense pages: a codebook layer's coded pages (`kvcore.plan_cost`),
    any other its kept rows."""
    from kvcore.blocks import Layout
    from kvcore.plan_cost import coded_pages
    ev = lp.eviction
    kept = min(4096, ev.sink_tokens + ev.window + ev.keep_tokens) if ev else 4096
    return 16 * coded_pages(Layout(64), kept, kept) if lp.codebook else kept


def _pooled_ratio(r: float) -> float:
    """The prompt's share a budget of ratio r leaves a 4096-token prompt once each stream's spare
    rows in its last page are paid (`planner.budget.context_ratio`)."""
    from kvcore.blocks import BLOCK_ROWS
    from planner.budget import context_ratio
    return context_ratio(PlanInput(job_id="j", strategy="x", prompt_tokens=4096, model=SHAPE, reserve_ratio=r),
                         1.0, BLOCK_ROWS)


def test_spindlekv_at_large_ratios_leaves_the_shallow_layers_to_the_codebook():
    p = plan("spindlekv", ratio=0.8)
    assert p.layers[0].eviction is None and p.layers[0].codebook is not None   # r_c(0) = 1: no eviction
    assert p.layers[-1].eviction is not None                                    # deep layers still evict
    assert _pooled_ratio(0.8) - 0.01 <= p.predicted_reserve_ratio <= _pooled_ratio(0.8) + 1e-9


@pytest.mark.parametrize("name", EVICTING + PROBING)
def test_kv_tokens_budget_equals_the_same_ratio(name):
    by_tokens, by_ratio = plan(name, kv_tokens=1638), plan(name, ratio=1638 / 4096)
    assert by_tokens.layers == by_ratio.layers
    assert by_tokens.predicted_reserve_ratio == pytest.approx(by_ratio.predicted_reserve_ratio)


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("budget", [dict(ratio=1.0), dict(kv_tokens=4096), dict(kv_tokens=10_000)])
def test_a_budget_holding_the_prompt_compresses_nothing(name, budget):
    p = plan(name, **budget)
    assert [lp.kind for lp in p.layers] == ["full"] * 30 and p.predicted_reserve_ratio == 1.0


@pytest.mark.parametrize("name", EVICTING + PROBING)
def test_kv_tokens_for_the_prompt_but_not_the_new_rows_still_compresses(name):
    """kv_tokens 4106 holds the 4096-token prompt but not its 32 generated rows: the plan keeps
    at most 4106 - 32 (the rows those tokens hold) per head on average, so it evicts."""
    inp = PlanInput(job_id="j", strategy=name, prompt_tokens=4096, model=SHAPE, kv_tokens=4106, new_tokens=32,
                    probe=lambda **kw: STATS)
    p = STRATEGIES[name].plan(inp, "plan-1")
    assert any(ev is not None for ev in evictions(p))
    assert p.predicted_reserve_ratio * 4096 <= 4106 - 32 + 1e-6


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_an_empty_prompt_gets_the_full_plan(name):
    p = plan(name, prompt=0)
    assert [lp.kind for lp in p.layers] == ["full"] * 30 and p.predicted_reserve_ratio == 1.0


@pytest.mark.parametrize("name", ["h2o", "snapkv", "pyramidkv"])
def test_a_prompt_within_the_window_is_kept_whole(name):
    p = plan(name, prompt=20, ratio=0.5)
    assert all(ev is None for ev in evictions(p)) and p.predicted_reserve_ratio == 1.0


def test_a_budget_below_the_window_keeps_the_window_and_predicts_it():
    p = plan("snapkv", kv_tokens=16)
    assert {(ev.keep_tokens, ev.window) for ev in evictions(p)} == {(0, 32)}
    assert p.predicted_reserve_ratio == pytest.approx(32 / 4096)
    s = plan("streaming_llm", kv_tokens=3 + 15)     # sinks take what there is (15 rows: whole pool blocks)
    assert {(ev.keep_tokens, ev.sink_tokens, ev.window) for ev in evictions(s)} == {(0, 3, 0)}


@pytest.mark.parametrize("name", EVICTING + PROBING)
@pytest.mark.parametrize("r", [0.05, 0.2, 0.4, 0.7])
def test_predicted_ratio_is_the_mean_kept_share(name, r):
    p = plan(name, ratio=r)
    kept = [_coded_held(lp) for lp in p.layers]       # codebook layers: their pages of fields and entries
    assert p.predicted_reserve_ratio == pytest.approx(np.mean(kept) / 4096)
    assert p.predicted_reserve_ratio <= r + 1e-9 or p.predicted_reserve_ratio == pytest.approx(32 / 4096)


@pytest.mark.parametrize("name", PROBING)
def test_probing_presets_split_the_uniform_total_by_the_probe(name):
    p, snap = plan(name, ratio=0.2), plan("snapkv", ratio=0.2)
    keep, snap_keep = [lp.eviction.keep_tokens for lp in p.layers], sum(lp.eviction.keep_tokens for lp in snap.layers)
    if name == "spindlekv+xkv":          # codebook pages cost more than dense rows: a smaller total
        assert 0.85 * snap_keep < sum(keep) < snap_keep and len(set(keep)) > 1
    else:
        assert sum(keep) == snap_keep and len(set(keep)) > 1
    mode = "repeat" if name == "spindlekv+xkv" else "mean"        # xkv scores KV groups (presets.yaml says why)
    assert all(lp.eviction.gqa_mode == mode and lp.eviction.scorer == "snapkv" for lp in p.layers)
    assert 0.0 < p.predicted_retained_attention < 1.0 and snap.predicted_retained_attention == 1.0
    assert (p.layers[0].eviction.kvcrush is not None) == (name == "xkv+kvcrush")
    assert (p.layers[0].codebook is not None) == (name == "spindlekv+xkv")


def test_probing_presets_probe_only_when_they_compress():
    probe = CountingProbe(STATS)
    for ratio in (1.0, 0.3):
        STRATEGIES["xkv"].plan(PlanInput(job_id="j", strategy="xkv", prompt_tokens=4096, model=SHAPE,
                                         reserve_ratio=ratio, probe=probe), "p")
    assert len(probe.calls) == 1


def test_minicache_merges_pairs_from_the_middle_layer():
    p = plan("minicache", ratio=0.5)
    merged = {lp.layer: lp.merge.with_layer for lp in p.layers if lp.merge}
    assert merged == {16: 15, 18: 17, 20: 19, 22: 21, 24: 23, 26: 25, 28: 27}
    assert all(lp.kind == "full" for lp in p.layers if not lp.merge)
    assert all((lp.merge.t, lp.merge.retention_k, lp.merge.retention_v) == pytest.approx((0.6, 0.05, 0.05))
               for lp in p.layers if lp.merge)
    assert 0.75 < p.predicted_reserve_ratio < 0.8      # 16 full layers + 14 at ~(1 + 2·0.05)/2


def test_planners_registry_builds_a_strategy_per_kind(monkeypatch):
    seen = []

    def fake(d):
        seen.append(d.name)
        return Strategy(d.name, d.version or "1", d.description, lambda inp, pid: None)

    monkeypatch.setitem(PLANNERS, "auto", fake)
    s = build(parse("{name: mine, kind: auto, options: {target: 0.9}}"))
    assert (s.name, seen) == ("mine", ["mine"]) and s.definition is None


@pytest.mark.parametrize("name, bits, ratio", [("specache", 2, 0.3), ("specache-1bit", 1, 0.2)])
def test_specache_offloads_every_layer_within_the_budget(name, bits, ratio):
    p = plan(name, prompt=4096, ratio=ratio)
    assert p.offload.enabled and p.offload.low_bits == bits
    assert all(lp.kind == "full" for lp in p.layers)          # the executor makes plain layers `offload`
    assert p.predicted_reserve_ratio <= ratio and p.budget_met
    assert p.offload.group_size in (32, 64) and 16 <= p.offload.top_k <= 64
    if bits == 2:          # 32-row key groups, two a page (44 of 64 bytes a row): 0.2 is below its floor, and says so
        tight = plan(name, prompt=4096, ratio=0.2)
        assert tight.offload.enabled and not tight.budget_met and tight.predicted_reserve_ratio > 0.2
    roomy = plan(name, prompt=4096, ratio=0.6)
    assert (roomy.offload.top_k, roomy.offload.recent_window) == (64, 64)   # the preset's, when they fit
    assert plan(name, prompt=4096, ratio=1.0).offload.enabled is False       # a whole budget: full


def test_a_codebook_plan_rescaled_in_rounds_learns_its_shares_once():
    """spindlekv+xkv plans again at a smaller budget while its codebook pages overrun it: the
    profile learns the shares of the plan it returns, once."""
    learned = []
    inp = PlanInput(job_id="j", strategy="spindlekv+xkv", prompt_tokens=4096, model=SHAPE, reserve_ratio=0.2,
                    probe=lambda **kw: STATS, learn=learned.append)
    p = STRATEGIES["spindlekv+xkv"].plan(inp, "p")
    keep = np.array([lp.eviction.keep_tokens for lp in p.layers], dtype=np.float64)
    assert len(learned) == 1 and learned[0] == pytest.approx(keep / keep.sum(), abs=1e-3)
