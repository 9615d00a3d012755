"""Which press each layer of a plan takes, and the checks every plan passes before any work.
The presses themselves: one file each (`executor.presses`)."""
from __future__ import annotations

from kvcore.blocks import QUANT_BITS
from kvcore.plan_cost import offload_form
from executor.presses import codebook, evict, kvcrush, merge, offload, quant
from executor.presses.context import PressContext, UnsupportedPlan

PRESSES = {"full": evict.full, "evicted": evict.press, "quant": quant.press, "codebook": codebook.press,
           "merge": merge.press, "merge_lower": merge.lower, "offload": offload.press}


def kind(plan, layer: int) -> str:
    """The press of one layer of `plan`: its plan's kind, the lower layer of a merged pair
    `merge_lower` (its partner merges both), a full layer of an offloading plan `offload`."""
    lp = plan.layers[layer]
    if any(p.merge is not None and p.merge.with_layer == layer for p in plan.layers):
        return "merge_lower"
    if plan.offload.enabled and lp.kind == "full":
        return "offload"
    return lp.kind


def check(plan, num_layers: int, num_query_heads: int, num_kv_heads: int, layout) -> None:
    """Raise `UnsupportedPlan` (a ValueError naming the part) for a plan the pool's forms cannot hold,
    before any work: its layer count, KVCrush settings, merged pairs, quant widths and stacking,
    an offload part without a low-bit form."""
    if len(plan.layers) != num_layers:
        raise UnsupportedPlan(f"plan {plan.plan_id} has {len(plan.layers)} layers, the model {num_layers}")
    partners: dict[int, int] = {}
    for i, lp in enumerate(plan.layers):
        ev, q = lp.eviction, lp.quant
        if ev is not None and ev.kvcrush is not None:
            kvcrush.check(ev.kvcrush)
        if q is not None:
            if q.bits not in QUANT_BITS or q.residual < 0:
                raise UnsupportedPlan(f"layer {i}: quant bits {q.bits} / residual {q.residual}: the pool quantizes at "
                                      f"{QUANT_BITS} bits with a residual >= 0")
            if lp.codebook is not None:
                raise UnsupportedPlan(f"layer {i}: codebook + quant do not stack; plan one of them")
            if ev is not None and ev.gqa_mode == "repeat" and num_query_heads > num_kv_heads:
                raise UnsupportedPlan(f"layer {i}: quant under per-query-head eviction (GQA repeat) is not a pool "
                                      "form; plan GQA mean")
        if lp.merge is not None:
            j = lp.merge.with_layer
            stacked = [p for p in ("eviction", "codebook", "quant") if getattr(lp, p) is not None]
            if stacked:
                raise UnsupportedPlan(f"layer {i}: merge cannot stack with {' / '.join(stacked)} on the same layer")
            if not 0 <= j < i:
                raise UnsupportedPlan(f"layer {i}: merge.with_layer = {j} must name an earlier layer (the pair's lower)")
            if j in partners or j in partners.values() or plan.layers[j].kind != "full" or plan.layers[j].merge:
                raise UnsupportedPlan(f"layer {j}, the lower layer of merged pair ({j}, {i}), must carry no part and "
                                      "be in one pair")
            partners[i] = j
    if plan.offload.enabled:
        try:
            offload_form(layout, plan.offload)
        except ValueError as e:
            raise UnsupportedPlan(f"offload: {e}") from None


__all__ = ["PRESSES", "PressContext", "UnsupportedPlan", "check", "kind"]
