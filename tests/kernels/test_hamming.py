"""Hamming distance of packed bit vectors: the Triton kernel (under TRITON_INTERPRET=1) against the
torch reference on odd shapes and both word types, bit packing on a worked example, the
launcher's contract and the dispatch rule.

The kernel runs in a child process started with TRITON_INTERPRET=1 (see `tests.kernels.interp`),
which saves inputs and outputs; the assertions happen here.
"""
from __future__ import annotations

import sys

import pytest
import torch

import kernels
from kernels import hamming
from tests.kernels.interp import interpreted_fixture

# name: (N, H bits, word dtype, block_n, block_w, layout); odd shapes, masked row and word tails
CASES = {
    "int32_N37_H9": (37, 9, torch.int32, 32, None, "contiguous"),
    "int32_N53_H100_two_word_blocks": (53, 100, torch.int32, 16, 2, "contiguous"),
    "uint8_N29_H13": (29, 13, torch.uint8, 32, None, "contiguous"),
    "uint8_N7_H61_word_blocks_of_4": (7, 61, torch.uint8, 4, 4, "contiguous"),
    "int32_sign_bits_N5_H64": (5, 64, torch.int32, 32, None, "all_ones"),
    "int32_row_strided_view": (19, 70, torch.int32, 8, None, "row_stride_5"),
    "uint8_one_row": (1, 3, torch.uint8, 32, None, "contiguous"),
    "int32_no_rows": (0, 40, torch.int32, 32, None, "contiguous"),
}


def _inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (bits [N, H] bool, anchor [H] bool, packed [N, W], packed anchor [W])."""
    N, H, dtype, _, _, layout = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    bits = torch.rand(N, H, generator=g) < 0.5                        # [N, H]
    anchor = torch.rand(H, generator=g) < 0.5                          # [H]
    if layout == "all_ones":
        bits[:] = True
        anchor[::3] = False
    packed = hamming.pack_bits(bits, dtype)                            # [N, W]
    if layout == "row_stride_5":
        wide = torch.zeros(N, 5, dtype=dtype)
        wide[:, 1:1 + packed.shape[1]] = packed
        packed = wide[:, 1:1 + packed.shape[1]]
        assert packed.stride() == (5, 1)
    return bits, anchor, packed, hamming.pack_bits(anchor[None], dtype)[0]


def _child(out_path: str) -> None:
    """Runs under TRITON_INTERPRET=1: launch every case into a poisoned buffer."""
    assert hamming.INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(hamming._hamming_kernel).__name__}
    for name, (N, _, _, block_n, block_w, _) in CASES.items():
        _, _, packed, a = _inputs(name)
        out = torch.full((N,), -7, dtype=torch.int32)                    # [N] poisoned
        hamming.hamming_distance_triton(packed, a, out, block_n=block_n, block_w=block_w)
        results[name] = out
    _, _, packed, a = _inputs("int32_N37_H9")
    results["dispatch"] = (kernels.use_triton(packed, a), kernels.hamming_distance(packed, a))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_hamming")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_bool_count(interpreted, name):
    bits, anchor, packed, a = _inputs(name)
    out = interpreted[name]
    ref = hamming.hamming_distance_reference(packed, a)                  # [N]
    want = (bits ^ anchor[None]).sum(1).to(torch.int32)                 # unpacked truth
    assert out.dtype == ref.dtype == torch.int32 and out.shape == ref.shape == (CASES[name][0],)
    assert not (out == -7).any(), "kernel left poisoned (unwritten) elements"
    assert torch.equal(ref, want)
    assert torch.equal(out, ref)                                        # integer op: exact


def test_dispatch_uses_triton_under_interpreter(interpreted):
    used, result = interpreted["dispatch"]
    bits, anchor, _, _ = _inputs("int32_N37_H9")
    assert used is True
    assert torch.equal(result, (bits ^ anchor[None]).sum(1).to(torch.int32))


def test_pack_bits_worked_example():
    """Bit h -> word h // B at position h % B, least significant first; bit 31 is int32's sign."""
    bits = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 0, 0, 1],       # bits 0, 2, 3, 9
                         [0] * 10], dtype=torch.bool)
    assert hamming.pack_bits(bits, torch.uint8).tolist() == [[1 + 4 + 8, 2], [0, 0]]
    assert hamming.pack_bits(bits, torch.int32).tolist() == [[1 + 4 + 8 + 512], [0]]
    top = torch.zeros(1, 33, dtype=torch.bool)
    top[0, 31] = top[0, 32] = True
    assert hamming.pack_bits(top, torch.int32).tolist() == [[-(1 << 31), 1]]


def test_hamming_worked_example():
    """Anchor 0101 (alternate, index 0 -> 0): 1100 differs in bits 0 and 3 -> 2; 0101 -> 0; 1010 -> 4."""
    rows = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool)
    anchor = torch.tensor([0, 1, 0, 1], dtype=torch.bool)
    for dtype in (torch.uint8, torch.int32):
        d = kernels.hamming_distance(hamming.pack_bits(rows, dtype), hamming.pack_bits(anchor[None], dtype)[0])
        assert d.tolist() == [2, 0, 4] and d.dtype == torch.int32


BAD_ARGS = {
    "bits 1-D": (lambda: (torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                          torch.zeros(4, dtype=torch.int32)), "bits must be"),
    "bits int64": (lambda: (torch.zeros(3, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                            torch.zeros(3, dtype=torch.int32)), "uint8 or int32"),
    "anchor dtype": (lambda: (torch.zeros(3, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.uint8),
                              torch.zeros(3, dtype=torch.int32)), "dtype"),
    "anchor length": (lambda: (torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                               torch.zeros(3, dtype=torch.int32)), "anchor must be"),
    "out dtype": (lambda: (torch.zeros(3, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                           torch.zeros(3, dtype=torch.int64)), "int32"),
    "bits column stride 2": (lambda: (torch.zeros(3, 4, dtype=torch.int32)[:, ::2], torch.zeros(2, dtype=torch.int32),
                                      torch.zeros(3, dtype=torch.int32)), "unit column stride"),
    "out strided": (lambda: (torch.zeros(3, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                             torch.zeros(6, dtype=torch.int32)[::2]), "contiguous"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_launcher_rejects_bad_args_before_launch(case):
    make, message = BAD_ARGS[case]
    bits, anchor, out = make()
    with pytest.raises(AssertionError, match=message):
        hamming.hamming_distance_triton(bits, anchor, out)


def test_dispatch_validates_and_uses_reference_on_cpu():
    bits = hamming.pack_bits(torch.tensor([[True, False, True]]), torch.uint8)
    anchor = torch.zeros(1, dtype=torch.uint8)
    assert kernels.use_triton(bits, anchor) is hamming.INTERPRETED
    assert kernels.hamming_distance(bits, anchor).tolist() == [2]
    with pytest.raises(ValueError, match="anchor must be"):
        kernels.hamming_distance(bits, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="bits must be"):
        kernels.hamming_distance(bits.long(), anchor.long())


if __name__ == "__main__":
    _child(sys.argv[1])
