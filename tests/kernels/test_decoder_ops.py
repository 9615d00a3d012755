"""The decoder's fused per-row ops: the C++ kernels against their torch references (and the
references against transformers' own Llama modules) on odd shapes, in place where they say so,
and the references where the kernel does not apply (fp16/bf16 rows, strided views)."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from kernels import cpu_extension
from kernels import decoder_ops as ops

needs_kernel = pytest.mark.skipif(cpu_extension.module() is None, reason="no C++ compiler here")
GEN = torch.Generator().manual_seed(0)


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
