"""MiniCache's SLERP merge of two layers' rows and its restoration (spec minicache.md §2.3, §2.6).

merge:   for each row n, with u0 = x0/‖x0‖, u1 = x1/‖x1‖, Ω = arccos(u0·u1) in [0, π]:
           e = sin((1-t)Ω)/sinΩ · u0 + sin(tΩ)/sinΩ · u1, normalised   (Eq. 3; t=0 -> u0, t=1 -> u1)
         -> direction e [N, D] (unit rows), mag0 = ‖x0‖ [N], mag1 = ‖x1‖ [N], angle Ω [N] (fp32).
restore: out = direction · mag / ‖direction‖                          (Eq. 2)

Numerics (fp32 throughout): norms are clamped at EPS, so a zero row has a zero unit vector (its
partner's direction then wins, and a pair of zero rows merges to a zero direction, restored as
zeros). When sinΩ <= SIN_EPS (near-parallel or antipodal rows) the weights fall back to linear
interpolation (1-t, t), then normalise. Antipodal rows at t = 0.5 have no direction at all: the
retention rule is what keeps such rows exact. The Triton kernel computes arccos with Abramowitz &
Stegun 4.4.46 (|error| <= 2.2e-8; the interpreter has no libdevice), the reference with torch.acos.

Three pieces as for every kernel here: Triton kernels, launchers that check the contract, and
plain-torch references; `kernels.dispatch.slerp_merge` / `slerp_restore` choose between them.
"""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, INTERPRETED, pow2_at_least, require_triton, tl, triton  # noqa: F401

EPS = 1e-6            # norm clamp
SIN_EPS = 1e-4        # below this sinΩ, normalised lerp replaces SLERP
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_D = 256

