"""The fused decode kernel over KIVI-quantized KV groups against its torch reference: every bit
width, odd group sizes and head dims, 1-3 query heads, tails from none to long, masks, a layer's
groups of different lengths in one call, and bad arguments named before any work."""
import pytest
import torch

from kernels import cpu_extension, quant_attend
from kernels import quant_decode as qd
from kernels import quantize_pack


def _built():
    if cpu_extension.module() is None:
        pytest.skip("the kernels could not be built here (no C++ compiler): the reference serves")


def _rows(n_tokens: int, d: int, bits: int, g: int, gv: int, seed: int):
    """A group's quantized rows laid out as `executor.layers.quant.QuantGroup` keeps them."""
    gen = torch.Generator().manual_seed(seed)
    n = n_tokens // g
    k = torch.randn(n * g, d, generator=gen) * 2
    v = torch.randn(n * g, d, generator=gen)
    kc, ks, kz = quantize_pack(k.reshape(n, g, d).transpose(1, 2).reshape(n * d, g), bits, g)
    vc, vs, vz = quantize_pack(v, bits, gv)
    return qd.QuantRows(kc.view(n, d, -1), ks.view(n, d), kz.view(n, d), vc, vs, vz, bits)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("g, gv, d, h, tail", [(32, 32, 64, 3, 17), (16, 8, 16, 1, 0), (8, 16, 48, 2, 40),
                                               (32, 64, 64, 3, 0)])
def test_the_kernel_matches_its_reference(bits, g, gv, d, h, tail):
    _built()
    rows = [_rows(5 * g + 3 * i * g, d, bits, g, gv, seed=i) for i in range(2)]
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, h, d, generator=gen)
    tails = [torch.randn(tail, d, generator=gen).half() for _ in range(4)]
    masks = [torch.rand(h, r.rows + tail, generator=gen) > 0.3 for r in rows]
    for m in masks:
        m[:, -1] = True                                                    # every head sees a row
    for mk in (None, masks):
        got = qd.attend_groups_cpu(rows, q, tails[:2], tails[2:], mk, 0.125)
        for i, r in enumerate(rows):
            ref = r.attend_reference(q[i], tails[i], tails[2 + i], None if mk is None else mk[i], 0.125)
            assert torch.allclose(got[i], ref, rtol=1e-4, atol=1e-5), (i, (got[i] - ref).abs().max())
        assert torch.equal(quant_attend(rows, q, tails[:2], tails[2:], mk, 0.125), got)   # the dispatch takes it


def test_a_group_with_only_a_tail_and_one_without_one():
    d, g = 16, 8
    empty = qd.QuantRows(torch.zeros(0, d, g, dtype=torch.uint8), torch.zeros(0, d, dtype=torch.float16),
                         torch.zeros(0, d, dtype=torch.float16), torch.zeros(0, d, dtype=torch.uint8),
                         torch.zeros(0, 2, dtype=torch.float16), torch.zeros(0, 2, dtype=torch.float16), 8)
    q, kt, vt = torch.randn(1, 2, d), torch.randn(5, d).half(), torch.randn(5, d).half()
    ref = torch.softmax(q[0] @ kt.float().T * 0.5, dim=-1) @ vt.float()
    assert torch.allclose(quant_attend([empty], q, [kt], [vt], None, 0.5)[0], ref, atol=1e-6)
    assert torch.allclose(quant_attend([empty], q, [kt.float()], [vt.float()], None, 0.5)[0], ref, atol=1e-6)  # reference
    full = _rows(4 * g, d, 8, g, 8, seed=3)
    z = torch.zeros(0, d, dtype=torch.float16)
    assert torch.allclose(quant_attend([full], q, [z], [z], None, 0.5)[0],
                          full.attend_reference(q[0], z, z, None, 0.5), atol=1e-5)


def test_bad_arguments_are_named():
    rows = _rows(64, 16, 4, 32, 16, seed=0)
    q, t = torch.randn(1, 2, 16), torch.randn(3, 16)
    with pytest.raises(ValueError, match="q must be"):
        quant_attend([rows], torch.randn(1, 2, 8), [t], [t], None, 1.0)
    with pytest.raises(ValueError, match="tails"):
        quant_attend([rows], q, [t], [torch.randn(2, 16)], None, 1.0)
    with pytest.raises(ValueError, match="mask"):
        quant_attend([rows], q, [t], [t], [torch.ones(2, 5, dtype=torch.bool)], 1.0)
    with pytest.raises(ValueError, match="per group"):
        quant_attend([rows, rows], q, [t], [t], None, 1.0)
    with pytest.raises(ValueError, match="fp16"):
        qd.QuantRows(*[x.float() if x.dtype == torch.float16 else x for x in rows.tensors], 4)
    with pytest.raises(ValueError, match="bits"):
        qd.QuantRows(*rows.tensors, 3)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_group_gives_the_same_result_alone_or_among_many(bits):
    """One call over the groups of many sequences (different lengths, tails, masks) gives each
    group bit for bit what its own call gives: a job's tokens do not depend on its batch."""
    _built()
    g, d, h = 32, 64, 3
    rows = [_rows(n * g, d, bits, g, g, seed=n) for n in (1, 7, 8, 9, 40)]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(rows), h, d, generator=gen)
    tails = [torch.randn(r, d, generator=gen).half() for r in (0, 3, 32, 63, 17)]
    vt = [torch.randn(t.shape[0], d, generator=gen).half() for t in tails]
    got = quant_attend(rows, q, tails, vt, None, 0.125)
    for i, r in enumerate(rows):
        assert torch.equal(got[i], quant_attend([r], q[i:i + 1], [tails[i]], [vt[i]], None, 0.125)[0]), i
        ref = r.attend_reference(q[i], tails[i], vt[i], None, 0.125)
        assert torch.allclose(got[i], ref, rtol=1e-4, atol=1e-5), (i, (got[i] - ref).abs().max())
