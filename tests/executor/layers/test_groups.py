"""A dense group's decode row read by the fused fp16 kernel equals the group attending over its
rows converted to fp32; masked rows and prompt chunks keep the converted path."""
import pytest
import torch

from executor.layers.groups import DenseGroup
from kernels import dense_decode


def test_a_dense_groups_decode_row_through_the_kernel_matches_the_converted_rows():
    if not dense_decode.handles(torch.empty(1, dtype=torch.float16)):
        pytest.skip("the kernel could not be built here: both paths are the reference")
    gen = torch.Generator().manual_seed(0)
    group = DenseGroup(torch.randn(300, 64, generator=gen) * 2, torch.randn(300, 64, generator=gen),
                       torch.arange(300), torch.float16)
    group.append(torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen), torch.arange(300, 305))
    q = torch.randn(3, 1, 64, generator=gen)                 # [h_n, Tq = 1, D]
    fused = group.attend(q, None, 0.125)
    dense_decode.ENABLED = False
    try:
        converted = group.attend(q, None, 0.125)
    finally:
        dense_decode.ENABLED = True
    assert fused.shape == (3, 1, 64)
    torch.testing.assert_close(fused, converted, rtol=1e-4, atol=2e-5)
    assert not torch.equal(fused, converted)                 # it did run the kernel (its own summation order)
    mask = torch.ones(3, 1, 305, dtype=torch.bool)
    mask[1, 0, :100] = False
    masked = group.attend(q, mask, 0.125)                      # per-head kept sets: the converted path
    assert not torch.allclose(masked[1], fused[1]) and torch.allclose(masked[0], fused[0], atol=2e-5)
