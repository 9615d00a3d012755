"""Row gather: the Triton kernel (under TRITON_INTERPRET=1) against the torch reference, the
launcher's contract, and the dispatch rule.

The kernel runs in a child process started with TRITON_INTERPRET=1 (see `tests.kernels.interp`),
which saves inputs and outputs; the assertions happen here.
"""
from __future__ import annotations

import sys

import pytest
import torch

import kernels
from kernels import gather
from tests.kernels.interp import interpreted_fixture

# name: (T, D, N, dtype, block_d, x layout, index dtype); odd shapes, masked column tails
CASES = {
    "fp16_T37_D24_N13": (37, 24, 13, torch.float16, None, "contiguous", torch.int64),
    "fp32_T37_D24_N13_two_col_blocks": (37, 24, 13, torch.float32, 16, "contiguous", torch.int64),
    "fp32_row_strided_view": (37, 24, 13, torch.float32, None, "row_stride_40", torch.int64),
    "fp16_int32_idx_repeats": (5, 7, 29, torch.float16, None, "contiguous", torch.int32),
    "bf16_T19_D5_N9": (19, 5, 9, torch.bfloat16, 4, "contiguous", torch.int64),
    "fp32_one_row": (1, 3, 4, torch.float32, None, "contiguous", torch.int64),
    "fp32_no_rows": (11, 6, 0, torch.float32, None, "contiguous", torch.int64),
}


def _inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    T, D, N, dtype, block_d, layout, idx_dtype = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if layout == "row_stride_40":
        x = torch.randn(T, 40, generator=g).to(dtype)[:, 5:5 + D]   # [T, D], stride (40, 1)
        assert x.stride() == (40, 1)
    else:
        x = torch.randn(T, D, generator=g).to(dtype)                # [T, D]
    idx = torch.randint(0, T, (N,), generator=g).to(idx_dtype)      # [N]
    return x, idx, block_d


def _child(out_path: str) -> None:
    """Runs under TRITON_INTERPRET=1: launch every case into a NaN-poisoned buffer."""
    assert gather.INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(gather._gather_rows_kernel).__name__}
    for name in CASES:
        x, idx, block_d = _inputs(name)
        out = torch.full((idx.shape[0], x.shape[1]), float("nan"), dtype=x.dtype)   # [N, D] poisoned
        gather.gather_rows_triton(x, idx, out, block_d=block_d)
        results[name] = (x, idx, out)
    x, idx, _ = _inputs("fp16_T37_D24_N13")
    results["dispatch"] = (kernels.use_triton(x, idx), kernels.gather_rows(x, idx))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_gather")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    x, idx, out = interpreted[name]
    T, D, N, dtype, *_ = CASES[name]
    ref = gather.gather_rows_reference(x, idx)            # [N, D]
    assert out.shape == ref.shape == (N, D) and out.dtype == dtype
    assert not torch.isnan(out).any(), "kernel left poisoned (unwritten) elements"
    if N:
        rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
        assert rel == 0.0, f"a gather is a copy; max relative error {rel}"
    assert torch.equal(out, ref)


def test_dispatch_uses_triton_under_interpreter(interpreted):
    used, result = interpreted["dispatch"]
    x, idx, _ = _inputs("fp16_T37_D24_N13")
    assert used is True
    assert torch.equal(result, x[idx.long()])


BAD_ARGS = {
    "x not 2-D": (lambda: (torch.zeros(8), torch.zeros(2, dtype=torch.long), torch.zeros(2, 1)), "x must be"),
    "x column stride 2": (lambda: (torch.zeros(8, 6)[:, ::2], torch.zeros(2, dtype=torch.long), torch.zeros(2, 3)),
                          "unit column stride"),
    "out column stride 2": (lambda: (torch.zeros(8, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2, 6)[:, ::2]),
                            "unit column stride"),
    "out wrong shape": (lambda: (torch.zeros(8, 3), torch.zeros(2, dtype=torch.long), torch.zeros(3, 3)), "out must be"),
    "out wrong dtype": (lambda: (torch.zeros(8, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2, 3).half()),
                        "dtype"),
    "idx float": (lambda: (torch.zeros(8, 3), torch.zeros(2), torch.zeros(2, 3)), "int32 or int64"),
    "idx 2-D": (lambda: (torch.zeros(8, 3), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 3)), "idx must be"),
    "idx strided": (lambda: (torch.zeros(8, 3), torch.zeros(4, dtype=torch.long)[::2], torch.zeros(2, 3)),
                    "contiguous"),
    "x rows overlap": (lambda: (torch.zeros(20).as_strided((4, 3), (2, 1)), torch.zeros(2, dtype=torch.long),
                                torch.zeros(2, 3)), "overlap"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_launcher_rejects_bad_args_before_launch(case):
    make, message = BAD_ARGS[case]
    x, idx, out = make()
    with pytest.raises(AssertionError, match=message):
        gather.gather_rows_triton(x, idx, out)


def test_dispatch_on_cpu_without_interpreter_uses_reference():
    x = torch.randn(9, 4)                   # [T, D]
    idx = torch.tensor([8, 0, 8, 3])        # [N]
    assert kernels.use_triton(x, idx) is gather.INTERPRETED
    assert torch.equal(kernels.gather_rows(x, idx), x[idx])


@pytest.mark.parametrize("bad, first", [([0, 9, 2], 9), ([-1], -1), ([3, 4, 12, 10], 12)])
def test_gather_rows_names_first_out_of_range_index(bad, first):
    with pytest.raises(IndexError, match=f"index {first} out of range for 9 rows"):
        kernels.gather_rows(torch.zeros(9, 2), torch.tensor(bad))


if __name__ == "__main__":
    _child(sys.argv[1])
