"""Group-wise quantize + pack / unpack + dequantize: the Triton kernels (under TRITON_INTERPRET=1)
against the torch references, worked examples of the packing layout, the round-trip error
bound, the launchers' contract and the dispatch functions' argument errors.

The kernels run in a child process started with TRITON_INTERPRET=1 (see `tests.kernels.interp`),
which saves inputs and outputs; the assertions happen here.
"""
from __future__ import annotations

import sys

import pytest
import torch

import kernels
from kernels import quant
from kernels._triton import INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err

# name: (N, L, bits, group_size, x dtype, layout, block_n); odd row counts, groups whose byte
# count is not a power of two (masked byte tails), every bit width
CASES = {
    "fp32_N7_L24_b1_g8": (7, 24, 1, 8, torch.float32, "contiguous", 16),
    "fp32_N7_L24_b2_g12": (7, 24, 2, 12, torch.float32, "contiguous", 4),
    "fp16_N13_L40_b4_g10": (13, 40, 4, 10, torch.float16, "contiguous", 16),
    "fp16_N5_L48_b8_g24": (5, 48, 8, 24, torch.float16, "contiguous", 2),
    "bf16_N3_L32_b4_g32": (3, 32, 4, 32, torch.bfloat16, "contiguous", 16),
    "fp32_row_strided_b2_g16": (9, 32, 2, 16, torch.float32, "row_stride_45", 8),
    "fp32_one_row_b8_g8": (1, 8, 8, 8, torch.float32, "contiguous", 16),
    "fp32_no_rows_b4_g8": (0, 16, 4, 8, torch.float32, "contiguous", 16),
    "fp16_N7_L24_b1_g8_midpoint": (7, 24, 1, 8, torch.float16, "contiguous", 4),    # SpeCache's 1-bit levels
    "fp32_N5_L64_b1_g32_midpoint": (5, 64, 1, 32, torch.float32, "contiguous", 16),
    "fp32_N7_L24_b2_g12_refine3": (7, 24, 2, 12, torch.float32, "contiguous", 4),     # least-squares refits
    "fp16_N6_L40_b4_g10_refine1": (6, 40, 4, 10, torch.float16, "contiguous", 16),
    "fp32_N9_L64_b1_g32_midpoint_refine3": (9, 64, 1, 32, torch.float32, "row_stride_45", 8),
}
MIDPOINT = {name for name in CASES if "_midpoint" in name}
REFINE = {name: int(name.rsplit("_refine", 1)[1]) for name in CASES if "_refine" in name}
OUT_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _inputs(name: str) -> tuple[torch.Tensor, int, int, int]:
    n, L, bits, g, dtype, layout, block_n = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if layout == "row_stride_45":
        x = (3 * torch.randn(n, 45 + L, generator=gen) + 1).to(dtype)[:, 7:7 + L]   # [N, L], rows 45 + L apart
        assert x.stride() == (45 + L, 1)
    else:
        x = (3 * torch.randn(n, L, generator=gen) + 1).to(dtype)                # [N, L]
    if n > 1:
        x[1, :g] = 0.5                                                           # a constant group: scale 0
    return x, bits, g, block_n