if HAS_TRITON:

    @triton.jit
    def _acos(x):
        """arccos on [-1, 1] (Abramowitz & Stegun 4.4.46)."""
        ax = tl.abs(x)
        p = -0.0012624911
        p = p * ax + 0.0066700901
        p = p * ax - 0.0170881256
        p = p * ax + 0.0308918810
        p = p * ax - 0.0501743046
        p = p * ax + 0.0889789874
        p = p * ax - 0.2145988016
        p = p * ax + 1.5707963050
        r = tl.sqrt(tl.maximum(1.0 - ax, 0.0)) * p
        return tl.where(x >= 0, r, 3.141592653589793 - r)

    @triton.jit
    def _slerp_merge_kernel(
        x0_ptr, x1_ptr,         # [N, D] each, unit column stride
        dir_ptr,                # [N, D] out, unit column stride
        mag0_ptr, mag1_ptr,     # [N] out
        ang_ptr,                # [N] fp32 out
        N, D,
        stride_x0, stride_x1, stride_o,
        t, eps, sin_eps,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)       # BLOCK_N rows per program
        nmask = n < N
        n64 = n.to(tl.int64)
        s00 = tl.zeros([BLOCK_N], dtype=tl.float32)
        s11 = tl.zeros([BLOCK_N], dtype=tl.float32)
        s01 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):                                # pass 1: norms and dot product
            d = d0 + tl.arange(0, BLOCK_D)
            mask = nmask[:, None] & (d < D)[None, :]
            a = tl.load(x0_ptr + n64[:, None] * stride_x0 + d[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x1_ptr + n64[:, None] * stride_x1 + d[None, :], mask=mask, other=0.0).to(tl.float32)
            s00 += tl.sum(a * a, axis=1)
            s11 += tl.sum(b * b, axis=1)
            s01 += tl.sum(a * b, axis=1)
        n0 = tl.sqrt(s00)
        n1 = tl.sqrt(s11)
        i0 = 1.0 / tl.maximum(n0, eps)
        i1 = 1.0 / tl.maximum(n1, eps)
        c = tl.minimum(tl.maximum(s01 * i0 * i1, -1.0), 1.0)
        omega = _acos(c)
        s = tl.sin(omega)
        ok = s > sin_eps
        s_safe = tl.where(ok, s, 1.0)
        w0 = tl.where(ok, tl.sin((1.0 - t) * omega) / s_safe, 1.0 - t)
        w1 = tl.where(ok, tl.sin(t * omega) / s_safe, t)
        q0 = n0 * i0                                                   # ‖u0‖: 1, or < 1 for rows under eps
        q1 = n1 * i1
        e2 = w0 * w0 * q0 * q0 + w1 * w1 * q1 * q1 + 2.0 * w0 * w1 * s01 * i0 * i1    # ‖w0 u0 + w1 u1‖²
        ie = 1.0 / tl.maximum(tl.sqrt(tl.maximum(e2, 0.0)), eps)
        c0 = w0 * i0 * ie
        c1 = w1 * i1 * ie
        for d0 in range(0, D, BLOCK_D):                                # pass 2: the unit direction
            d = d0 + tl.arange(0, BLOCK_D)
            mask = nmask[:, None] & (d < D)[None, :]
            a = tl.load(x0_ptr + n64[:, None] * stride_x0 + d[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x1_ptr + n64[:, None] * stride_x1 + d[None, :], mask=mask, other=0.0).to(tl.float32)
            e = a * c0[:, None] + b * c1[:, None]
            tl.store(dir_ptr + n64[:, None] * stride_o + d[None, :], e.to(dir_ptr.dtype.element_ty), mask=mask)
        tl.store(mag0_ptr + n, n0.to(mag0_ptr.dtype.element_ty), mask=nmask)
        tl.store(mag1_ptr + n, n1.to(mag1_ptr.dtype.element_ty), mask=nmask)
        tl.store(ang_ptr + n, omega, mask=nmask)

    @triton.jit
    def _slerp_restore_kernel(
        dir_ptr,                # [N, D], unit column stride
        mag_ptr,                # [N]
        out_ptr,                # [N, D] out, unit column stride
        N, D,
        stride_d, stride_o,
        eps,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        n64 = n.to(tl.int64)
        ss = tl.zeros([BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = nmask[:, None] & (d < D)[None, :]
            e = tl.load(dir_ptr + n64[:, None] * stride_d + d[None, :], mask=mask, other=0.0).to(tl.float32)
            ss += tl.sum(e * e, axis=1)
        m = tl.load(mag_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        scale = m / tl.maximum(tl.sqrt(ss), eps)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = nmask[:, None] & (d < D)[None, :]
            e = tl.load(dir_ptr + n64[:, None] * stride_d + d[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + n64[:, None] * stride_o + d[None, :], (e * scale[:, None]).to(out_ptr.dtype.element_ty),
                     mask=mask)


def _check_rows(x: torch.Tensor, what: str) -> None:
    assert x.dim() == 2 and x.dtype in DTYPES, f"{what} must be an fp16/bf16/fp32 [N, D], got {x.dtype} {list(x.shape)}"
    assert x.shape[1] <= 1 or x.stride(1) == 1, f"{what} must have unit column stride, got strides {x.stride()}"
    assert x.shape[0] <= 1 or x.stride(0) >= x.shape[1], (
        f"{what} rows overlap: strides {x.stride()} for {list(x.shape)}")


def _check_vec(v: torch.Tensor, n: int, what: str) -> None:
    assert v.shape == (n,) and v.dtype in DTYPES, (
        f"{what} must be an fp16/bf16/fp32 [N] = [{n}], got {v.dtype} {list(v.shape)}")
    assert v.is_contiguous(), f"{what} must be contiguous, got stride {v.stride()}"


def check_merge_args(x0, x1, direction, mag0, mag1, angle) -> None:
    """Launcher contract. x0, x1: [N, D] same shape; direction: [N, D]; all three with unit column
    stride and non-overlapping rows; mag0, mag1: [N] contiguous; angle: [N] fp32 contiguous; one device."""
    _check_rows(x0, "x0")
    _check_rows(x1, "x1")
    assert x0.shape == x1.shape, f"x0 and x1 must have one shape, got {list(x0.shape)} and {list(x1.shape)}"
    _check_rows(direction, "direction")
    assert direction.shape == x0.shape, f"direction must be [N, D] = {list(x0.shape)}, got {list(direction.shape)}"
    n = x0.shape[0]
    _check_vec(mag0, n, "mag0")
    _check_vec(mag1, n, "mag1")
    _check_vec(angle, n, "angle")
    assert angle.dtype == torch.float32, f"angle must be fp32, got {angle.dtype}"
    for t in (x1, direction, mag0, mag1, angle):
        assert t.device == x0.device, f"all tensors must share a device, got {t.device} and {x0.device}"


def check_restore_args(direction, mag, out) -> None:
    """Launcher contract. direction, out: [N, D] unit column stride, non-overlapping rows; mag: [N]
    contiguous; one device."""
    _check_rows(direction, "direction")
    _check_rows(out, "out")
    assert out.shape == direction.shape, f"out must be [N, D] = {list(direction.shape)}, got {list(out.shape)}"
    _check_vec(mag, direction.shape[0], "mag")
    assert mag.device == direction.device == out.device, "all tensors must share a device"


def slerp_merge_triton(
    x0: torch.Tensor,                        # [N, D] lower layer's rows
    x1: torch.Tensor,                        # [N, D] upper layer's rows
    t: float,
    out_dtype: torch.dtype = torch.float32,
    out: tuple | None = None,                # (direction [N, D], mag0 [N], mag1 [N], angle [N] fp32)
    block_n: int = 16,
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the merge; checks the contract first (see `check_merge_args`)."""
    if out is None:
        assert x0.dim() == 2, f"x0 must be [N, D], got {list(x0.shape)}"
        n = x0.shape[0]
        out = (torch.empty(x0.shape, dtype=out_dtype, device=x0.device),
               torch.empty(n, dtype=out_dtype, device=x0.device), torch.empty(n, dtype=out_dtype, device=x0.device),
               torch.empty(n, dtype=torch.float32, device=x0.device))
    check_merge_args(x0, x1, *out)
    require_triton()
    N, D = x0.shape
    if N == 0:
        return out
    bd = block_d or pow2_at_least(D, 16, MAX_BLOCK_D)
    assert bd & (bd - 1) == 0 and block_n & (block_n - 1) == 0, "block sizes must be powers of two"
    direction, mag0, mag1, angle = out
    _slerp_merge_kernel[(triton.cdiv(N, block_n),)](
        x0, x1, direction, mag0, mag1, angle, N, D, x0.stride(0), x1.stride(0), direction.stride(0),
        float(t), EPS, SIN_EPS, BLOCK_N=block_n, BLOCK_D=bd)
    return out


def slerp_restore_triton(
    direction: torch.Tensor,                 # [N, D]
    mag: torch.Tensor,                       # [N]
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,         # [N, D]; allocated when None
    block_n: int = 16,
    block_d: int | None = None,
) -> torch.Tensor:                           # [N, D]
    """Launch the restoration; checks the contract first (see `check_restore_args`)."""
    if out is None:
        assert direction.dim() == 2, f"direction must be [N, D], got {list(direction.shape)}"
        out = torch.empty(direction.shape, dtype=out_dtype, device=direction.device)
    check_restore_args(direction, mag, out)
    require_triton()
    N, D = direction.shape
    if N == 0:
        return out
    bd = block_d or pow2_at_least(D, 16, MAX_BLOCK_D)
    assert bd & (bd - 1) == 0 and block_n & (block_n - 1) == 0, "block sizes must be powers of two"
    _slerp_restore_kernel[(triton.cdiv(N, block_n),)](
        direction, mag, out, N, D, direction.stride(0), out.stride(0), EPS, BLOCK_N=block_n, BLOCK_D=bd)
    return out


def slerp_merge_reference(
    x0: torch.Tensor,                        # [N, D]
    x1: torch.Tensor,                        # [N, D]
    t: float,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:   # dir [N, D], mag0 [N], mag1 [N], angle [N] fp32
    """What the merge kernel computes, in plain torch."""
    a, b = x0.float(), x1.float()
    n0, n1 = a.norm(dim=1), b.norm(dim=1)                                          # [N]
    u0, u1 = a / n0.clamp_min(EPS)[:, None], b / n1.clamp_min(EPS)[:, None]       # [N, D]
    omega = torch.acos((u0 * u1).sum(1).clamp(-1.0, 1.0))                          # [N]
    s = torch.sin(omega)
    ok = s > SIN_EPS
    s_safe = torch.where(ok, s, torch.ones_like(s))
    w0 = torch.where(ok, torch.sin((1 - t) * omega) / s_safe, torch.full_like(s, 1 - t))
    w1 = torch.where(ok, torch.sin(t * omega) / s_safe, torch.full_like(s, t))
    e = w0[:, None] * u0 + w1[:, None] * u1
    e = e / e.norm(dim=1).clamp_min(EPS)[:, None]
    return e.to(out_dtype), n0.to(out_dtype), n1.to(out_dtype), omega


def slerp_restore_reference(
    direction: torch.Tensor,                 # [N, D]
    mag: torch.Tensor,                       # [N]
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:                           # [N, D]
    """What the restore kernel computes, in plain torch."""
    e = direction.float()
    return (e * (mag.float() / e.norm(dim=1).clamp_min(EPS))[:, None]).to(out_dtype)
