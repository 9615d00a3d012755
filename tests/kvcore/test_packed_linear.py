"""The model's linears through oneDNN's packed weights: the same outputs as `nn.Linear` to
rounding, the decoder's float weights freed, the tied LM head still tied, bf16 linears on the
CPU's bf16 units, and nothing swapped where the model is not CPU fp32 or bf16."""
import dataclasses

import pytest
import torch

from kvcore import model as models
from kvcore import packed_linear
from kvcore.packed_linear import FusedLinear, FusedPart, PackedLinear, fuse, pack

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch has no oneDNN packed linear")


needs_bf16_packing = pytest.mark.skipif(not packed_linear.packs_bf16(), reason="oneDNN cannot pack bf16 weights on this CPU")


@pytest.mark.parametrize("rows", [1, 4, 17, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_gives_the_linears_output(rows, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(1, rows, 96)
    want = lin(x)
    got = PackedLinear(lin, keep_weight=False)(x)
    assert got.shape == want.shape == (1, rows, 200)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    strided = torch.randn(rows, 2, 96)[:, 0]                                   # any input strides
    torch.testing.assert_close(PackedLinear(lin, keep_weight=False)(strided), lin(strided), rtol=1e-4, atol=1e-5)


def test_packing_a_model_swaps_every_linear_and_keeps_its_logits(tiny_model_dir, model_cfg):
    plain = models.load(dataclasses.replace(model_cfg, model=str(tiny_model_dir), packed_linear=False)).model
    packed = models.load(dataclasses.replace(model_cfg, model=str(tiny_model_dir), packed_linear=True)).model
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert sum(type(m) is PackedLinear for m in packed.modules()) == 2 * 2 + 1           # o, down of 2 layers; the head
    assert sum(type(m) is FusedLinear for m in packed.modules()) == 2 * 2                # qkv, gate_up of 2 layers
    a = packed.model.layers[0].self_attn
    assert a.qkv.sizes == [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
    head = packed.get_output_embeddings()
    assert head.weight is packed.get_input_embeddings().weight                        # tied: kept, not copied
    assert not hasattr(packed.model.layers[0].mlp.up_proj, "weight")                  # the float copies freed
    assert not hasattr(packed.model.layers[0].mlp.gate_up, "weight")
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linears_give_each_linears_output_and_share_one_product(dtype):
    """q, k, v (different widths) packed as one: the product split is each linear's; the parts'
    calls on one input (as the model's own forward makes them) compute it once."""
    if dtype == torch.bfloat16 and not packed_linear.packs_bf16():
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.q_proj, m.k_proj, m.v_proj = (torch.nn.Linear(96, n, bias=False).to(dtype) for n in (96, 32, 32))
    x = torch.randn(5, 96).to(dtype)
    want = [m.q_proj(x), m.k_proj(x), m.v_proj(x)]
    assert fuse(m) == 1 and type(m.q_proj) is FusedPart and m.qkv.sizes == [96, 32, 32]
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    for got, w in zip(m.qkv(x).split(m.qkv.sizes, -1), want):
        torch.testing.assert_close(got, w, **tol)
    calls = []
    real = m.qkv.forward
    m.qkv.forward = lambda t: calls.append(1) or real(t)
    parts = [m.q_proj(x), m.k_proj(x), m.v_proj(x)]
    assert len(calls) == 1 and all(p.is_contiguous() for p in parts)
    for got, w in zip(parts, want):
        torch.testing.assert_close(got, w, **tol)
    y = torch.randn(2, 96).to(dtype)                                     # another input: its own product
    torch.testing.assert_close(m.k_proj(y), want_k := m.qkv(y)[:, 96:128], **tol)
    assert len(calls) == 3 and want_k.shape == (2, 32)


def test_nothing_is_swapped_off_cpu_fp32_or_bf16():
    lm = torch.nn.Module()
    lin = torch.nn.Linear(8, 8).to(torch.float16)
    lm.get_output_embeddings = lambda: lin
    lm.lin = lin
    assert pack(lm) == 0 and type(lm.lin) is torch.nn.Linear


def test_a_bf16_model_is_left_unpacked_where_onednn_packs_no_bf16(monkeypatch, caplog):
    monkeypatch.setattr(packed_linear, "packs_bf16", lambda: False)       # an AVX2-only CPU
    lm = torch.nn.Module()
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    lm.get_output_embeddings = lambda: lin
    lm.get_input_embeddings = lambda: torch.nn.Embedding(4, 8)
    lm.lin = lin
    assert pack(lm) == 0 and type(lm.lin) is torch.nn.Linear
    assert "cannot pack bf16" in caplog.text


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 4, 17, 600])
def test_a_bf16_packed_linear_gives_the_bf16_linears_output(rows):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96).bfloat16()
    got = PackedLinear(lin, keep_weight=False)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    exact = x.float() @ lin.weight.float().T + lin.bias.float()                 # fp32 accumulation of bf16 products
    torch.testing.assert_close(got.float(), exact, rtol=1.6e-2, atol=1.6e-2)    # one bf16 rounding of the result


@needs_bf16_packing
def test_a_bf16_model_is_packed_and_runs_on_the_bf16_units(tiny_model_dir, model_cfg):
    """Where the CPU has AVX512-BF16 or AMX, oneDNN's verbose log names a bf16 brgemm kernel for
    the packed linears (a child process: oneDNN reads ONEDNN_VERBOSE once, at its first call)."""
    import os
    import subprocess
    import sys

    from kvcore.host import host
    packed = models.load(dataclasses.replace(model_cfg, model=str(tiny_model_dir), compute_dtype="bfloat16")).model
    assert packed.dtype == torch.bfloat16
    assert sum(type(m) is PackedLinear for m in packed.modules()) == 2 * 2 + 1
    assert sum(type(m) is FusedLinear for m in packed.modules()) == 2 * 2
    if not host().native_bf16:
        pytest.skip("no AVX512-BF16 or AMX here: oneDNN emulates bf16")
    code = ("import torch; from kvcore.packed_linear import PackedLinear; "
            "lin = PackedLinear(torch.nn.Linear(64, 96).bfloat16(), keep_weight=False); "
            "lin(torch.randn(8, 64).bfloat16())")
    log = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    calls = [line for line in log.splitlines() if ",exec," in line and ("matmul" in line or "inner_product" in line)]
    assert calls and all("bf16" in line.split(",")[6] or "amx" in line.split(",")[6] for line in calls), calls   # the kernel
    assert all("src:bf16" in line and "wei:bf16" in line for line in calls), calls
