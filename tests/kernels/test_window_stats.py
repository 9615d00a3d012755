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


def test_the_nested_reference_compares_each_prefix_output_with_every_sets():
    num = torch.tensor([[[[1.0]], [[3.0]]]])                                          # [G=1, S=2, Q=1, D=1]
    den = torch.tensor([[[0.25], [0.75]]])                                            # set 0 alone: 1 / 0.25 = 4
    got = ws.nested_errors_reference(num, den, [0, 1])                                # exact: 1 + 3 = 4
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0]))
    got = ws.nested_errors_reference(num, torch.tensor([[[0.5], [0.5]]]), [0, 1])     # 2 against 4; 4 against 4
    torch.testing.assert_close(got, torch.tensor([(2 - 4) ** 2 / 16, 0.0]))


def test_the_rank_reference_cuts_rows_by_score_ties_earlier_first():
    ranked = torch.tensor([[0.1, 0.9, 0.5, 0.5, 0.7, 0.0]])                          # ranks 4, 0, 2, 3, 1, 5
    got = ws.rank_sets_reference(ranked, [2, 4])                                      # ranks 0-1 | 2-3 | 4-5
    assert got.dtype == torch.int32
    assert got.tolist() == [[3, 1, 2, 2, 1, 3]]
    assert ws.rank_sets_reference(ranked, [3, 3]).tolist() == [[3, 1, 1, 3, 1, 3]]   # the tie at 0.5: row 2 first


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


@pytest.mark.skipif(ws._kernels("segment_kernel") is None, reason="no C++ compiler or no AVX2 here: the reference runs")
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
        got = ws.segment_sums(p, v, seg, sets)                                         # the launcher takes it
        assert torch.equal(got[0], num) and torch.equal(got[1], den)


@needs_kernel
def test_angle_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(3, 1000, 64, generator=gen).to(dtype), torch.randn(3, 1000, 64, generator=gen).to(dtype)
        b[0, :10] = a[0, :10]                                                         # some rows alike: cos 1
        got = cpu_extension.module().mean_angle(a, b)
        assert got.shape == () and got.dtype == torch.float32
        assert float(got) == pytest.approx(float(ws.mean_angle_reference(a, b)), rel=1e-5)


@pytest.mark.skipif(cpu_extension.module() is None, reason="no C++ compiler here: the reference runs")
@pytest.mark.parametrize("n,cuts", [(4060, [0, 203, 325, 487, 731, 1015, 1421, 2030, 3045]), (10, [2, 2, 5]),
                                    (7, []), (5, [5]), (1, [0, 1]), (300, [0, 0, 300])])
@pytest.mark.parametrize("ties", [False, True])
def test_rank_kernel_matches_the_reference(n, cuts, ties):
    gen = torch.Generator().manual_seed(n)
    ranked = torch.randint(0, 4, (3, n), generator=gen).float() if ties else torch.rand(3, n, generator=gen)
    got = cpu_extension.module().rank_sets(ranked, cuts)
    assert torch.equal(got, ws.rank_sets_reference(ranked, cuts))


@pytest.mark.skipif(cpu_extension.module() is None, reason="no C++ compiler here: the reference runs")
def test_nested_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    p = torch.rand(3, 24, 500, generator=gen)
    p = p / p.sum(-1, keepdim=True)
    seg = torch.randint(0, 7, (3, 500), generator=gen, dtype=torch.int32)
    num, den = ws.segment_sums_reference(p, torch.randn(3, 500, 64, generator=gen), seg, 7)
    upto = [0, 2, 2, 5, 6]
    got = cpu_extension.module().nested_errors(num, den, upto)
    want = ws.nested_errors_reference(num, den, upto)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert float(got[0]) > float(got[3]) > 0


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
    with pytest.raises(ValueError, match="upto must be set indices"):
        ws.nested_errors(torch.rand(3, 4, 24, 64), torch.rand(3, 4, 24), [4])
    with pytest.raises(ValueError, match=r"den \[G, S, Q\]"):
        ws.nested_errors(torch.rand(3, 4, 24, 64), torch.rand(3, 4), [1])
    with pytest.raises(ValueError, match="cuts must be ascending"):
        ws.rank_sets(torch.rand(3, 10), [5, 2])
    with pytest.raises(ValueError, match="cuts must be ascending"):
        ws.rank_sets(torch.rand(3, 10), [11])
    with pytest.raises(ValueError, match=r"ranked must be \[G, n\]"):
        ws.rank_sets(torch.rand(10), [1])
    with pytest.raises(ValueError, match=r"\[\.\.\., D\] alike"):
        ws.mean_angle(k, q)
