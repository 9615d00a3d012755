"""The probe engine against the model itself: its window scores are the eager attention
weights of a plain forward (summed over the window, pooled, normalised), its similarity and
angle statistics match direct computations on the projected K/V, and it stops after the last
attention."""
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvcore.statistics import angle, pooled, similar_share
from planner.probe import Prober
from tests.planner.fakes import stats

TOKENS = list(range(1000, 1070))     # 70 tokens


def _eager_attention(lm, ids):
    """Per layer the eager attention weights [H, T, T] of a plain forward, and the keys as the
    model holds them before RoPE [H_kv, T, D] (after the per-head key norm, where the
    architecture has one) and the values."""
    kv, hooks = {}, []
    heads = lambda y: y[0].view(len(ids), lm.num_kv_heads, lm.head_dim).transpose(0, 1)   # noqa: E731
    for i, layer in enumerate(lm.model.model.layers):
        a = layer.self_attn
        norm = getattr(a, "k_norm", None)          # Qwen3: [1, T, H_kv, D] after the norm
        k_out, k_shape = (norm, lambda y: y[0].transpose(0, 1)) if norm is not None else (a.k_proj, heads)
        hooks.append(k_out.register_forward_hook(lambda m, x, y, i=i, s=k_shape: kv.__setitem__(("k", i), s(y))))
        hooks.append(a.v_proj.register_forward_hook(lambda m, x, y, i=i: kv.__setitem__(("v", i), heads(y))))
    old = lm.model.config._attn_implementation
    lm.model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = lm.model(torch.tensor([ids]), output_attentions=True, use_cache=False)
    finally:
        lm.model.config._attn_implementation = old
        for h in hooks:
            h.remove()
    return [a[0] for a in out.attentions], [(kv[("k", i)], kv[("v", i)]) for i in range(lm.num_layers)]


