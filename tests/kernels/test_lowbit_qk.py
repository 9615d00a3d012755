"""Scores of queries against packed low-bit keys (`kernels.lowbit_qk`): the Triton kernel (under
TRITON_INTERPRET=1, in a child process — see `tests.kernels.interp`) and the torch reference
against q · dequant(K)ᵀ built with `kernels.quant`'s dequantizer, a hand-worked example, the
argument errors (the executor's key layout in the pool: tests/executor/presses/test_offload.py)."""
from __future__ import annotations

import sys

import pytest
import torch

import kernels
from kernels import lowbit_qk, quant
from kernels._triton import INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err

# name: (H, R, n, D, g, bits, q dtype, block_r): odd head/row/group counts, a head dim that is
# not a power of two, every bit width, query-row blocks smaller than R
CASES = {
    "fp32_H1_R1_n3_D8_g8_b2": (1, 1, 3, 8, 8, 2, torch.float32, 8),
    "fp32_H3_R6_n5_D24_g16_b1": (3, 6, 5, 24, 16, 1, torch.float32, 4),
    "fp16_H2_R5_n4_D16_g32_b4": (2, 5, 4, 16, 32, 4, torch.float16, 2),
    "bf16_H3_R3_n2_D64_g32_b2": (3, 3, 2, 64, 32, 2, torch.bfloat16, 8),
    "fp32_H2_R9_n7_D12_g12_b2": (2, 9, 7, 12, 12, 2, torch.float32, 8),
    "fp32_no_groups": (2, 3, 0, 8, 8, 2, torch.float32, 8),
}


def _inputs(name: str):
    """q [H, R, D] and keys [H, n·g, D] quantized per channel -> q, codes [H, n, D, B], scale, zero [H, n, D]."""
    h, r, n, d, g, bits, dtype, _ = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q = torch.randn(h, r, d, generator=gen).to(dtype)
    keys = 2 * torch.randn(h, n * g, d, generator=gen) + torch.randn(1, 1, d, generator=gen)   # channel offsets
    codes, scale, zero = quant.quantize_pack_reference(
        keys.view(h, n, g, d).transpose(2, 3).reshape(h * n * d, g), bits, g)
    return q, codes.view(h, n, d, g * bits // 8), scale.view(h, n, d), zero.view(h, n, d), bits


def _dense(q, codes, scale, zero, bits) -> torch.Tensor:
    """q · dequant(K)ᵀ the long way: [H, R, n·g] fp32."""
    h, n, d, b = codes.shape
    g = b * 8 // bits
    k = quant.unpack_dequantize_reference(codes.reshape(-1, b), scale.reshape(-1, 1), zero.reshape(-1, 1), bits, g)
    k = k.view(h, n, d, g).transpose(2, 3).reshape(h, n * g, d)                                # [H, n·g, D]
    return torch.einsum("hrd,hld->hrl", q.float(), k)


def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(lowbit_qk._lowbit_scores_kernel).__name__}
    for name in CASES:
        args = _inputs(name)
        results[name] = lowbit_qk.lowbit_scores_triton(*args, block_r=CASES[name][-1])
    args = _inputs("fp32_H3_R6_n5_D24_g16_b1")
    results["dispatch"] = (kernels.use_triton(args[0]), kernels.lowbit_scores(*args))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_lowbit_qk")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_dense_scores(interpreted, name):
    h, r, n, d, g, *_ = CASES[name]
    args = _inputs(name)
    ref = lowbit_qk.lowbit_scores_reference(*args)
    assert ref.shape == (h, r, n * g) and ref.dtype == torch.float32
    assert rel_err(ref, _dense(*args)) <= 1e-5
    got = interpreted[name]
    assert got.shape == ref.shape and not got.isnan().any()
    assert rel_err(got, ref) <= 1e-5


def test_dispatch_uses_triton_under_interpreter(interpreted):
    used, got = interpreted["dispatch"]
    assert used is True
    assert rel_err(got, lowbit_qk.lowbit_scores_reference(*_inputs("fp32_H3_R6_n5_D24_g16_b1"))) <= 1e-5


def test_worked_example_two_bits():
    """H=1, D=2, one group of g=4 tokens at 2 bits. Channel 0: codes 0,1,2,3, scale 0.5, zero -1
    -> keys -1, -0.5, 0, 0.5; channel 1: codes 3,3,0,1, scale 2, zero 1 -> 7, 7, 1, 3. Packed
    little end first: channel 0 byte 0b11_10_01_00 = 228, channel 1 0b01_00_11_11 = 79.
    q = (2, 1): scores 2·k0 + k1 = 5, 6, 1, 4."""
    codes = torch.tensor([[[[228], [79]]]], dtype=torch.uint8)                     # [1, 1, 2, 1]
    scale = torch.tensor([[[0.5, 2.0]]], dtype=torch.float16)                       # [1, 1, 2]
    zero = torch.tensor([[[-1.0, 1.0]]], dtype=torch.float16)
    q = torch.tensor([[[2.0, 1.0]]])                                               # [1, 1, 2]
    expect = torch.tensor([[[5.0, 6.0, 1.0, 4.0]]])
    assert torch.equal(lowbit_qk.lowbit_scores_reference(q, codes, scale, zero, 2), expect)
    assert torch.equal(kernels.lowbit_scores(q, codes, scale, zero, 2), expect)


@pytest.mark.parametrize("case, match", [
    (dict(bits=3), "bits"),
    (dict(q=torch.zeros(2, 3, 8, dtype=torch.int32)), "q must be"),
    (dict(codes=torch.zeros(2, 1, 8, 2, dtype=torch.int8)), "k_codes"),
    (dict(codes=torch.zeros(2, 1, 4, 2, dtype=torch.uint8)), "k_codes"),
    (dict(scale=torch.zeros(2, 1, 8, dtype=torch.float32)), "k_scale"),
    (dict(zero=torch.zeros(2, 2, 8, dtype=torch.float16)), "k_zero"),
])
def test_bad_arguments_are_value_errors_naming_the_argument(case, match):
    args = dict(q=torch.zeros(2, 3, 8), codes=torch.zeros(2, 1, 8, 2, dtype=torch.uint8),
                scale=torch.zeros(2, 1, 8, dtype=torch.float16), zero=torch.zeros(2, 1, 8, dtype=torch.float16), bits=2)
    args.update(case)
    with pytest.raises(ValueError, match=match):
        kernels.lowbit_scores(args["q"], args["codes"], args["scale"], args["zero"], args["bits"])


def test_dispatch_on_cpu_without_interpreter_uses_reference():
    if INTERPRETED:
        pytest.skip("this process runs the interpreter")
    args = _inputs("fp32_H2_R9_n7_D12_g12_b2")
    assert kernels.use_triton(args[0]) is False
    assert torch.equal(kernels.lowbit_scores(*args), lowbit_qk.lowbit_scores_reference(*args))


if __name__ == "__main__":
    _child(sys.argv[1])
