"""SLERP merge and restore (MiniCache): the Triton kernels (under TRITON_INTERPRET=1) against the
torch references on odd shapes, the end points t=0 / t=1, unit directions, norm preservation,
zero and near-parallel rows, the launchers' contracts and the dispatch rule.

The kernels run in a child process started with TRITON_INTERPRET=1 (see `tests.kernels.interp`),
which saves inputs and outputs; the assertions happen here.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

import kernels
from kernels import slerp
from tests.kernels.interp import interpreted_fixture, rel_err

# name: (N, D, in dtype, out dtype, t, block_d, layout); odd shapes, masked row and column tails
CASES = {
    "fp32_N37_D24_t06": (37, 24, torch.float32, torch.float32, 0.6, None, "contiguous"),
    "fp16_N19_D37_three_col_blocks": (19, 37, torch.float16, torch.float32, 0.6, 16, "contiguous"),
    "fp16_out_fp16_N5_D7": (5, 7, torch.float16, torch.float16, 0.3, None, "contiguous"),
    "bf16_N23_D48_t05": (23, 48, torch.bfloat16, torch.float32, 0.5, 16, "contiguous"),
    "fp32_row_strided_view": (17, 24, torch.float32, torch.float32, 0.6, None, "row_stride_40"),
    "fp32_t0": (9, 13, torch.float32, torch.float32, 0.0, None, "contiguous"),
    "fp32_t1": (9, 13, torch.float32, torch.float32, 1.0, None, "contiguous"),
    "fp32_special_rows": (6, 11, torch.float32, torch.float32, 0.6, None, "special"),
    "fp32_no_rows": (0, 8, torch.float32, torch.float32, 0.6, None, "contiguous"),
}


def _inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x0, x1: [N, D]; the second layer is the first plus noise (adjacent layers are alike)."""
    N, D, dtype, _, _, _, layout = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if layout == "row_stride_40":
        base = torch.randn(N, 40, generator=g)
        x0, x1 = base[:, 3:3 + D], (base + 0.5 * torch.randn(N, 40, generator=g))[:, 3:3 + D]
        assert x0.stride() == (40, 1)
        return x0.to(dtype), x1.to(dtype)
    x0 = torch.randn(N, D, generator=g) * 3
    x1 = x0 + torch.randn(N, D, generator=g)
    if layout == "special":
        x1[0] = 2.5 * x0[0]                  # parallel: sinΩ = 0, lerp fallback
        x1[1] = x0[1] + 1e-5 * x0[1].roll(1)  # near-parallel
        x1[2] = -x0[2]                       # antipodal
        x0[3] = 0.0                          # one zero row: the partner's direction
        x0[4] = x1[4] = 0.0                  # two zero rows: zero direction
    return x0.to(dtype), x1.to(dtype)


def _mags(name: str) -> torch.Tensor:
    N = CASES[name][0]
    return (torch.rand(N, generator=torch.Generator().manual_seed(N)) * 20).to(CASES[name][3])   # [N]


def _child(out_path: str) -> None:
    """Runs under TRITON_INTERPRET=1: launch every case into NaN-poisoned buffers."""
    assert slerp.INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(slerp._slerp_merge_kernel).__name__}
    for name, (N, D, _, out_dtype, t, block_d, _) in CASES.items():
        x0, x1 = _inputs(name)
        out = (torch.full((N, D), float("nan"), dtype=out_dtype), torch.full((N,), float("nan"), dtype=out_dtype),
               torch.full((N,), float("nan"), dtype=out_dtype), torch.full((N,), float("nan")))
        slerp.slerp_merge_triton(x0, x1, t, out=out, block_d=block_d)
        restored = torch.full((N, D), float("nan"), dtype=out_dtype)                # [N, D] poisoned
        slerp.slerp_restore_triton(out[0], _mags(name), out=restored, block_d=block_d)
        results[name] = (out, restored)
    x0, x1 = _inputs("fp32_N37_D24_t06")
    results["dispatch"] = (kernels.use_triton(x0, x1), kernels.slerp_merge(x0, x1, 0.6))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_slerp")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_merge_kernel_matches_reference(interpreted, name):
    (direction, mag0, mag1, angle), _ = interpreted[name]
    N, D, _, out_dtype, t, _, _ = CASES[name]
    x0, x1 = _inputs(name)
    ref = slerp.slerp_merge_reference(x0, x1, t, out_dtype)
    assert direction.shape == (N, D) and direction.dtype == out_dtype and angle.dtype == torch.float32
    for got in (direction, mag0, mag1, angle):
        assert not torch.isnan(got).any(), "kernel left poisoned (unwritten) elements"
    tol = 1e-3 if out_dtype == torch.float16 else 2e-5
    assert rel_err(direction, ref[0]) <= tol
    assert rel_err(mag0, ref[1]) <= tol and rel_err(mag1, ref[2]) <= tol
    # Ω near 0 is ill-conditioned in cos; compare cos Ω (the kernel's arccos is a polynomial)
    assert (angle.cos() - ref[3].cos()).abs().max().item() <= 1e-5 if N else True


@pytest.mark.parametrize("name", list(CASES))
def test_restore_kernel_matches_reference_and_keeps_the_magnitude(interpreted, name):
    (direction, *_), restored = interpreted[name]
    ref = slerp.slerp_restore_reference(direction, _mags(name), restored.dtype)
    assert not torch.isnan(restored).any()
    assert rel_err(restored, ref) <= (1e-3 if restored.dtype == torch.float16 else 1e-6)
    live = direction.float().norm(dim=1) > 0.5                                  # zero directions restore to 0
    torch.testing.assert_close(restored.float().norm(dim=1)[live], _mags(name).float()[live], rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["fp32_t0", "fp32_t1"])
