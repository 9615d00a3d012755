"""MiniCache `merge` layers: the retention rule on worked examples, a synthetic pair (pending
rows, decode-time retention, byte attribution), plans the cache refuses, and the tiny random
GQA model (4 query heads, 2 KV heads, D = 16, 2 layers merged as one pair) run through the Runner:
retained rows restored exactly, magnitudes kept, the bytes held, decode."""
from __future__ import annotations

import math

import pytest
import torch

from executor.cache import PlannedCache, UnsupportedPlan
from executor.layers.base import CacheState, LayerContext
from executor.layers.merge import MergedRows, MergeLayer, retained
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvplan.plan import Codebook, CompressionPlan, Eviction, LayerPlan, Merge, Quant, full_plan

CONTEXT = list(range(1000, 1090))          # 90 context tokens
QUESTION = list(range(2000, 2006))


# -- the retention rule ----------------------------------------------------------------------------

def test_retention_rule_worked_example_under_each_flag():
    d = torch.tensor([0.10, 0.90, 0.20, 0.05, 0.60, 0.30, 0.95, 0.15, 0.40, 0.25])   # [N] Ω/π
    idx, tau = retained(d, 0.2, "distinct")            # ⌈0.2·10⌉ = 2 most distinct rows
    assert idx.tolist() == [1, 6] and tau == pytest.approx(0.90)
    idx, tau = retained(d, 0.2, "similar")             # Eq. 4 as printed: the 2 most similar
    assert idx.tolist() == [0, 3] and tau == pytest.approx(0.10)
    idx, tau = retained(d, 0.2, "distinct_minmax")     # d > 0.95 - 0.2·(0.95 - 0.05) = 0.77
    assert idx.tolist() == [1, 6] and tau == pytest.approx(0.77)
    idx, tau = retained(d, 0.2, "similar_minmax")      # d < 0.05 + 0.2·0.9 = 0.23
    assert idx.tolist() == [0, 2, 3, 7] and tau == pytest.approx(0.23)
    idx, tau = retained(d, 0.0, "distinct")
    assert idx.numel() == 0 and tau == math.inf
    assert retained(d, 0.05, "distinct")[0].tolist() == [6]          # ⌈0.5⌉ = 1
    with pytest.raises(ValueError, match="retention rule"):
        retained(d, 0.1, "median")


def _tokens():
    """8 tokens' rows of two layers [N, W]: token 0 anti-aligned (an attention-sink-like outlier),
    token 5 orthogonal, the others the same direction up to small noise."""
    g = torch.Generator().manual_seed(1)
    lo = torch.randn(8, 12, generator=g)
    hi = 1.7 * lo + 0.05 * torch.randn(8, 12, generator=g)
    hi[0] = -2.0 * lo[0]
    hi[5] = torch.linalg.vector_norm(lo[5]) * torch.nn.functional.normalize(
        lo[5].roll(1) - (lo[5].roll(1) @ lo[5]) / (lo[5] @ lo[5]) * lo[5], dim=0)
    return lo.half(), hi.half()


def test_which_tokens_are_retained_on_a_hand_made_pair():
    lo, hi = _tokens()
    distinct = MergedRows.merge(lo, hi, 0.6, 0.25, "distinct", torch.float16)      # 2 of 8 retained
    similar = MergedRows.merge(lo, hi, 0.6, 0.25, "similar", torch.float16)
    assert distinct.idx.tolist() == [0, 5]             # the outliers: anti-aligned and orthogonal
    assert 0 not in similar.idx.tolist() and 5 not in similar.idx.tolist()   # the literal Eq. 4 misses them
    for rows in (distinct, similar):
        for which, x in ((0, lo), (1, hi)):
            back = rows.restore(which, torch.float32)                          # [N, W]
            assert torch.equal(back[rows.idx.long()], x[rows.idx.long()].float())   # retained: exact
            torch.testing.assert_close(back.norm(dim=1), x.float().norm(dim=1), rtol=2e-3, atol=0)
        assert rows.direction.dtype == rows.mags.dtype == rows.exact.dtype == torch.float16
        assert rows.idx.dtype == torch.int32 and rows.exact.shape == (2, 2, 12) and rows.mags.shape == (2, 8)