def _child(out_path: str) -> None:
    """Runs under TRITON_INTERPRET=1: every case into poisoned buffers (NaN scales/zeros/output,
    0xA5 codes)."""
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(quant._quantize_pack_kernel).__name__}
    for name in CASES:
        x, bits, g, block_n = _inputs(name)
        n, L = x.shape
        out = (torch.full((n, L * bits // 8), 0xA5, dtype=torch.uint8),
               torch.full((n, L // g), float("nan"), dtype=torch.float16),
               torch.full((n, L // g), float("nan"), dtype=torch.float16))
        codes, scale, zero = quant.quantize_pack_triton(x, bits, g, out=out, block_n=block_n, midpoint=name in MIDPOINT,
                                                        refine=REFINE.get(name, 0))
        back = torch.full((n, L), float("nan"), dtype=x.dtype)
        quant.unpack_dequantize_triton(codes, scale, zero, bits, g, out=back, block_n=block_n)
        results[name] = (x, codes, scale, zero, back)
    x, bits, g, _ = _inputs("fp16_N13_L40_b4_g10")
    packed = kernels.quantize_pack(x, bits, g)
    results["dispatch"] = (kernels.use_triton(x), packed, kernels.unpack_dequantize(*packed, bits, g))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_quant")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(interpreted, name):
    x, codes, scale, zero, back = interpreted[name]
    n, L, bits, g, dtype, *_ = CASES[name]
    ref_codes, ref_scale, ref_zero = quant.quantize_pack_reference(x, bits, g, midpoint=name in MIDPOINT,
                                                                   refine=REFINE.get(name, 0))
    assert codes.shape == ref_codes.shape == (n, L * bits // 8) and codes.dtype == torch.uint8
    assert scale.shape == zero.shape == (n, L // g) and scale.dtype == zero.dtype == torch.float16
    assert not scale.isnan().any() and not zero.isnan().any(), "kernel left poisoned scales/zeros"
    assert torch.equal(scale, ref_scale) and torch.equal(zero, ref_zero)
    assert torch.equal(codes, ref_codes)
    ref_back = quant.unpack_dequantize_reference(ref_codes, ref_scale, ref_zero, bits, g, dtype)
    assert back.dtype == dtype and not back.isnan().any(), "kernel left poisoned output"
    assert rel_err(back, ref_back) <= OUT_TOL[dtype]      # the interpreter's bf16 cast truncates


def test_dispatch_uses_triton_under_interpreter(interpreted):
    used, (codes, scale, zero), back = interpreted["dispatch"]
    x, bits, g, _ = _inputs("fp16_N13_L40_b4_g10")
    assert used is True
    ref = quant.quantize_pack_reference(x, bits, g)
    assert torch.equal(codes, ref[0]) and torch.equal(scale, ref[1]) and torch.equal(zero, ref[2])
    assert back.dtype == torch.float32 and rel_err(back, quant.unpack_dequantize_reference(*ref, bits, g)) <= 1e-6


# -- the form itself (references; what the kernels were checked against above) ---------------------

def test_worked_example_one_bit_midpoint_levels():
    """Group [0, 1, 2, 3, 0, 1, 2, 3] at 1 bit: plain KIVI reconstructs 0 and 3 (the ends); the
    midpoint form reconstructs the centres of the half-ranges, 0.75 and 2.25, and x = max keeps
    code 1 (its (x - zero) / scale is 1.5, which rounds to 2 without the clamp)."""
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0] * 2 + [5.0] * 8])                  # two groups of 8 (one constant)
    codes, scale, zero = kernels.quantize_pack(x, 1, 8, midpoint=True)
    assert scale.tolist() == [[1.5, 0.0]] and zero.tolist() == [[0.75, 5.0]]
    back = kernels.unpack_dequantize(codes, scale, zero, 1, 8)
    assert back.tolist() == [[0.75, 0.75, 2.25, 2.25] * 2 + [5.0] * 8]
    plain = kernels.unpack_dequantize(*kernels.quantize_pack(x, 1, 8), 1, 8)
    assert plain[0, :4].tolist() == [0.0, 0.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="1-bit only"):
        kernels.quantize_pack(x, 2, 8, midpoint=True)


def test_midpoint_halves_the_one_bit_error_on_uniform_data():
    x = torch.rand(64, 256, generator=torch.Generator().manual_seed(0))
    err = lambda mid: (kernels.unpack_dequantize(*kernels.quantize_pack(x, 1, 32, midpoint=mid), 1, 32) - x).abs().mean()
    assert err(True) < 0.6 * err(False)          # uniform on [0, 1): 1/8 vs 1/4 expected


def test_worked_example_one_bit_refit_moves_the_levels_to_the_codes_means():
    """Group [0, 0, 0, 2, 2, 2, 7, 9] at 1 bit: the midpoint levels are 2.25 and 6.75 (codes
    0 0 0 0 0 0 1 1, squared error 20.5); one least-squares refit puts them at the means of
    what each code holds, 1 and 8 (scale 7, zero 1; squared error 8), and a second refit
    changes nothing (the codes stay put)."""
    x = torch.tensor([[0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 7.0, 9.0]])
    codes, scale, zero = kernels.quantize_pack(x, 1, 8, midpoint=True, refine=1)
    assert scale.tolist() == [[7.0]] and zero.tolist() == [[1.0]]
    assert kernels.unpack_dequantize(codes, scale, zero, 1, 8).tolist() == [[1.0] * 6 + [8.0] * 2]
    again = kernels.quantize_pack(x, 1, 8, midpoint=True, refine=2)
    assert all(torch.equal(a, b) for a, b in zip(again, (codes, scale, zero)))
    before = kernels.unpack_dequantize(*kernels.quantize_pack(x, 1, 8, midpoint=True), 1, 8)
    assert ((before - x) ** 2).sum().item() == 20.5


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_refits_lower_the_error_on_heavy_tailed_groups(bits):
    """Student-t rows (outliers stretch min / max): the refit never loses more than fp16 rounding
    on any group and cuts the mean squared error clearly; constant groups stay exact."""
    gen = torch.Generator().manual_seed(bits)
    x = _student_t(gen, (256, 64))
    x[0] = 1.25                                                                  # two constant groups
    mid = bits == 1
    err = lambda r: ((kernels.unpack_dequantize(*kernels.quantize_pack(x, bits, 32, midpoint=mid, refine=r), bits, 32)
                      - x) ** 2).view(256, 2, 32).sum(-1)                         # [N, G] squared error per group
    e0, e3 = err(0), err(3)
    assert (e3 <= e0 * (1 + 1e-2) + 1e-5).all()
    assert e3.mean() < 0.9 * e0.mean()
    assert e3[0].tolist() == [0.0, 0.0]


def _student_t(gen: torch.Generator, shape: tuple[int, int], df: int = 3) -> torch.Tensor:
    """t-distributed samples from normals (torch's own sampler takes no generator)."""
    z = torch.randn(*shape, generator=gen)
    chi2 = (torch.randn(*shape, df, generator=gen) ** 2).sum(-1)
    return z / (chi2 / df).sqrt()


def test_refine_argument_errors():
    x = torch.randn(2, 8)
    for bad in (-1, quant.MAX_REFINE + 1, 1.5, True):
        with pytest.raises(ValueError, match="refine"):
            kernels.quantize_pack(x, 2, 8, refine=bad)


def test_worked_example_two_bits_reconstructs_a_ramp_exactly():
    """[0, 1, 2, 3] at 2 bits: scale (3 - 0) / 3 = 1, zero 0, codes 0..3 packed little end first
    into one byte 0b11_10_01_00 = 228; a second group [10, 10, 10, 10] is constant: scale 0."""
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 10.0]])       # [1, 8], g = 4
    codes, scale, zero = kernels.quantize_pack(x, 2, 4)
    assert codes.tolist() == [[0b11100100, 0]]
    assert scale.tolist() == [[1.0, 0.0]] and zero.tolist() == [[0.0, 10.0]]
    assert torch.equal(kernels.unpack_dequantize(codes, scale, zero, 2, 4), x)


@pytest.mark.parametrize("bits, values, packed", [
    (1, [0, 1, 0, 1, 1, 1, 0, 0], [0b00111010]),                      # value j at bit j
    (2, [3, 0, 2, 1, 0, 0, 0, 3], [0b01100011, 0b11000000]),          # value j at bits 2j..2j+1
    (4, list(range(16)), [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]),   # low nibble first
    (8, [7, 200, 0, 255], [7, 200, 0, 255]),
])
def test_packing_layout(bits, values, packed):
    """Integer codes 0..2^bits-1 with both ends present in the group (scale 1, zero 0) are their
    own codes: value j of a row lands in byte j // P at bit (j % P) * bits."""
    x = torch.tensor([values], dtype=torch.float32)                     # [1, L], one group
    codes, scale, zero = kernels.quantize_pack(x, bits, len(values))
    levels = (1 << bits) - 1
    assert scale.item() == (max(values) - min(values)) / levels == 1.0 and zero.item() == 0.0
    assert codes.tolist() == [packed]
    assert torch.equal(kernels.unpack_dequantize(codes, scale, zero, bits, len(values)), x)


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_round_trip_error_is_at_most_half_a_step(bits, dtype):
    """|x' - x| <= scale / 2 per element, up to the fp16 rounding of the group's min (|zero| 2^-11)."""
    gen = torch.Generator().manual_seed(bits)
    n, L, g = 37, 96, 32
    x = (torch.randn(n, L, generator=gen) * torch.rand(n, 1, generator=gen) * 8 + 2).to(dtype)
    codes, scale, zero = kernels.quantize_pack(x, bits, g)
    back = kernels.unpack_dequantize(codes, scale, zero, bits, g)       # [N, L] fp32
    bound = (scale.float() / 2 + zero.float().abs() * 2 ** -11 + 1e-6).repeat_interleave(g, dim=1)
    assert ((back - x.float()).abs() <= bound).all()
    assert codes.shape == (n, L * bits // 8)
    per_group = x.float().view(n, L // g, g)
    torch.testing.assert_close(scale.float(), (per_group.amax(-1) - per_group.amin(-1)) / ((1 << bits) - 1),
                               rtol=1e-3, atol=1e-7)


def test_reference_has_no_python_loop_over_rows():
    """A long input runs in one vectorized pass (a per-row loop would take seconds here)."""
    import time
    x = torch.randn(20000, 64)
    t0 = time.perf_counter()
    back = kernels.unpack_dequantize(*kernels.quantize_pack(x, 4, 32), 4, 32)
    assert time.perf_counter() - t0 < 2.0 and back.shape == x.shape


# -- argument errors ------------------------------------------------------------------------------
QUANTIZE_ERRORS = {
    "bits 3": (lambda: (torch.zeros(2, 8), 3, 8), "bits must be one of"),
    "bits 16": (lambda: (torch.zeros(2, 8), 16, 8), "bits must be one of"),
    "group not a byte multiple": (lambda: (torch.zeros(2, 12), 2, 6), "multiple of 4"),
    "group zero": (lambda: (torch.zeros(2, 8), 8, 0), "positive multiple"),
    "L not groups": (lambda: (torch.zeros(2, 12), 4, 8), "multiple of group_size 8"),
    "x 1-D": (lambda: (torch.zeros(8), 4, 8), "x must be"),
    "x integer": (lambda: (torch.zeros(2, 8, dtype=torch.int32), 4, 8), "x must be"),
}


@pytest.mark.parametrize("case", list(QUANTIZE_ERRORS))
def test_quantize_pack_rejects_bad_args(case):
    make, message = QUANTIZE_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        kernels.quantize_pack(*make())


def _packed(n=3, L=16, bits=4, g=8):
    return kernels.quantize_pack(torch.randn(n, L), bits, g)


DEQUANT_ERRORS = {
    "codes float": (lambda: (_packed()[0].float(), *_packed()[1:], 4, 8), "codes must be a uint8"),
    "codes 1-D": (lambda: (_packed()[0][0], *_packed()[1:], 4, 8), "codes must be a uint8"),
    "scale fp32": (lambda: (_packed()[0], _packed()[1].float(), _packed()[2], 4, 8), "scale must be fp16"),
    "zero wrong groups": (lambda: (*_packed()[:2], _packed()[2][:, :1], 4, 8),
                          r"zero must be fp16 \[N, L / group_size\]"),
    "group_size mismatch": (lambda: (*_packed(), 4, 16), "scale must be"),
    "L not groups": (lambda: (*_packed(), 4, 24), "not a multiple of group_size 24"),
    "bits 5": (lambda: (*_packed(), 5, 8), "bits must be one of"),
}


@pytest.mark.parametrize("case", list(DEQUANT_ERRORS))
def test_unpack_dequantize_rejects_bad_args(case):
    make, message = DEQUANT_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        kernels.unpack_dequantize(*make())


def test_unpack_dequantize_rejects_an_integer_out_dtype():
    with pytest.raises(ValueError, match="out_dtype"):
        kernels.unpack_dequantize(*_packed(), 4, 8, out_dtype=torch.int32)


LAUNCHER_ERRORS = {
    "x column stride 2": (lambda: torch.zeros(4, 32)[:, ::2], "unit column stride"),
    "x rows overlap": (lambda: torch.zeros(40).as_strided((4, 16), (8, 1)), "overlap"),
}


@pytest.mark.parametrize("case", list(LAUNCHER_ERRORS))
def test_launchers_reject_bad_layouts_before_launch(case):
    make, message = LAUNCHER_ERRORS[case]
    x = make()
    with pytest.raises(AssertionError, match=message):
        quant.quantize_pack_triton(x, 4, 8)
    codes, scale, zero = quant.quantize_pack_reference(torch.zeros(4, 16), 4, 8)
    with pytest.raises(AssertionError, match=message):
        quant.unpack_dequantize_triton(codes, scale, zero, 4, 8, out=x)


def test_launcher_checks_buffer_shapes():
    x = torch.zeros(4, 16)
    codes, scale, zero = quant.quantize_pack_reference(x, 4, 8)
    with pytest.raises(AssertionError, match="codes must be uint8"):
        quant.quantize_pack_triton(x, 4, 8, out=(codes[:, :4], scale, zero))
    with pytest.raises(AssertionError, match="zero must be fp16"):
        quant.quantize_pack_triton(x, 4, 8, out=(codes, scale, zero.float()))
    with pytest.raises(AssertionError, match="multiple of 4"):
        quant.quantize_pack_triton(x, 2, 2)


def test_dispatch_on_cpu_without_interpreter_uses_reference():
    x = torch.randn(5, 32)
    assert kernels.use_triton(x) is INTERPRETED
    got = kernels.quantize_pack(x, 2, 32)
    ref = quant.quantize_pack_reference(x, 2, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


if __name__ == "__main__":
    _child(sys.argv[1])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_dequantize_is_unpack_of_pack_without_the_codes(bits, dtype):
    """The plan statistics' storage-form loss quantizes without packing: bit for bit what the
    packed round trip gives (constant groups included: scale 0)."""
    from kernels.quant import dequantized_at, group_ranges
    torch.manual_seed(bits)
    x = (torch.randn(24, 96) * 3).to(dtype)
    x[3] = 1.5                                                   # a constant row: scale 0, code 0
    got = dequantized_at(*group_ranges(x, 32), bits)
    want = quant.unpack_dequantize_reference(*quant.quantize_pack_reference(x, bits, 32), bits, 32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_cpu_loop_quantizes_bit_for_bit_as_the_reference(bits, dtype):
    """`quantize_pack_cpu` (C++) against the reference: the same codes, scales and zeros, with
    constant groups (scale 0), a row that is a view of a wider tensor and odd row counts."""
    if not quant.quantize_pack_cpu_handles(torch.empty(1, 1)):
        pytest.skip("the C++ kernels could not be built here: the reference serves")
    gen = torch.Generator().manual_seed(bits)
    for n, g in ((1, 8), (37, 32), (5, 64)):
        x = (torch.randn(n, 4 * g + 8, generator=gen) * 3).to(dtype)[:, :4 * g]       # rows strided
        x[0, :g] = 1.5                                                                # a constant group
        got = quant.quantize_pack_cpu(x, bits, g)
        want = quant.quantize_pack_reference(x, bits, g)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (n, g)
    xt = (torch.randn(64, 32, generator=gen) * 2).to(dtype).T                         # [32, 64], element stride 32
    for a, b in zip(quant.quantize_pack_cpu(xt, bits, 32), quant.quantize_pack_reference(xt, bits, 32)):
        assert torch.equal(a, b)


def test_every_width_in_one_pass_matches_quantizing_at_each():
    """`dequantized_forms` (C++, the storage-form losses) against `dequantized_at` per bit width:
    a transposed view read in place, only the first whole groups of the first rows quantized."""
    if not quant.quantize_pack_cpu_handles(torch.empty(1, 1)):
        pytest.skip("the C++ kernels could not be built here: the reference serves")
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(100, 24, generator=gen) * 3).T                          # [24, 100], element stride 24
    got = quant.dequantized_forms(x, [8, 4, 2], 32, 96, 20)                  # 3 groups of the first 20 rows
    for bits, out in zip((8, 4, 2), got):
        want = x.clone()
        want[:20, :96] = quant.dequantized_at(*quant.group_ranges(x[:20, :96].contiguous(), 32), bits).view(20, 96)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[20:], x[20:]) and torch.equal(out[:, 96:], x[:, 96:])   # the rest exact


def test_every_width_in_one_pass_takes_a_batch_of_row_sets():
    """A batch [B, R, L] (the KV heads of a layer, a transposed view read in place) gives what each
    row set gives alone."""
    if not quant.quantize_pack_cpu_handles(torch.empty(1, 1)):
        pytest.skip("the C++ kernels could not be built here: the reference serves")
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 100, 24, generator=gen) * 3).transpose(1, 2)               # [3, 24, 100] strided
    got = quant.dequantized_forms(x, [8, 2], 32, 96, 20)
    for b in range(3):
        for out, alone in zip(got, quant.dequantized_forms(x[b], [8, 2], 32, 96, 20)):
            assert out.shape == (3, 24, 100) and torch.equal(out[b], alone)