def test_kernel_end_points_are_the_two_layers_directions(interpreted, name):
    (direction, *_), _ = interpreted[name]
    x0, x1 = _inputs(name)
    end = x0 if CASES[name][4] == 0.0 else x1
    torch.testing.assert_close(direction, end / end.norm(dim=1, keepdim=True), rtol=1e-5, atol=1e-6)


def test_kernel_special_rows(interpreted):
    (direction, mag0, mag1, angle), _ = interpreted["fp32_special_rows"]
    x0, x1 = _inputs("fp32_special_rows")
    u0 = x0 / x0.norm(dim=1, keepdim=True)
    torch.testing.assert_close(direction[0], u0[0], rtol=1e-5, atol=1e-6)       # parallel: lerp of equals
    torch.testing.assert_close(direction[1], u0[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(direction[2], -u0[2], rtol=1e-5, atol=1e-6)      # antipodal, t=0.6: lerp -> u1
    assert angle[2].item() == pytest.approx(math.pi, abs=1e-3)
    torch.testing.assert_close(direction[3], x1[3] / x1[3].norm(), rtol=1e-5, atol=1e-6)
    assert mag0[3] == 0 and mag0[4] == mag1[4] == 0 and direction[4].abs().max() == 0


def test_dispatch_uses_triton_under_interpreter(interpreted):
    used, (direction, *_) = interpreted["dispatch"]
    x0, x1 = _inputs("fp32_N37_D24_t06")
    assert used is True
    assert rel_err(direction, slerp.slerp_merge_reference(x0, x1, 0.6)[0]) <= 2e-5


# -- reference semantics (CPU, no interpreter) ---------------------------------------------------

def test_end_points_unit_directions_and_norm_preservation_through_fp16():
    g = torch.Generator().manual_seed(3)
    x0, x1 = torch.randn(41, 33, generator=g) * 4, torch.randn(41, 33, generator=g)     # [N, D]
    u0, u1 = x0 / x0.norm(dim=1, keepdim=True), x1 / x1.norm(dim=1, keepdim=True)
    torch.testing.assert_close(kernels.slerp_merge(x0, x1, 0.0)[0], u0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels.slerp_merge(x0, x1, 1.0)[0], u1, rtol=1e-5, atol=1e-6)
    e, m0, m1, omega = kernels.slerp_merge(x0, x1, 0.6, torch.float16)                   # stored form
    torch.testing.assert_close(e.float().norm(dim=1), torch.ones(41), rtol=2e-3, atol=2e-3)
    # SLERP stays on the great circle: the angle to u0 is t·Ω, to u1 (1-t)·Ω
    e32 = kernels.slerp_merge(x0, x1, 0.6)[0]
    torch.testing.assert_close(torch.acos((e32 * u0).sum(1).clamp(-1, 1)), 0.6 * omega, rtol=1e-4, atol=1e-4)
    for mag, x in ((m0, x0), (m1, x1)):
        back = kernels.slerp_restore(e, mag)                                             # [N, D] fp32
        # the restored norm is the stored fp16 magnitude (exactly, up to fp32), i.e. ‖x‖ up to fp16
        torch.testing.assert_close(back.norm(dim=1), mag.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(back.norm(dim=1), x.norm(dim=1), rtol=1e-3, atol=0)


def test_reference_special_rows():
    x0, x1 = _inputs("fp32_special_rows")
    e, m0, m1, omega = kernels.slerp_merge(x0, x1, 0.6)
    assert torch.isfinite(e).all() and torch.isfinite(omega).all()
    assert m0[4] == m1[4] == 0 and e[4].abs().max() == 0
    assert kernels.slerp_restore(e[4:5], torch.tensor([3.0])).abs().max() == 0


BAD_ARGS = {
    "shape mismatch": (lambda: (torch.zeros(4, 3), torch.zeros(4, 2)), "one shape"),
    "int rows": (lambda: (torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, 3, dtype=torch.int32)), "fp16/bf16/fp32"),
    "x column stride": (lambda: (torch.zeros(3, 4).T, torch.zeros(4, 3)), "unit column stride"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_merge_launcher_rejects_bad_args_before_launch(case):
    make, message = BAD_ARGS[case]
    x0, x1 = make()
    with pytest.raises(AssertionError, match=message):
        slerp.slerp_merge_triton(x0, x1, 0.6)


def test_restore_launcher_rejects_bad_args_before_launch():
    with pytest.raises(AssertionError, match=r"mag must be"):
        slerp.slerp_restore_triton(torch.zeros(4, 3), torch.zeros(5))
    with pytest.raises(AssertionError, match=r"mag must be contiguous"):
        slerp.slerp_restore_triton(torch.zeros(4, 3), torch.zeros(8)[::2])


def test_dispatch_validates_and_uses_the_reference_on_cpu():
    x = torch.randn(5, 4)
    assert kernels.use_triton(x) is slerp.INTERPRETED
    with pytest.raises(ValueError, match="t must be in"):
        kernels.slerp_merge(x, x, 1.5)
    with pytest.raises(ValueError, match="one shape"):
        kernels.slerp_merge(x, x[:3], 0.6)
    with pytest.raises(ValueError, match="mag must be"):
        kernels.slerp_restore(x, torch.ones(4))
    got = kernels.slerp_merge(x.T.contiguous().T, x, 0.6)        # column-strided input: handled
    torch.testing.assert_close(got[0], x / x.norm(dim=1, keepdim=True))


if __name__ == "__main__":
    _child(sys.argv[1])
