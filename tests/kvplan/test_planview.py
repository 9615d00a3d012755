"""`kvplan plan`'s table and plot say one thing (issue 34: layer 8's bar was 315 where the table
said 279, layer 19's 36 where it said 0 — the bars counted the sinks and window, the column did
not): the table's `kept` column is each bar's height, read back from the drawn figure, and its
`keep_tokens` column the bar's part above the sinks and window."""
from __future__ import annotations

import pytest

from kvplan import planview
from kvcore.plan import CompressionPlan, Eviction, LayerPlan, Quant
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES

SHAPE = ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64)


def _columns(table: str) -> list[tuple[int, int, str]]:
    """(layer, kept, keep_tokens) per row of the table."""
    rows = table.splitlines()[2:-1]
    return [(int(r.split()[0]), int(r.split()[2]), r.split()[3]) for r in rows]


def _mixed() -> CompressionPlan:
    """Like auto's plans: some layers evict down to their sinks and window alone, some quantize."""
    def ev(keep):
        return Eviction(keep_tokens=keep, window=32, scorer="snapkv", gqa_mode="mean", sink_tokens=4)
    layers = [LayerPlan(0), LayerPlan(1, eviction=ev(279)), LayerPlan(2, eviction=ev(0)),
              LayerPlan(3, eviction=ev(100), quant=Quant(bits=2, group_size=32, residual=32)),
              LayerPlan(4, quant=Quant(bits=4, group_size=32, residual=32)), LayerPlan(5, eviction=ev(5000))]
    return CompressionPlan("p", "mixed", tuple(layers))


@pytest.mark.parametrize("plan", [_mixed(), STRATEGIES["pyramidkv"].plan(
    PlanInput("j", "pyramidkv", 412, SHAPE, reserve_ratio=0.3), "p")], ids=["mixed", "pyramidkv"])
def test_the_bars_are_the_tables_kept_column(plan, tmp_path):
    pytest.importorskip("matplotlib")
    table = planview.table(plan, 412)
    cols = _columns(table)
    drawn = planview.plot(plan, 412, tmp_path / "plan.png", "ratio 0.3")
    assert [kept for _, kept, _ in cols] == drawn
    for (layer, kept, keep), lp in zip(cols, plan.layers):
        ev = lp.eviction
        assert kept == (min(412, ev.sink_tokens + ev.window + ev.keep_tokens) if ev else 412)
        assert keep == (str(kept - ev.sink_tokens - ev.window) if ev else "all")


def test_sinks_and_window_are_counted_in_a_layer_that_scores_none():
    plan = _mixed()
    cols = {layer: (kept, keep) for layer, kept, keep in _columns(planview.table(plan, 412))}
    assert cols[1] == (315, "279") and cols[2] == (36, "0") and cols[5] == (412, "376")
    assert "kept: prompt tokens kept per KV head" in planview.table(plan, 412).splitlines()[-1]
