"""The pool write: the C++ kernel against its reference (bit for bit: the same fp16 rounding, from
fp32 and from bf16 rows),
rows landing at their K rows and V rows R after them, rows outside the arena refused."""
import pytest
import torch

from kernels import cpu_extension
from kernels.kv_write import write_kv, write_kv_reference


@pytest.mark.skipif(cpu_extension.module() is None, reason="no C++ compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, d", [(1, 64), (37, 16), (5, 128), (4, 24)])
def test_kernel_writes_what_the_reference_writes(m, d, dtype):
    g = torch.Generator().manual_seed(m)
    at = torch.randperm(200, generator=g)[:m] * 2                         # K rows; V rows 1 after (R = 1)
    k, v = (torch.randn(m, d, generator=g) * 100).to(dtype), torch.randn(m, d, generator=g).to(dtype)
    k[0, 0], v[0, -1] = 1e-6, 70000.0                                     # an fp16 subnormal, an overflow to inf
    got, want = torch.full((401, d), float("nan"), dtype=torch.float16), torch.full((401, d), float("nan"), dtype=torch.float16)
    cpu_extension.module().write_kv(got, at, k, v, 1)                     # the kernel itself (the launcher picks it)
    write_kv_reference(want, at, k, v, 1)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got[at], k.half()) and torch.equal(got[at + 1], v.half())
    launched = torch.full_like(got, float("nan"))
    write_kv(launched, at, k, v, 1)
    assert torch.equal(launched.nan_to_num(), got.nan_to_num())


@pytest.mark.skipif(cpu_extension.module() is None, reason="no C++ compiler here")
def test_a_row_outside_the_arena_is_refused():
    rows = torch.zeros(10, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="outside the arena"):
        write_kv(rows, torch.tensor([9]), torch.ones(1, 8), torch.ones(1, 8), 1)
