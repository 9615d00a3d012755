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


@torch.inference_mode()
def test_full_layers_decode_through_the_fused_kernel_as_through_a_float_copy(tiny_model):
    """A decode row routed to a full layer reads its fp16 rows in the kernel (`kernels.dense_decode`);
    the logits match the same cache converting its rows to fp32 for SDPA, step after step."""
    from executor import attention
    from kernels import dense_decode

    if not dense_decode.handles(torch.empty(1, dtype=torch.float16)):
        pytest.skip("the kernel could not be built here: both paths are the reference")
    model = tiny_model.model
    model.set_attn_implementation(attention.register())
    ids = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(3))

    def decode(enabled: bool) -> tuple[torch.Tensor, list]:
        dense_decode.ENABLED = enabled
        try:
            cache, logits, token = _cache(tiny_model), [], None
            with attention.using(cache):
                with cache.state.running("context"):
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
                for _ in range(6):
                    token = out.argmax(-1, keepdim=True)
                    kinds = {layer._decodes_stored(1) for layer in cache.layers}
                    out = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
                    logits.append(out)
            return torch.cat(logits), kinds
        finally:
            dense_decode.ENABLED = True

    (fused, used), (copied, unused) = decode(True), decode(False)
    assert used == {True} and unused == {False}          # the kernel ran on every layer, then on none
    torch.testing.assert_close(fused, copied, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.argmax(-1), copied.argmax(-1))