@pytest.mark.parametrize("gqa", ["repeat", "mean"])
def test_window_scores_are_the_models_attention_over_the_window(tiny_model, gqa):
    stats = Prober(lm=tiny_model, window=8, pool_kernel=3).probe(TOKENS, gqa)
    attn, _ = _eager_attention(tiny_model, TOKENS)
    m, hq, hk = tiny_model.num_layers, tiny_model.num_query_heads, tiny_model.num_kv_heads
    heads = hq if gqa == "repeat" else hk
    assert stats.window_scores.shape == (m, heads, len(TOKENS)) and stats.tokens == len(TOKENS)
    for i in range(m):
        want = attn[i][:, -8:].sum(1).float()                                   # [H, T]
        if gqa == "mean":
            want = want.view(hk, hq // hk, -1).mean(1)
        want = pooled(want, 3)
        np.testing.assert_allclose(stats.window_scores[i], want.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(stats.window_scores[i].sum(-1), 1.0, rtol=1e-5)


def test_similarity_and_angles_match_direct_computations(tiny_model):
    stats = Prober(lm=tiny_model, sample=1000).probe(TOKENS)        # sample > T: every pair
    _, kv = _eager_attention(tiny_model, TOKENS)
    t = len(TOKENS)
    for i, (k, v) in enumerate(kv):
        for x, theta, got in ((k, 0.9, stats.k_similar[i]), (v, 0.6, stats.v_similar[i])):
            xn = F.normalize(x.float(), dim=-1)
            cos = xn @ xn.transpose(1, 2)                                          # [H_kv, T, T]
            off = ~torch.eye(t, dtype=torch.bool)
            assert got == pytest.approx(float((cos > theta)[:, off].float().mean()), abs=1e-6)
    assert stats.k_angle.shape == stats.v_angle.shape == (tiny_model.num_layers - 1,)
    k0, k1 = kv[0][0], kv[1][0]
    want = torch.arccos(F.cosine_similarity(k0, k1, dim=-1).clamp(-1, 1)).mean() / math.pi
    assert stats.k_angle[0] == pytest.approx(float(want), abs=1e-5)
    assert 0.0 <= stats.v_angle[0] <= 1.0


def test_similar_share_samples_both_sides_of_a_long_prompt():
    """T past 4·sample: rows and columns are both sampled; the estimate stays near the exact
    share (here a quarter of the rows are near copies of one direction: exact ≈ 0.06)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3000, 16, generator=gen)
    x[:, ::4] = torch.ones(16) + 0.01 * torch.randn(2, 750, 16, generator=gen)
    xn = F.normalize(x, dim=-1)
    cos = xn @ xn.transpose(1, 2)
    exact = float((cos > 0.9)[:, ~torch.eye(3000, dtype=torch.bool)].float().mean())
    for seed in range(3):       # the probe's default sample: 256 rows x 1024 columns
        assert similar_share(x, 0.9, 256, torch.Generator().manual_seed(seed)) == pytest.approx(exact, abs=0.02)


def test_statistics_worked_examples():
    gen = torch.Generator().manual_seed(0)
    x = torch.tensor([[[1.0, 0.0], [1.0, 0.01], [0.0, 1.0]]])                   # rows 0, 1 nearly parallel
    assert similar_share(x, 0.9, 10, gen) == pytest.approx(2 / 6)                # pairs (0,1), (1,0) of 6
    a = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    b = torch.tensor([[[0.0, 1.0], [0.0, 2.0]]])
    assert angle(a, b) == pytest.approx((0.5 + 0.0) / 2)                        # 90° and 0°
    # edges average over what exists (1.5, 1, 1, 0), then the row sums to 1
    np.testing.assert_allclose(pooled(torch.tensor([[0.0, 3.0, 0.0, 0.0]]), 3).numpy(),
                               [[1.5 / 3.5, 1 / 3.5, 1 / 3.5, 0.0]], rtol=1e-6)


def test_empty_prompt_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="token_ids"):
        Prober(lm=tiny_model).probe([])


def test_losses_fall_as_more_is_kept_and_vanish_when_all_is(tiny_model):
    tokens = list(range(1000, 1200))         # a 2-bit group of the pool is 80 rows at this head dim: two of them
    stats = Prober(lm=tiny_model, window=8).probe(tokens, "mean", losses=True)
    lo = stats.losses
    m = tiny_model.num_layers
    assert lo.evict.shape == lo.retained.shape == (m, len(lo.fractions)) and lo.quant.shape == (m, len(lo.bits))
    assert lo.fractions[0] == 1.0 and lo.bits[0] == 16
    np.testing.assert_allclose(lo.evict[:, 0], 0.0, atol=1e-10)            # everything kept: exact
    np.testing.assert_allclose(lo.retained[:, 0], 1.0, rtol=1e-5)
    np.testing.assert_allclose(lo.quant[:, 0], 0.0)
    assert (np.diff(lo.retained, axis=1) <= 1e-6).all()                    # keeping less retains less
    assert (lo.evict[:, -1] > 0).all()                                     # sinks + window only: lossy
    assert (np.diff(lo.quant[:, 1:], axis=1) > 0).all()                    # 8 < 4 < 2 bits in error


def test_quantization_loss_is_the_dequantized_attention():
    """Worked example: one head, values already on the 2-bit grid of their group, keys constant
    per channel: 2-bit quantization is exact (scale 1, zero 0) and the loss is 0; at 4 and 8 bits
    the grid step 3/15, 3/255 is not an fp16 number, so the loss is tiny but not 0."""
    from kvcore.statistics import layer_losses
    t, d = 32, 8
    v = torch.tensor([0.0, 1.0, 2.0, 3.0]).repeat(t, d // 4)[None]          # [1, T, D], groups of 8 = 2x(0..3)
    k = torch.ones(1, t, d)
    q = torch.randn(1, 4, d, generator=torch.Generator().manual_seed(0))
    mass = torch.rand(1, t, generator=torch.Generator().manual_seed(1))
    _, _, quant = layer_losses(q, k, v, mass, 0.5, 4)
    assert quant[0] == 0.0 and quant[3] < 1e-12                            # 16 bits, 2 bits: exact
    assert 0.0 < max(quant[1], quant[2]) < 1e-6


def test_once_probes_each_mode_once_and_upgrades_to_losses():
    from planner.probe import once
    calls, seen = [], []

    def run(ids, gqa_mode, losses):
        calls.append((gqa_mode, losses))
        return dataclasses.replace(stats(m=2, t=8), losses=object() if losses else None)

    probe = once(run, [1, 2, 3], lambda: seen.append(1))
    a = probe(gqa_mode="repeat")
    assert probe(gqa_mode="repeat") is a and calls == [("repeat", False)]
    b = probe(gqa_mode="repeat", losses=True)                      # asked for losses: probes again
    assert probe(gqa_mode="repeat") is b and probe(gqa_mode="repeat", losses=True) is b
    probe(gqa_mode="mean")
    assert calls == [("repeat", False), ("repeat", True), ("mean", False)] and len(seen) == 3


def _random_model(arch: str):
    """A 3-layer random model of another architecture (GQA 6:2, head dim 16): Qwen2 (biased q/k/v
    projections) or Qwen3 (RMS norms on each head's queries and keys before RoPE)."""
    from pathlib import Path
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from kvcore.model import LoadedModel
    torch.manual_seed(5)
    config, model = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = config(vocab_size=2000, hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                 attn_implementation="sdpa")
    m = model(cfg).eval()
    return LoadedModel(m, None, Path("."), arch, 3, 2, 6, 16, 512)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_probe_statistics_are_the_full_forwards_attention_on_other_architectures(arch):
    lm = _random_model(arch)
    ids = list(range(100, 160))
    stats = Prober(lm=lm, window=8, pool_kernel=3, sample=1000).probe(ids, "repeat")
    attn, kv = _eager_attention(lm, ids)                # after the probe: its hooks act only while it runs
    t = len(ids)
    assert stats.window_scores.shape == (3, 6, t)
    for i in range(3):
        want = pooled(attn[i][:, -8:].sum(1).float(), 3)
        np.testing.assert_allclose(stats.window_scores[i], want.numpy(), rtol=1e-4, atol=1e-6)
        for x, theta, got in ((kv[i][0], 0.9, stats.k_similar[i]), (kv[i][1], 0.6, stats.v_similar[i])):
            xn = F.normalize(x.float(), dim=-1)
            share = float((xn @ xn.transpose(1, 2) > theta)[:, ~torch.eye(t, dtype=torch.bool)].float().mean())
            assert got == pytest.approx(share, abs=1e-6)
    assert stats.k_angle[0] == pytest.approx(angle(kv[0][0], kv[1][0]), abs=1e-6)
    assert stats.v_angle[1] == pytest.approx(angle(kv[1][1], kv[2][1]), abs=1e-6)
    assert lm.model.config._attn_implementation == "kvplan"
    plain = lm.model(torch.tensor([ids]), use_cache=False).logits       # no probe running: plain causal attention
    lm.model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(plain, lm.model(torch.tensor([ids]), use_cache=False).logits, rtol=1e-4, atol=1e-5)


def test_a_sliding_window_shorter_than_the_prompt_is_refused():
    lm = _random_model("qwen2")
    lm.model.config.use_sliding_window, lm.model.config.sliding_window = True, 16
    for layer in lm.model.model.layers:
        layer.self_attn.sliding_window = 16
    with pytest.raises(NotImplementedError, match="sliding-window"):
        Prober(lm=lm, window=8).probe(list(range(100, 140)))
