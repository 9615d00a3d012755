"""What the press tests share: a tiny model's context prefilled under a plan through the engine's
pool, the full-KV rows it came from, and a stream's rows as attention sees them."""
from __future__ import annotations

import torch

from executor.prompt import Prompt
from executor.runner import Runner
from kvcore.plan import CompressionPlan, LayerPlan, full_plan

CONTEXT = list(range(1000, 1090))          # 90 context tokens
QUESTION = list(range(2000, 2006))


def plan_of(m: int, **layer) -> CompressionPlan:
    return CompressionPlan("t", "test", tuple(LayerPlan(i, **layer) for i in range(m)))


def prefill(lm, plan: CompressionPlan, context=CONTEXT):
    """-> (runner, cache) with `context` prefilled (and compressed) under `plan`."""
    runner = Runner(lm, torch.float16)
    cache = runner.new_cache(plan)
    with torch.inference_mode():
        runner.prefill(Prompt(list(context), []), cache)
    return runner, cache


def dense_kv(lm, context=CONTEXT) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE K and V of every layer from a full-KV run, fp16 storage: [H_kv, T, D] fp32 each."""
    _, cache = prefill(lm, full_plan(lm.num_layers, "f"), context)
    out = [tuple(x.float() for x in cache.tables.dense(i, cache.slot)) for i in range(lm.num_layers)]
    cache.close()
    return out


def streams(runner, cache, layer: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each KV head's rows of a layer as attention sees them: (K, V [U, D] fp32, heads [U] uint8)."""
    r = runner.engine.runner
    return [cache.tables.stream(layer, cache.slot, g, r.rope_tables) for g in range(cache.tables.H)]


def seen_by(heads: torch.Tensor, j: int) -> torch.Tensor:
    """[U] bool: the rows query head j of the group sees."""
    return (heads.long() >> j) & 1 == 1


def decode_attend(runner, cache, layer: int, q: torch.Tensor) -> torch.Tensor:
    """A decode query q [H, D] over a layer's streams by the paged kernel -> [H, D]."""
    from kernels.paged_decode import paged_decode
    r = runner.engine.runner
    st = cache.tables.decode_view([cache.slot], torch.device("cpu"))
    hk = cache.tables.H
    out, _ = paged_decode(q.view(hk, -1, q.shape[-1]), cache.tables.pool.arena, *st.layer(layer), cache.tables.layout,
                          r.scaling, r.rope_tables, group_heads=q.shape[0] // hk)
    return out.view(q.shape)
