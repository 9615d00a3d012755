"""The one place that decides, per call, whether a hot op runs as a Triton kernel or as its
plain-torch reference — one function per op.

Rule: Triton when it is importable and either every tensor is on CUDA, or the kernels were
decorated under the interpreter (TRITON_INTERPRET=1 set before `kernels` was imported), in
which case they run anywhere. Otherwise — CPU without the interpreter — the torch reference.
Each function validates its arguments (ValueError / IndexError) before either path runs, so
both see only inputs the kernels' launchers accept.
"""
from __future__ import annotations

import torch

from kernels import codebook, gather, ragged_attention, rope_reconstruct
from kernels._triton import HAS_TRITON, INTERPRETED


def use_triton(*tensors: torch.Tensor) -> bool:
    if not HAS_TRITON or not tensors:
        return False
    if INTERPRETED:
        return True
    return all(t.is_cuda for t in tensors)


def _check_index_range(idx: torch.Tensor, n: int, what: str) -> None:
    if idx.numel():
        if not idx.dtype.is_signed and n > torch.iinfo(idx.dtype).max:
            return                    # every value of an unsigned dtype this narrow is in range
        bad = (idx < 0) | (idx >= n)
        if bool(bad.any()):
            first = int(idx[bad.nonzero()[0, 0]])
            raise IndexError(f"index {first} out of range for {n} {what}")


def gather_rows(
    x: torch.Tensor,    # [T, D]
    idx: torch.Tensor,  # [N] integer row indices into x
) -> torch.Tensor:      # [N, D], new contiguous tensor, same dtype/device as x
    """out[n] = x[idx[n]]. Raises IndexError naming the first index outside [0, T)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {list(x.shape)}")
    if idx.dim() != 1 or idx.dtype not in gather.INDEX_DTYPES:
        raise ValueError(f"idx must be a 1-D int32/int64 tensor, got {idx.dtype} shape {list(idx.shape)}")
    _check_index_range(idx, x.shape[0], "rows")
    if use_triton(x, idx):
        return gather.gather_rows_triton(x.contiguous() if x.stride(-1) != 1 else x, idx.contiguous())
    return gather.gather_rows_reference(x, idx)


def build_codebook(
    x: torch.Tensor,                      # [N, D] any float dtype
    theta: float,
    weight: torch.Tensor | None = None,   # [N] positive multiplicities, None = all 1
    *,
    tile: int = codebook.DEFAULT_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:   # C [n, D] fp32 unit rows, ref [N] int64, mag [N] fp32
    """SpindleKV Algorithm 1 (see `kernels.codebook`); the degree computations run in Triton when
    `use_triton(x)`, the greedy loop in torch either way."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a float [N, D] tensor, got {x.dtype} shape {list(x.shape)}")
    if weight is not None and (weight.shape != (x.shape[0],) or not bool((weight > 0).all())):
        raise ValueError(f"weight must be [N] = [{x.shape[0]}] and positive, got shape {list(weight.shape)}")
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    degree = codebook.codebook_degree_triton if use_triton(x) else None
    return codebook.build_codebook(x, theta, weight, tile=tile, degree=degree)


def reconstruct(
    C: torch.Tensor,                         # [n, D] codebook
    ref: torch.Tensor,                       # [N] uint8/int16/int32/int64 entries
    mag: torch.Tensor,                       # [N] fp16/bf16/fp32 norms
    pos: torch.Tensor | None = None,         # [N] int32/int64 positions: keys; None: values
    inv_freq: torch.Tensor | None = None,    # [D/2] fp32, required with pos
    attention_scaling: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:                           # [N, D] out_dtype
    """out = RoPE(C[ref] * mag[:, None], pos) (no RoPE when pos is None); see `kernels.rope_reconstruct`."""
    if C.dim() != 2 or ref.dim() != 1 or ref.dtype not in rope_reconstruct.REF_DTYPES:
        raise ValueError(f"C must be [n, D] and ref a 1-D uint8/int16/int32/int64 tensor, got {list(C.shape)} and "
                         f"{ref.dtype} {list(ref.shape)}")
    if mag.shape != ref.shape or mag.dtype not in rope_reconstruct.MAG_DTYPES:
        raise ValueError(f"mag must be fp16/bf16/fp32 [N] = {list(ref.shape)}, got {mag.dtype} {list(mag.shape)}")
    if pos is not None:
        if pos.shape != ref.shape or pos.dtype not in rope_reconstruct.POS_DTYPES:
            raise ValueError(f"pos must be int32/int64 [N] = {list(ref.shape)}, got {pos.dtype} {list(pos.shape)}")
        if inv_freq is None or inv_freq.shape != (C.shape[1] // 2,) or C.shape[1] % 2:
            raise ValueError(f"RoPE needs an even D and inv_freq [D/2]; D = {C.shape[1]}, inv_freq "
                             f"{None if inv_freq is None else list(inv_freq.shape)}")
    _check_index_range(ref, C.shape[0], "codebook entries")
    if use_triton(C, ref, mag):
        pos_, freq_ = (None, None) if pos is None else (pos.contiguous(), inv_freq.float().contiguous())
        return rope_reconstruct.reconstruct_triton(
            C if C.shape[1] <= 1 or C.stride(1) == 1 else C.contiguous(), ref.contiguous(), mag.contiguous(),
            pos_, freq_, attention_scaling, out_dtype)
    return rope_reconstruct.reconstruct_reference(C, ref, mag, pos, inv_freq, attention_scaling, out_dtype)


def ragged_decode_attention(
    q: torch.Tensor,        # [H, D] one query per head
    k: torch.Tensor,        # [T_total, D] packed rows of all heads
    v: torch.Tensor,        # [T_total, D]
    offsets: torch.Tensor,  # [H+1] int64: head h owns rows offsets[h]:offsets[h+1]
    scaling: float,
) -> torch.Tensor:          # [H, D] fp32; zeros for a head with no rows
    """Per-head softmax(scaling * q k^T) v over ragged rows; see `kernels.ragged_attention`."""
    if q.dim() != 2 or k.dim() != 2 or k.shape != v.shape or k.shape[1] != q.shape[1]:
        raise ValueError(f"q must be [H, D] and k, v [T, D] with the same D, got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if k.dtype not in ragged_attention.KV_DTYPES or v.dtype not in ragged_attention.KV_DTYPES:
        raise ValueError(f"k and v must be fp16/bf16/fp32, got {k.dtype} and {v.dtype}")
    if offsets.shape != (q.shape[0] + 1,) or offsets.dtype != torch.int64:
        raise ValueError(f"offsets must be int64 [H+1] = [{q.shape[0] + 1}], got {offsets.dtype} {list(offsets.shape)}")
    if bool((offsets[0] != 0) | (offsets[-1] != k.shape[0]) | (offsets[1:] < offsets[:-1]).any()):   # one sync
        raise ValueError(f"offsets must rise from 0 to T = {k.shape[0]}, got {offsets.tolist()}")
    if use_triton(q, k, v):
        unit = lambda t: t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()  # noqa: E731
        return ragged_attention.ragged_decode_attention_triton(unit(q), unit(k), unit(v), offsets.contiguous(), scaling)
    return ragged_attention.ragged_decode_attention_reference(q, k, v, offsets, scaling)
