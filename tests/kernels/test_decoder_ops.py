"""The decoder's fused per-row ops: the C++ kernels against their torch references (and the
references against transformers' own Llama modules) on odd shapes, in place where they say so,
in fp32 and in bf16 (the kernel rounds once where torch's modules round after every op: within a
bf16 step of them), and the references where the kernel does not apply (fp16 rows, strided views)."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from kernels import cpu_extension
from kernels import decoder_ops as ops

needs_kernel = pytest.mark.skipif(cpu_extension.module() is None, reason="no C++ compiler here")
GEN = torch.Generator().manual_seed(0)
BF16 = dict(rtol=1.6e-2, atol=1e-2)        # a bf16 rounding step (8 bits of mantissa) and a little


def kernel_runs(name: str, monkeypatch) -> list:
    """Record the C++ kernel's calls to `name` (so a test knows the kernel, not the reference, ran)."""
    calls, mod = [], cpu_extension.module()

    class Spy:
        def __getattr__(self, attr):
            fn = getattr(mod, attr)
            if attr != name:
                return fn
            return lambda *a: calls.append(attr) or fn(*a)
    monkeypatch.setattr(cpu_extension, "module", lambda: Spy())
    return calls


@pytest.mark.parametrize("n, h", [(1, 576), (7, 64), (33, 100)])
def test_rms_norm_is_llamas(n, h):
    x, w = torch.randn(n, h, generator=GEN) * 3, torch.rand(h, generator=GEN) + 0.5
    ref = LlamaRMSNorm(h, eps=1e-5)
    ref.weight.data.copy_(w)
    torch.testing.assert_close(ops.rms_norm_reference(x, w, 1e-5), ref(x))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref(x), rtol=1e-5, atol=1e-6)
    strided = torch.randn(n, 2 * h, generator=GEN)[:, ::2]                        # not contiguous: the reference
    torch.testing.assert_close(ops.rms_norm(strided, w, 1e-5), ops.rms_norm_reference(strided, w, 1e-5))


@needs_kernel
def test_add_rms_norm_adds_in_place_then_normalizes():
    residual, delta, w = torch.randn(5, 96, generator=GEN), torch.randn(5, 96, generator=GEN), torch.rand(96) + 0.5
    want_sum = residual + delta
    want = ops.rms_norm_reference(want_sum, w, 1e-6)
    got = ops.add_rms_norm(residual, delta, w, 1e-6)
    torch.testing.assert_close(residual, want_sum)                                 # the residual, in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    half = residual.clone().half()
    torch.testing.assert_close(ops.add_rms_norm(half, delta.half(), w.half(), 1e-6),
                               ops.rms_norm_reference(half, w.half(), 1e-6))      # fp16: the reference path


@pytest.mark.parametrize("n, heads, d", [(1, 9, 64), (6, 3, 16), (13, 2, 128)])
def test_rope_in_place_is_hfs(n, heads, d):
    x = torch.randn(n, heads, d, generator=GEN)
    pos = torch.randint(0, 5000, (n,), generator=GEN).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(0, d, 2).float() / d))[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()                                               # [N, D]
    want = x * cos[:, None] + rotate_half(x) * sin[:, None]                        # transformers' apply_rotary_pos_emb
    torch.testing.assert_close(ops.rope_reference(x, cos, sin), want)
    y = x.clone()
    assert ops.rope_(y, cos, sin) is y
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    view = torch.randn(n, heads + 2, d, generator=GEN)[:, 1:1 + heads]             # a head slice of a wider row
    want_view = ops.rope_reference(view.clone(), cos, sin)
    ops.rope_(view, cos, sin)
    torch.testing.assert_close(view, want_view, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1536), (17, 100), (3, 5)])
def test_silu_mul_is_llamas_mlp_product(shape):
    gate, up = torch.randn(*shape, generator=GEN) * 4, torch.randn(*shape, generator=GEN)
    torch.testing.assert_close(ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("n, h", [(1, 576), (7, 64), (33, 100)])
def test_bf16_rms_norms_are_the_fp32_math_rounded_once(n, h, monkeypatch):
    x, w = (torch.randn(n, h, generator=GEN) * 3).bfloat16(), (torch.rand(h, generator=GEN) + 0.5).bfloat16()
    calls = kernel_runs("rms_norm", monkeypatch)
    exact = ops.rms_norm_reference(x.float(), w.float(), 1e-5)
    got = ops.rms_norm(x, w, 1e-5)
    assert calls and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, exact.bfloat16(), rtol=0, atol=0)        # fp32 math, one rounding: bit for bit
    torch.testing.assert_close(got.float(), ops.rms_norm_reference(x, w, 1e-5).float(), **BF16)
    residual, delta = x.clone(), (torch.randn(n, h, generator=GEN)).bfloat16()
    want_sum = (x.float() + delta.float()).bfloat16()
    got = ops.add_rms_norm(residual, delta, w, 1e-5)
    assert torch.equal(residual, want_sum)                                    # in place, rounded as torch's add
    torch.testing.assert_close(got, ops.rms_norm_reference(want_sum.float(), w.float(), 1e-5).bfloat16(), rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, heads, d", [(1, 9, 64), (6, 3, 16), (13, 2, 128), (3, 2, 6)])
def test_bf16_rope_in_place(n, heads, d, cos_dtype, monkeypatch):
    x = torch.randn(n, heads, d, generator=GEN).bfloat16()
    emb = torch.rand(n, d, generator=GEN) * 6.3
    cos, sin = emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)
    want = ops.rope_reference(x.float(), cos.float(), sin.float()).bfloat16()
    calls = kernel_runs("rope_", monkeypatch)
    y = x.clone()
    assert ops.rope_(y, cos, sin) is y and calls
    torch.testing.assert_close(y.float(), want.float(), rtol=8e-3, atol=1e-5)    # FMA's rounding: one bf16 step at most
    torch.testing.assert_close(y.float(), ops.rope_reference(x, cos.bfloat16(), sin.bfloat16()).float(), **BF16)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1536), (17, 100), (3, 5)])
def test_bf16_silu_mul(shape, monkeypatch):
    gate, up = (torch.randn(*shape, generator=GEN) * 4).bfloat16(), torch.randn(*shape, generator=GEN).bfloat16()
    calls = kernel_runs("silu_mul", monkeypatch)
    got = ops.silu_mul(gate, up)
    assert calls and got.dtype == torch.bfloat16
    exact = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()
    torch.testing.assert_close(got.float(), exact.float(), rtol=8e-3, atol=1e-6)   # one bf16 step
    torch.testing.assert_close(got.float(), (torch.nn.functional.silu(gate) * up).float(), **BF16)


@needs_kernel
def test_silu_mul_saturates_like_torch():
    gate = torch.tensor([[-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0, 200.0] + [0.5] * 7])
    up = torch.ones_like(gate)
    torch.testing.assert_close(ops.silu_mul(gate, up), torch.nn.functional.silu(gate), rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_take_the_reference():
    x, w = torch.randn(4, 32, generator=GEN).bfloat16(), torch.rand(32, generator=GEN)      # fp32 weight: no kernel
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6))
