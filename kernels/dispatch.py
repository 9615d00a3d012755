"""The one place that decides, per call, whether a hot op runs as a Triton kernel or as its
plain-torch reference.

Rule: Triton when it is importable and either every tensor is on CUDA, or the kernels were
decorated under the interpreter (TRITON_INTERPRET=1 set before `kernels` was imported), in
which case they run anywhere. Otherwise — CPU without the interpreter — the torch reference.
"""
from __future__ import annotations

import torch

from kernels import gather


def use_triton(*tensors: torch.Tensor) -> bool:
    if not gather.HAS_TRITON or not tensors:
        return False
    if gather.INTERPRETED:
        return True
    return all(t.is_cuda for t in tensors)


def gather_rows(
    x: torch.Tensor,    # [T, D]
    idx: torch.Tensor,  # [N] integer row indices into x
) -> torch.Tensor:      # [N, D], new contiguous tensor, same dtype/device as x
    """out[n] = x[idx[n]]. Raises IndexError naming the first index outside [0, T)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {list(x.shape)}")
    if idx.dim() != 1 or idx.dtype not in gather.INDEX_DTYPES:
        raise ValueError(f"idx must be a 1-D int32/int64 tensor, got {idx.dtype} shape {list(idx.shape)}")
    T = x.shape[0]
    if idx.numel():
        bad = (idx < 0) | (idx >= T)
        if bool(bad.any()):
            first = int(idx[bad.nonzero()[0, 0]])
            raise IndexError(f"index {first} out of range for {T} rows")
    if use_triton(x, idx):
        return gather.gather_rows_triton(x.contiguous() if x.stride(-1) != 1 else x, idx.contiguous())
    return gather.gather_rows_reference(x, idx)