# -- a synthetic pair ------------------------------------------------------------------------------

def _pair(retention: float = 0.25):
    """Two merge layers (H_kv = 2, H = 4, D = 6) joined as the cache joins them."""
    ctx = LayerContext(torch.float16, 2, 4, 6, (torch.ones(3), 1.0), CacheState())
    lower = MergeLayer(LayerPlan(0), ctx)
    upper = MergeLayer(LayerPlan(1, merge=Merge(with_layer=0, t=0.6, retention_k=retention, retention_v=retention)), ctx)
    upper.pair(lower)
    return ctx, lower, upper


def _step(ctx, layers, kv, phase):
    """One forward over the pair: kv[i] = (k, v) of layer i, [1, H_kv, T_new, D] -> outputs."""
    ctx.state.phase = phase
    outs = []
    for layer, (k, v) in zip(layers, kv):
        kk, vv = layer.update(k, v)
        q = torch.randn(1, 4, k.shape[2], 6)
        outs.append(layer.attend(q, kk, vv, 0.4))
    return outs


def _heads(rows: torch.Tensor) -> torch.Tensor:
    """[T, 12] -> [1, 2, T, 6]."""
    return rows.float().view(rows.shape[0], 2, 6).transpose(0, 1)[None]


def test_pair_merges_after_the_context_and_merges_new_tokens_when_both_layers_have_them():
    ctx, lower, upper = _pair()
    lo, hi = _tokens()
    _step(ctx, [lower, upper], [(_heads(lo[:5]), _heads(lo[:5])), (_heads(hi[:5]), _heads(hi[:5]))], "context")
    assert not upper.merged and lower.keys.shape == (1, 2, 5, 6)             # dense through the context
    _step(ctx, [lower, upper], [(_heads(lo[5:]), _heads(lo[5:])), (_heads(hi[5:]), _heads(hi[5:]))], "compress")
    assert upper.merged and lower.merged and lower.keys is None and upper.keys is None
    assert upper.shared.k.idx.tolist() == [0, 5] and lower.tensors() == []
    held = sum(t.nbytes for t in upper.tensors())
    assert held == 2 * (8 * 12 * 2 + 2 * 8 * 2 + 2 * 4 + 2 * 2 * 12 * 2)    # K and V: dir, mags, idx, exact

    # a decode token: anti-aligned across the layers (retained, d = 1 >= τ) ...
    x = torch.randn(1, 12)
    k_lo, kk = lower.update(_heads(x), _heads(x))
    assert kk.shape == (1, 2, 9, 6) and lower.shared.pending is not None
    assert sum(t.nbytes for t in lower.tensors()) == 2 * 12 * 2              # pending rows, until the upper runs
    upper.update(_heads(-x), _heads(-x))
    assert lower.shared.pending is None and lower.tensors() == []
    assert upper.shared.k.idx.tolist() == [0, 5, 8] and upper.shared.k.num_rows == 9
    back = upper.restored()[0][0, :, 8].reshape(-1)
    assert torch.equal(back, (-x).half().float()[0])
    # ... and one aligned across them (merged): restored with its own magnitude per layer
    lower.update(_heads(x), _heads(x))
    upper.update(_heads(3 * x), _heads(3 * x))
    assert upper.shared.k.idx.tolist() == [0, 5, 8] and lower.tokens_seen == upper.tokens_seen == 10
    torch.testing.assert_close(lower.restored()[0][0, :, 9].reshape(-1), x.half().float()[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(upper.restored()[0][0, :, 9].reshape(-1), (3 * x).half().float()[0], rtol=2e-3, atol=2e-3)


def test_upper_layer_without_its_partners_rows_is_an_error():
    ctx, lower, upper = _pair()
    lo, hi = _tokens()
    _step(ctx, [lower, upper], [(_heads(lo), _heads(lo)), (_heads(hi), _heads(hi))], "compress")
    with pytest.raises(RuntimeError, match="partner did not run first"):
        upper.update(_heads(hi[:1]), _heads(hi[:1]))


# -- plans the cache refuses -----------------------------------------------------------------------

@pytest.mark.parametrize("layers, message", [
    ((LayerPlan(0), LayerPlan(1, merge=Merge(with_layer=0), eviction=Eviction(keep_tokens=4))),
     "cannot stack with eviction"),
    ((LayerPlan(0), LayerPlan(1, merge=Merge(with_layer=0), quant=Quant())), "cannot stack with quant"),
    ((LayerPlan(0), LayerPlan(1, merge=Merge(with_layer=0), codebook=Codebook())), "cannot stack with codebook"),
    ((LayerPlan(0, codebook=Codebook()), LayerPlan(1, merge=Merge(with_layer=0))), "must carry no part"),
    ((LayerPlan(0), LayerPlan(1, merge=Merge(with_layer=1))), "earlier layer"),
    ((LayerPlan(0, merge=Merge(with_layer=1)), LayerPlan(1)), "earlier layer"),
    ((LayerPlan(0), LayerPlan(1, merge=Merge(with_layer=0)), LayerPlan(2, merge=Merge(with_layer=0))), "more than one"),
    ((LayerPlan(0), LayerPlan(1, merge=Merge(with_layer=0)), LayerPlan(2, merge=Merge(with_layer=1))), "more than one"),
])
def test_unsupported_merge_plans_are_refused(layers, message):
    with pytest.raises(UnsupportedPlan, match=message):
        PlannedCache(CompressionPlan("t", "s", layers), len(layers), 2, 16, torch.float16)


# -- the tiny model through the Runner ------------------------------------------------------------

def _merge_plan(retention: float = 0.05) -> CompressionPlan:
    return CompressionPlan("m", "minicache", (LayerPlan(0), LayerPlan(1, merge=Merge(0, 0.6, retention, retention))))


def _prefill(lm, plan, prompt):
    runner = Runner(lm, torch.float16)
    cache = runner.new_cache(plan)
    with torch.inference_mode():
        logits = runner.prefill(prompt, cache)
    return cache, logits


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[1, H_kv, T, D] -> [T, H_kv·D] fp32."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1).float()


def test_retained_rows_restore_exactly_and_merged_rows_keep_their_magnitudes(tiny_model):
    prompt = Prompt(CONTEXT, QUESTION)
    full, _ = _prefill(tiny_model, full_plan(2, "f"), prompt)
    cache, _ = _prefill(tiny_model, _merge_plan(), prompt)
    lower, upper = cache.layers
    assert lower.kind == upper.kind == "merge" and upper.merged and lower.keys is None
    pair = upper.shared
    for rows, attr in ((pair.k, "keys"), (pair.v, "values")):
        dense = [_token_rows(full.dense(i)[attr == "values"]) for i in range(2)]     # [96, 32] each
        # the context's retained tokens are the ⌈5% of 90⌉ = 5 most distinct, by the full rows' angles
        cos = torch.nn.functional.cosine_similarity(dense[0][:90], dense[1][:90], dim=1)
        want = torch.argsort(torch.acos(cos.clamp(-1, 1)), descending=True)[:5].sort().values
        assert rows.idx[rows.idx < 90].tolist() == want.tolist()
        # the context's rows (the question's rows of layer 1 follow from layer 0's attention over
        # the merged context, so they differ from the full run's)
        ctx_idx = rows.idx[rows.idx < 90].long()
        for which, layer in enumerate(cache.layers):
            back = (layer.restored()[0] if attr == "keys" else layer.restored()[1])
            back = _token_rows(back)                                                # [96, 32]
            assert back.shape == dense[which].shape
            assert torch.equal(back[ctx_idx], dense[which][ctx_idx])                # exact
            torch.testing.assert_close(back[:90].norm(dim=1), dense[which][:90].norm(dim=1), rtol=2e-3, atol=0)


@pytest.mark.parametrize("t, which", [(0.0, 0), (1.0, 1)])
def test_slerp_end_point_restores_that_layer_up_to_fp16(tiny_model, t, which):
    """t = 0 shares the lower layer's directions, t = 1 the upper's: that layer's context rows then
    come back as the full run's, up to fp16 rounding of the direction."""
    plan = CompressionPlan("m", "mc", (LayerPlan(0), LayerPlan(1, merge=Merge(0, t, 0.0, 0.0))))
    full, _ = _prefill(tiny_model, full_plan(2, "f"), Prompt(CONTEXT, []))
    cache, _ = _prefill(tiny_model, plan, Prompt(CONTEXT, []))
    k, v = cache.layers[which].restored()                                           # [1, H_kv, 90, D]
    assert cache.layers[1].shared.k.idx.numel() == 0
    full_k, full_v = full.dense(which)
    torch.testing.assert_close(k, full_k.float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(v, full_v.float(), rtol=2e-3, atol=2e-3)


def test_retaining_every_context_token_prefills_the_question_like_the_full_cache(tiny_model):
    prompt = Prompt(CONTEXT, QUESTION)
    _, full_logits = _prefill(tiny_model, full_plan(2, "f"), prompt)
    cache, logits = _prefill(tiny_model, _merge_plan(retention=1.0), prompt)
    assert cache.layers[1].shared.k.idx[:90].tolist() == list(range(90))
    torch.testing.assert_close(logits, full_logits, rtol=1e-4, atol=1e-4)


def test_runner_decodes_with_a_merged_pair_and_reports_the_bytes_it_holds(tiny_model):
    prompt = Prompt(CONTEXT, QUESTION)
    runner = Runner(tiny_model, torch.float16)
    result = runner.run(prompt, _merge_plan(), Sampling(max_new_tokens=5))
    assert len(result.token_ids) == 5 and result.decode_steps == 4
    n = 90 + 6 + 4                                                # tokens each layer has seen
    w = tiny_model.num_kv_heads * tiny_model.head_dim             # 32
    lower, upper = result.layers
    assert lower.kind == upper.kind == "merge" and lower.kv_bytes == 0    # the pair's store is the upper's
    assert lower.full_kv_bytes == upper.full_kv_bytes == 2 * n * w * 2
    # K and V each: directions [n, w] + magnitudes [2, n] fp16, per retained row 2 exact rows fp16 + an int32
    cache = runner.new_cache(_merge_plan())
    with torch.inference_mode():
        runner.prefill(prompt, cache)
    m_k, m_v = cache.layers[1].shared.k.idx.numel(), cache.layers[1].shared.v.idx.numel()
    assert m_k >= 5 and m_v >= 5                                  # ⌈5% of 90⌉ context rows, plus question rows past τ
    expected = 2 * (n * w * 2 + 2 * n * 2)
    assert expected < upper.kv_bytes <= expected + (2 * n) * (2 * w * 2 + 4)
    ratio = result.kv_bytes / result.full_kv_bytes
    m = (upper.kv_bytes - expected) // (2 * w * 2 + 4)           # retained rows, K and V together
    assert (upper.kv_bytes - expected) % (2 * w * 2 + 4) == 0
    assert ratio == pytest.approx((expected + m * (2 * w * 2 + 4)) / (4 * n * w * 2))
    assert 0.53 < ratio < 0.70, ratio                             # (2W+4 + ρ(4W+4)) / 4W, ρ ≈ 5%
    print(f"merged pair bytes {result.kv_bytes} / full {result.full_kv_bytes} = {ratio:.4f}, retained rows {m}")
