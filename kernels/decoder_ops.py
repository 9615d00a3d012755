"""The decoder's per-row ops, each one pass over its rows (at a decode step the rows are few, and
the dispatch of the six to eight torch ops each composes to was what it cost):

    rms_norm(x, w, eps)                  x / sqrt(mean(x²) + eps) · w            (LlamaRMSNorm)
    add_rms_norm(residual, delta, w)     residual += delta in place; -> rms_norm(residual)
    rope_(x, cos, sin)                   x · cos + rotate_half(x) · sin, in place (HF's RoPE)
    silu_mul(gate, up)                   silu(gate) · up                           (LlamaMLP's)

    kernel      C++ on the CPU for contiguous fp32 or bf16 rows, fp32 math (`kernels/cpu_decoder_ops.cpp`,
                built with the decode kernels by `kernels.cpu_extension`); Triton on CUDA for
                fp32/bf16/fp16 rows with unit stride in the last dim (`kernels/decoder_ops_triton.py`)
    launcher    the functions below: the kernel where it applies, else the reference
    reference   the same math in plain torch (any dtype, any device)

Shapes: N rows, H hidden, heads × D per row for RoPE, F the MLP's width."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension
from kernels import decoder_ops_triton as gpu
from kernels.backend import backend


KERNEL_DTYPES = (torch.float32, torch.bfloat16)     # the compute dtypes the C++ kernels take


def _cpu(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether rows like x get the kernel: on the CPU, in one of KERNEL_DTYPES, `others` (weights,
    deltas) in the same dtype; the kernel checks the shapes itself."""
    return x.dtype in KERNEL_DTYPES and all(o.dtype == x.dtype for o in others) and backend(x.device) == "cpp"


def _gpu(*ts: torch.Tensor) -> bool:
    """Whether these get the Triton kernel: CUDA tensors of a row dtype, unit stride in the last dim."""
    return (all(t.is_cuda and t.dtype in gpu.DTYPES and (t.shape[-1] <= 1 or t.stride(-1) == 1) for t in ts)
            and backend(ts[0].device) == "triton")


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H], w [H] -> [N, H]."""
    if _gpu(x, w) and x.dim() == 2:
        return gpu.rms_norm(x, w, eps)
    if _cpu(x, w) and x.is_contiguous():
        return cpu_extension.module().rms_norm(x, w.contiguous(), float(eps))
    return rms_norm_reference(x, w, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """residual [N, H] += delta [N, H] (in place) -> rms_norm(residual, w) [N, H]."""
    if _gpu(residual, delta, w) and residual.dim() == 2 and delta.shape == residual.shape:
        return gpu.add_rms_norm(residual, delta, w, eps)
    if _cpu(residual, delta, w) and residual.is_contiguous() and delta.is_contiguous():
        return cpu_extension.module().add_rms_norm(residual, delta, w.contiguous(), float(eps))
    residual += delta
    return rms_norm_reference(residual, w, eps)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] in place; cos, sin [N, D] (fp32, or x's dtype) -> x."""
    if _gpu(x, cos, sin) and x.dim() == 3 and x.shape[2] % 2 == 0:
        return gpu.rope_(x, cos, sin)
    if _cpu(x) and x.stride(2) == 1 and cos.dtype in (torch.float32, x.dtype) and sin.dtype == cos.dtype \
            and cos.is_contiguous() and sin.is_contiguous():
        cpu_extension.module().rope_(x, cos, sin)
        return x
    x.copy_(rope_reference(x, cos, sin))
    return x


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, F] -> silu(gate) · up."""
    if _gpu(gate, up) and gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape:
        return gpu.silu_mul(gate, up)
    if _cpu(gate, up) and gate.is_contiguous() and up.is_contiguous():
        return cpu_extension.module().silu_mul(gate, up)
    return F.silu(gate) * up
