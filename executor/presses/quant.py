"""KIVI: a layer's kept rows (every context row, or an eviction's per KV head) in the pool's quant
form for the plan's width (`kvcore.blocks`: one key group a page), the newest `residual` rows and
the rows past the last whole page dense; rows fed later join the dense tail and are quantized a
page at a time as it grows (`BlockTables.flush`)."""
from __future__ import annotations

import torch

from executor.presses import evict
from executor.presses.context import PressContext, UnsupportedPlan
from kvcore.plan import LayerPlan


def press(ctx: PressContext, seq, layer: int, lp: LayerPlan, q, k, v, later_k=None, later_v=None) -> None:
    q_part = lp.quant
    if lp.eviction is not None:
        form = evict.select(lp, ctx, q, k, v, seq.acc.get(layer))
        if form[0] != "dense":
            raise UnsupportedPlan(f"layer {layer}: quant under per-query-head eviction (GQA repeat) is not a pool form; "
                                  "plan GQA mean")
        k, v = form[1], form[2]
    if later_k is not None:
        k, v = torch.cat([k, later_k], 1), torch.cat([v, later_v], 1)
    lay = ctx.tables.layout
    ctx.tables.store_quant(layer, seq.cache.slot, k, v, lay.form_id(q_part.bits), q_part.residual)
