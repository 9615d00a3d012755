"""The decoder's per-row ops as Triton kernels, for CUDA (the C++ ones in `kernels/cpu_decoder_ops.cpp`
serve the CPU; `kernels.decoder_ops` dispatches and holds the torch references). Same contract:

    rms_norm(x, w, eps)                  x / sqrt(mean(x²) + eps) · w            (LlamaRMSNorm)
    add_rms_norm(residual, delta, w)     residual += delta in place; -> rms_norm(residual)
    rope_(x, cos, sin)                   x · cos + rotate_half(x) · sin, in place (HF's RoPE)
    silu_mul(gate, up)                   silu(gate) · up                           (LlamaMLP's)

Rows are fp32, bf16 or fp16; the math is fp32 and each result is rounded once to its tensor's dtype
(the residual of `add_rms_norm` is rounded before it is normalised, as `residual += delta` rounds
it). Each launcher checks dtypes, shapes and strides (ValueError naming the argument), allocates
the output and nothing else, and launches one kernel whose grid depends on shapes alone: no host
sync, so a CUDA graph can hold them. They run anywhere under TRITON_INTERPRET=1 (the tests).

Shapes: N rows, H hidden, heads × D per row for RoPE, F the MLP's width."""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, pow2_at_least, require_triton, tl, triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ROW = 1 << 16           # the widest row one program holds (hidden sizes are a few thousand)
ELEMENTS = 1024             # elements a program of silu_mul takes

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,        # [N, H] rows (the residual when ADD), unit column stride
        d_ptr,        # [N, H] delta (read when ADD), unit column stride
        w_ptr,        # [H] weight, contiguous
        out_ptr,      # [N, H] contiguous
        H, stride_x, stride_d, eps,
        ADD: tl.constexpr,            # residual += delta first (stored back to x_ptr)
        BLOCK: tl.constexpr,          # power of two >= H
    ):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        mask = c < H
        x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
        if ADD:
            s = x.to(tl.float32) + tl.load(d_ptr + row * stride_d + c, mask=mask, other=0.0).to(tl.float32)
            x = s.to(x_ptr.dtype.element_ty)                    # the residual's own rounding
            tl.store(x_ptr + row * stride_x + c, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * H + c, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(
        x_ptr,        # [N, heads, D], unit stride in D
        cos_ptr,      # [N, D], unit stride in D
        sin_ptr,      # [N, D], unit stride in D
        HEADS, HALF, stride_xn, stride_xh, stride_cn, stride_sn,
        BLOCK_H: tl.constexpr,        # power of two >= heads
        BLOCK_D: tl.constexpr,        # power of two >= D / 2
    ):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        j = tl.arange(0, BLOCK_D)
        jm = j < HALF
        mask = (h < HEADS)[:, None] & jm[None, :]
        lo = x_ptr + row * stride_xn + h[:, None].to(tl.int64) * stride_xh + j[None, :]      # [BLOCK_H, BLOCK_D]
        x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + row * stride_cn + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + row * stride_cn + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + row * stride_sn + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + row * stride_sn + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        dt = x_ptr.dtype.element_ty
        tl.store(lo, (x1 * c1 - x2 * s1).to(dt), mask=mask)              # rotate_half: (-x2, x1)
        tl.store(lo + HALF, (x2 * c2 + x1 * s2).to(dt), mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        g_ptr, u_ptr, out_ptr,        # [N·F] each, contiguous
        total,
        BLOCK: tl.constexpr,
    ):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < total
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, x: torch.Tensor) -> None:
    """x must be [N, H] of a row dtype with unit column stride."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"{name} must be fp32/bf16/fp16 [N, H], got {x.dtype} {list(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {x.stride()}")
    if x.shape[1] > MAX_ROW:
        raise ValueError(f"{name}: rows of {x.shape[1]} > {MAX_ROW} elements")


def _weight(w: torch.Tensor, x: torch.Tensor) -> None:
    if w.dim() != 1 or w.shape[0] != x.shape[1] or w.dtype not in DTYPES or not w.is_contiguous():
        raise ValueError(f"w must be a contiguous float [{x.shape[1]}], got {w.dtype} {list(w.shape)} strides {w.stride()}")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device}, the rows on {x.device}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H], w [H] -> [N, H] in the dtype x·w promotes to."""
    require_triton()
    _rows("x", x)
    return _norm(x, None, w, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """residual [N, H] += delta [N, H] (in place) -> rms_norm(residual, w) [N, H]."""
    require_triton()
    _rows("residual", residual)
    _rows("delta", delta)
    if delta.shape != residual.shape or delta.device != residual.device:
        raise ValueError(f"delta must be {list(residual.shape)} on {residual.device}, "
                         f"got {list(delta.shape)} on {delta.device}")
    return _norm(residual, delta, w, eps)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The launch both share: x [N, H] (+= delta [N, H] first where given) -> [N, H]."""
    _weight(w, x)
    n, hid = x.shape
    out = torch.empty(n, hid, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    d = x if delta is None else delta
    if n:
        _rms_norm_kernel[(n,)](x, d, w, out, hid, x.stride(0), d.stride(0), float(eps),
                               ADD=delta is not None, BLOCK=pow2_at_least(hid, 16), num_warps=_warps(hid))
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] (unit stride in D) in place; cos, sin [N, D] (unit stride in D) -> x."""
    require_triton()
    if x.dim() != 3 or x.dtype not in DTYPES or (x.shape[2] > 1 and x.stride(2) != 1) or x.shape[2] % 2:
        raise ValueError(f"x must be fp32/bf16/fp16 [N, heads, D] with even D and unit stride in D, "
                         f"got {x.dtype} {list(x.shape)} strides {x.stride()}")
    n, heads, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (n, d) or t.dtype not in DTYPES or (d > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be a float [{n}, {d}] with unit column stride, "
                             f"got {t.dtype} {list(t.shape)} strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if n and heads:
        _rope_kernel[(n,)](x, cos, sin, heads, d // 2, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                           BLOCK_H=pow2_at_least(heads), BLOCK_D=pow2_at_least(d // 2), num_warps=2)
    return x


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, F] contiguous -> silu(gate) · up [N, F] in gate's dtype."""
    require_triton()
    for name, t in (("gate", gate), ("up", up)):
        if t.dtype not in DTYPES or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32/bf16/fp16 tensor, got {t.dtype} strides {t.stride()}")
    if up.shape != gate.shape or up.device != gate.device:
        raise ValueError(f"up must be {list(gate.shape)} on {gate.device}, got {list(up.shape)} on {up.device}")
    out = torch.empty_like(gate)
    total = gate.numel()
    if total:
        _silu_mul_kernel[(triton.cdiv(total, ELEMENTS),)](gate, up, out, total, BLOCK=ELEMENTS, num_warps=4)
    return out


def _warps(width: int) -> int:
    """Warps for a row of `width` elements: ~256 elements a warp, 1 to 16."""
    return max(1, min(16, pow2_at_least(width) // 256))
