"""The statistics' passes over a layer's context (`kernels.window_stats`): the references on small
worked examples, the C++ kernels against the references on the model's shapes and odd ones (a
context shorter than the window, rows not a multiple of 16, bf16 and fp32 inputs, rows in no set),
the launchers' errors naming what is wrong."""
import math

import pytest
import torch

from kernels import cpu_extension
from kernels import window_stats as ws

needs_kernel = pytest.mark.skipif(ws._kernels() is None, reason="no C++ compiler or no AVX-512 here: the references run")


def test_the_window_reference_sums_each_heads_causal_probabilities():
    """One KV head, one query head, a window of 2 over 3 keys: row 0 sees keys 0..1, row 1 all three."""
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])                                     # [G=1, gq·w=2, D=2]
    k = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, math.log(2.0)]]])       # [1, 3, 2]
    s, last = ws.window_stats_reference(q, k, 2, 1, 1.0)
    row0 = torch.tensor([1 / 4, 3 / 4, 0.0])                                          # e^0, e^ln3 over keys 0..1
    row1 = torch.tensor([1 / 4, 1 / 4, 2 / 4])                                        # e^0, e^0, e^ln2
    torch.testing.assert_close(s, (row0 + row1).view(1, 1, 3))
    torch.testing.assert_close(last, row1.view(1, 1, 3))


def test_the_segment_reference_sums_each_sets_rows():
    p = torch.tensor([[[0.5, 0.25, 0.25]]])                                           # [G=1, Q=1, T=3]
    v = torch.tensor([[[2.0], [4.0], [8.0]]])                                         # [1, 3, D=1]
    num, den = ws.segment_sums_reference(p, v, torch.tensor([[1, 0, -1]]), 2)
    torch.testing.assert_close(num, torch.tensor([[[[1.0]], [[1.0]]]]))               # set 0: 0.25·4; set 1: 0.5·2
    torch.testing.assert_close(den, torch.tensor([[[0.25], [0.5]]]))                  # row 2 in no set


def test_the_angle_reference_is_the_mean_arccos_over_rows():
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    b = torch.tensor([[0.0, 1.0], [1.0, 0.0]])                                        # 90° and 0°
    assert float(ws.mean_angle_reference(a, b)) == pytest.approx(0.25)


@needs_kernel
@pytest.mark.parametrize("t,w,e", [(4096, 32, 8), (300, 32, 8), (37, 32, 8), (20, 20, 8), (1000, 32, 0), (333, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_kernel_matches_the_reference(t, w, e, dtype):
    gen = torch.Generator().manual_seed(t + w)
    q = torch.randn(3, 3 * w, 64, generator=gen).to(dtype)
    k = (torch.randn(3, t, 64, generator=gen) * 2).to(dtype)
    s, last = cpu_extension.module().window_stats(q, k, w, e, 0.125)
    want_s, want_last = ws.window_stats_reference(q, k, w, e, 0.125)
    assert s.shape == want_s.shape == (3, 3, t) and last.shape == want_last.shape == (3, 3 * e, t)
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last, want_last, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.sum(-1), torch.full((3, 3), float(w)), rtol=1e-5, atol=1e-5)   # w rows, each sums to 1
    got = ws.window_stats(q, k, w, e, 0.125)                                          # the launcher takes it
    assert torch.equal(got[0], s) and torch.equal(got[1], last)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_kernel_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    for t, q, sets in ((4096, 24, 10), (77, 9, 3), (50, 24, 12)):                     # 12 sets over 50 rows: some empty
        p = torch.rand(3, q, t, generator=gen)
        v = torch.randn(3, t, 64, generator=gen).to(dtype)
        seg = torch.randint(-1, sets, (3, t), generator=gen, dtype=torch.int32)
        num, den = cpu_extension.module().segment_sums(p, v, seg, sets)
        want_num, want_den = ws.segment_sums_reference(p, v, seg, sets)
        torch.testing.assert_close(num, want_num, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(den, want_den, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_angle_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(3, 1000, 64, generator=gen).to(dtype), torch.randn(3, 1000, 64, generator=gen).to(dtype)
        b[0, :10] = a[0, :10]                                                         # some rows alike: cos 1
        got = cpu_extension.module().mean_angle(a, b)
        assert got.shape == () and got.dtype == torch.float32
        assert float(got) == pytest.approx(float(ws.mean_angle_reference(a, b)), rel=1e-5)


def test_the_launchers_name_bad_arguments():
    q, k = torch.randn(3, 96, 64), torch.randn(3, 100, 64)
    with pytest.raises(ValueError, match="w must divide"):
        ws.window_stats(q, k, 40, 8, 0.125)
    with pytest.raises(ValueError, match="e within 0..w"):
        ws.window_stats(q, k, 32, 33, 0.125)
    with pytest.raises(ValueError, match=r"q must be \[G, gq\*w, D\]"):
        ws.window_stats(q[0], k, 32, 8, 0.125)
    with pytest.raises(ValueError, match=r"seg \[G, T\]"):
        ws.segment_sums(torch.rand(3, 24, 100), k, torch.zeros(3, 99, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"\[\.\.\., D\] alike"):
        ws.mean_angle(k, q)
