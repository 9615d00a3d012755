"""Row gather: out[n, :] = x[idx[n], :] — the compaction of kept tokens.

Three pieces, as for every kernel here: the Triton kernel, its launcher (which checks shapes,
dtypes and strides before anything is launched), and the plain-torch reference that defines
what the kernel must compute. `kernels.dispatch.gather_rows` chooses between them.

Triton is optional (see `kernels._triton`): without it this module still imports and only the
reference is usable.
"""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, INTERPRETED, pow2_at_least, require_triton, tl, triton  # noqa: F401

MAX_BLOCK_D = 1024
INDEX_DTYPES = (torch.int64, torch.int32)


if HAS_TRITON:

    @triton.jit
    def _gather_rows_kernel(
        x_ptr,        # [T, D], any row stride, unit column stride
        idx_ptr,      # [N] int32/int64, every value in [0, T)
        out_ptr,      # [N, D], any row stride, unit column stride
        D,
        stride_xt,
        stride_on,
        BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0)          # one output row per program along axis 0
        dblk = tl.program_id(1)       # one BLOCK_D-wide slice of the row along axis 1
        row = tl.load(idx_ptr + n).to(tl.int64)
        cols = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < D
        vals = tl.load(x_ptr + row * stride_xt + cols, mask=mask)
        tl.store(out_ptr + n.to(tl.int64) * stride_on + cols, vals, mask=mask)


def check_gather_args(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """The launcher's contract; raises AssertionError naming what is wrong.

    x: [T, D] with unit column stride; idx: [N] contiguous int32/int64; out: [N, D] with unit
    column stride, same dtype and device as x. Index values are not read here (that would
    synchronise a GPU); `kernels.dispatch.gather_rows` range-checks them.
    """
    assert x.dim() == 2, f"x must be [T, D], got shape {list(x.shape)}"
    assert idx.dim() == 1, f"idx must be [N], got shape {list(idx.shape)}"
    assert out.dim() == 2, f"out must be [N, D], got shape {list(out.shape)}"
    assert idx.dtype in INDEX_DTYPES, f"idx must be int32 or int64, got {idx.dtype}"
    assert idx.is_contiguous(), f"idx must be contiguous, got stride {idx.stride()}"
    assert out.shape == (idx.shape[0], x.shape[1]), (
        f"out must be [N, D] = [{idx.shape[0]}, {x.shape[1]}], got {list(out.shape)}")
    assert out.dtype == x.dtype, f"out dtype {out.dtype} differs from x dtype {x.dtype}"
    assert x.device == idx.device == out.device, (
        f"x, idx, out must share a device, got {x.device}, {idx.device}, {out.device}")
    assert x.shape[1] <= 1 or x.stride(1) == 1, f"x must have unit column stride, got strides {x.stride()}"
    assert out.shape[1] <= 1 or out.stride(1) == 1, f"out must have unit column stride, got strides {out.stride()}"
    assert x.shape[0] <= 1 or x.stride(0) >= x.shape[1], f"x rows overlap: strides {x.stride()} for shape {list(x.shape)}"
    assert out.shape[0] <= 1 or out.stride(0) >= out.shape[1], (
        f"out rows overlap: strides {out.stride()} for shape {list(out.shape)}")


def gather_rows_triton(
    x: torch.Tensor,                  # [T, D]
    idx: torch.Tensor,                # [N]
    out: torch.Tensor | None = None,  # [N, D]; allocated when None
    block_d: int | None = None,
) -> torch.Tensor:                    # [N, D]
    """Launch the Triton gather; checks the contract first (see `check_gather_args`)."""
    if out is None:
        assert x.dim() == 2 and idx.dim() == 1, f"x must be [T, D] and idx [N], got {list(x.shape)} and {list(idx.shape)}"
        out = torch.empty((idx.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    check_gather_args(x, idx, out)
    require_triton()
    N, D = out.shape
    if N == 0 or D == 0:
        return out
    block = block_d or pow2_at_least(D, 1, MAX_BLOCK_D)
    assert block > 0 and block & (block - 1) == 0, f"block_d must be a power of two, got {block}"
    grid = (N, triton.cdiv(D, block))
    _gather_rows_kernel[grid](x, idx, out, D, x.stride(0), out.stride(0), BLOCK_D=block)
    return out


def gather_rows_reference(
    x: torch.Tensor,    # [T, D]
    idx: torch.Tensor,  # [N] int64/int32, values in [0, T)
) -> torch.Tensor:      # [N, D], a new contiguous tensor
    """What the kernel computes, in plain torch."""
    return x.index_select(0, idx.to(torch.int64)).contiguous()
