"""Attention over K/V quantized in the pool's groups (`kernels.quant_attention`): the reference's
copies are the pool's quantization (`kernels.quant`'s pack and unpack) in the pool's groups with the
tail exact; the C++ kernel against the reference on odd shapes (rows not a whole number of groups,
fewer rows than a group, no GQA, a head dim that is no multiple of 16, a 1-bit width of 192-row
groups); bad arguments named."""
import pytest
import torch

from kernels import cpu_extension, quantize_pack, unpack_dequantize
from kernels import quant_attention as qa
from kvcore.blocks import quant_shape
from tests.kernels.interp import rel_err

needs_kernel = pytest.mark.skipif(cpu_extension.module() is None or not hasattr(cpu_extension.module(), "quant_attention"),
                                  reason="no C++ compiler here")


def test_the_copies_follow_the_pools_groups():
    """At 100 rows every width's groups cover rows 0..95 (24, 48 and 96 divide 96), the rest exact."""
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(3, 100, 64, generator=gen), torch.randn(3, 100, 64, generator=gen)
    for bits in (8, 4, 2):
        rows, value_group = quant_shape(bits)
        kq, vq = qa.quantized(k, v, bits)
        q_t = 100 - 100 % rows
        assert torch.equal(kq[:, q_t:], k[:, q_t:]) and torch.equal(vq[:, q_t:], v[:, q_t:])
        want_k = unpack_dequantize(*quantize_pack(k[:, :q_t].transpose(1, 2).reshape(-1, q_t), bits, rows), bits, rows)
        torch.testing.assert_close(kq[:, :q_t].transpose(1, 2).reshape(-1, q_t), want_k, rtol=1e-6, atol=1e-6)
        want_v = unpack_dequantize(*quantize_pack(v[:, :q_t].reshape(-1, 64), bits, value_group), bits, value_group)
        torch.testing.assert_close(vq[:, :q_t].reshape(-1, 64), want_v, rtol=1e-6, atol=1e-6)
    short_k, short_v = qa.quantized(k[:, :40], v[:, :40], 4)                       # fewer rows than a 48-row group
    assert torch.equal(short_k, k[:, :40]) and torch.equal(short_v, v[:, :40])


# (G, g, Wq, T, D, bits)
CASES = [(3, 3, 8, 300, 64, [8, 4, 2]), (3, 3, 8, 96, 64, [8, 4, 2]), (2, 1, 5, 40, 64, [8, 4, 2]),
         (1, 2, 3, 457, 48, [8, 4, 2, 1]), (2, 3, 8, 4096, 64, [8, 4, 2])]


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=[f"G{c[0]}g{c[1]}W{c[2]}T{c[3]}D{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(case, dtype):
    g, heads, wq, t, d, bits = case
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(g, heads * wq, d, generator=gen)
    k, v = (torch.randn(g, t, d, generator=gen) * 2).to(dtype), torch.randn(g, t, d, generator=gen).to(dtype)
    got = cpu_extension.module().quant_attention(q, k, v, bits, [qa.groups(b, d)[0] for b in bits],
                                                 [qa.groups(b, d)[1] for b in bits], wq, d ** -0.5)
    want = qa.quant_attention_reference(q, k, v, bits, wq, d ** -0.5)
    assert got.shape == want.shape == (len(bits), g, heads * wq, d) and not got.isnan().any()
    for i, b in enumerate(bits):
        assert rel_err(got[i], want[i]) < 2e-5, b
    torch.testing.assert_close(qa.quant_attention(q, k, v, bits, wq, d ** -0.5), got)     # the launcher takes it


@needs_kernel
def test_the_quantized_outputs_differ_from_the_exact_ones_as_the_widths_do():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 24, 64, generator=gen), torch.randn(3, 500, 64, generator=gen), torch.randn(3, 500, 64, generator=gen)
    outs = qa.quant_attention(q, k, v, [8, 4, 2], 8, 0.125)
    exact = qa.quant_attention_reference(q, k, v, [8], 8, 0.125)[0] * 0 + torch.softmax(
        (q @ k.transpose(1, 2) * 0.125).masked_fill(~(torch.arange(500)[None] <= (492 + torch.arange(24) % 8)[:, None]),
                                                    float("-inf")), -1) @ v
    errs = [float((o - exact).pow(2).sum() / exact.pow(2).sum()) for o in outs]
    assert 0 < errs[0] < errs[1] < errs[2]


def test_bad_arguments_are_named():
    q, k = torch.randn(2, 6, 16), torch.randn(2, 30, 16)
    with pytest.raises(ValueError, match="k, v"):
        qa.quant_attention(q, k, k[:, :, :8], [4], 3, 0.25)
    with pytest.raises(ValueError, match="wq must divide the 6 query rows"):
        qa.quant_attention(q, k, k, [4], 4, 0.25)
