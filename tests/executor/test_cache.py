"""The planned cache with full layers: same attention as transformers' own cache, K/V held in
the storage dtype, and byte accounting equal to the tensors' own nbytes."""
import torch
from transformers import DynamicCache

from executor.cache import PlannedCache, UnsupportedPlan
from kvplan.plan import CompressionPlan, Eviction, LayerPlan, Quant, full_plan

import pytest


def _cache(lm, dtype=torch.float16):
    return PlannedCache(full_plan(lm.num_layers, "t"), lm.num_layers, lm.num_kv_heads, lm.head_dim, dtype)


@torch.inference_mode()
def test_full_layers_match_dynamic_cache_and_store_fp16(tiny_model):
    model = tiny_model.model
    ids = torch.randint(0, 1000, (1, 23))
    ref_cache, cache = DynamicCache(config=model.config), _cache(tiny_model)
    ref = model(input_ids=ids, past_key_values=ref_cache, use_cache=True).logits
    got = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)      # fp16 storage rounding only
    nxt = torch.tensor([[5]])
    ref = model(input_ids=nxt, past_key_values=ref_cache, use_cache=True).logits
    got = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        assert layer.keys.dtype == torch.float16 and layer.keys.shape == ref_layer.keys.shape   # [1, H_kv, 24, D]
        torch.testing.assert_close(layer.keys.float(), ref_layer.keys.float(), rtol=1e-3, atol=1e-3)


@torch.inference_mode()
def test_kv_bytes_are_the_tensors_nbytes(tiny_model):
    model = tiny_model.model
    cache = _cache(tiny_model)
    model(input_ids=torch.randint(0, 1000, (1, 31)), past_key_values=cache, use_cache=True)
    per_layer = cache.layer_bytes()
    assert len(per_layer) == tiny_model.num_layers
    for lb, layer in zip(per_layer, cache.layers):
        assert lb.kv_bytes == layer.keys.nbytes + layer.values.nbytes > 0
        assert lb.full_kv_bytes == 2 * 31 * tiny_model.num_kv_heads * tiny_model.head_dim * 2    # fp16
        assert lb.kept_tokens == 31 and lb.kind == "full"
    fp32 = _cache(tiny_model, torch.float32)
    model(input_ids=torch.randint(0, 1000, (1, 31)), past_key_values=fp32, use_cache=True)
    assert fp32.layer_bytes()[0].kv_bytes == 2 * per_layer[0].kv_bytes


def test_plans_the_executor_cannot_run_are_rejected(tiny_model):
    with pytest.raises(UnsupportedPlan, match="layers"):
        PlannedCache(full_plan(5, "t"), tiny_model.num_layers, 2, 16, torch.float16)
    odd = CompressionPlan("t", "s", (LayerPlan(0), LayerPlan(1, eviction=Eviction(keep_tokens=3), quant=Quant(bits=3))))
    with pytest.raises(UnsupportedPlan, match="quant"):
        PlannedCache(odd, 2, 2, 16, torch.float16)
