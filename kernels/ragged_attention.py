"""Decode attention, one query per head, over ragged per-head K/V.

After eviction every stored head keeps its own number of tokens, so the cache packs all heads'
rows into k, v [T_total, D]: head h owns rows offsets[h]:offsets[h+1]. For each head,
out[h] = softmax(scaling * q[h] . k_h^T) @ v_h, in fp32 whatever the storage dtype. A head with
no rows attends to nothing: its output is zeros (not NaN).
"""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, pow2_at_least, require_triton, tl, triton

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_D = 512

if HAS_TRITON:

    @triton.jit
    def _ragged_decode_kernel(
        q_ptr,        # [H, D], unit column stride
        k_ptr,        # [T, D], unit column stride
        v_ptr,        # [T, D], unit column stride
        off_ptr,      # [H+1] int64
        out_ptr,      # [H, D] fp32, unit column stride
        D,
        stride_q, stride_k, stride_v, stride_o,
        scaling,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,    # >= D: a row fits one block
    ):
        h = tl.program_id(0)                      # one head per program
        start = tl.load(off_ptr + h)
        end = tl.load(off_ptr + h + 1)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + h.to(tl.int64) * stride_q + d, mask=dmask, other=0.0).to(tl.float32)
        m_i = tl.full((), float("-inf"), tl.float32)      # running max
        l_i = tl.zeros((), tl.float32)                     # running denominator
        acc = tl.zeros([BLOCK_D], tl.float32)
        for t0 in range(start, end, BLOCK_T):     # every block holds >= 1 row of this head
            t = t0 + tl.arange(0, BLOCK_T)
            tmask = t < end
            mask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + t[:, None] * stride_k + d[None, :], mask=mask, other=0.0).to(tl.float32)
            s = tl.where(tmask, tl.sum(k * q[None, :], axis=1) * scaling, float("-inf"))   # [BLOCK_T]
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + t[:, None] * stride_v + d[None, :], mask=mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)   # no rows: acc = 0 -> zeros
        tl.store(out_ptr + h.to(tl.int64) * stride_o + d, out, mask=dmask)


def check_ragged_args(q, k, v, offsets, out) -> None:
    """Launcher contract. q: [H, D] float; k, v: [T, D] fp16/bf16/fp32; all unit column stride;
    offsets: [H+1] contiguous int64 (values not read here: dispatch checks them); out: [H, D] fp32;
    one device."""
    assert q.dim() == 2 and q.is_floating_point(), f"q must be a float [H, D], got {q.dtype} {list(q.shape)}"
    H, D = q.shape
    for name, t in (("k", k), ("v", v)):
        assert t.dim() == 2 and t.shape[1] == D, f"{name} must be [T, D] with D = {D}, got {list(t.shape)}"
        assert t.dtype in KV_DTYPES, f"{name} must be fp16/bf16/fp32, got {t.dtype}"
    assert k.shape == v.shape, f"k and v must have one shape, got {list(k.shape)} and {list(v.shape)}"
    assert offsets.shape == (H + 1,) and offsets.dtype == torch.int64, (
        f"offsets must be int64 [H+1] = [{H + 1}], got {offsets.dtype} {list(offsets.shape)}")
    assert offsets.is_contiguous(), f"offsets must be contiguous, got stride {offsets.stride()}"
    assert out.shape == (H, D) and out.dtype == torch.float32, (
        f"out must be fp32 [H, D], got {out.dtype} {list(out.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        assert t.shape[1] <= 1 or t.stride(1) == 1, f"{name} must have unit column stride, got strides {t.stride()}"
    assert H <= 1 or out.stride(0) >= D, f"out rows overlap: strides {out.stride()} for shape {list(out.shape)}"
    for t in (k, v, offsets, out):
        assert t.device == q.device, f"all tensors must share a device, got {t.device} and {q.device}"


def ragged_decode_attention_triton(
    q: torch.Tensor,                  # [H, D]
    k: torch.Tensor,                  # [T, D]
    v: torch.Tensor,                  # [T, D]
    offsets: torch.Tensor,            # [H+1] int64
    scaling: float,
    out: torch.Tensor | None = None,  # [H, D] fp32; allocated when None
    block_t: int = 32,
) -> torch.Tensor:                    # [H, D] fp32
    """Launch one program per head (online softmax over its rows); checks `check_ragged_args` first."""
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    check_ragged_args(q, k, v, offsets, out)
    require_triton()
    H, D = q.shape
    assert D <= MAX_BLOCK_D, f"head dim {D} exceeds {MAX_BLOCK_D}"
    assert block_t > 0 and block_t & (block_t - 1) == 0, f"block_t must be a power of two, got {block_t}"
    if H == 0 or D == 0:
        return out
    _ragged_decode_kernel[(H,)](
        q, k, v, offsets, out, D, q.stride(0), k.stride(0), v.stride(0), out.stride(0), float(scaling),
        BLOCK_T=block_t, BLOCK_D=pow2_at_least(D))
    return out


def ragged_decode_attention_reference(
    q: torch.Tensor,        # [H, D]
    k: torch.Tensor,        # [T, D]
    v: torch.Tensor,        # [T, D]
    offsets: torch.Tensor,  # [H+1] int64, offsets[0] = 0, nondecreasing, offsets[H] = T
    scaling: float,
) -> torch.Tensor:          # [H, D] fp32
    """What the kernel computes: a segment softmax over the packed rows."""
    H, D = q.shape
    counts = offsets[1:] - offsets[:-1]                                                  # [H]
    head = torch.repeat_interleave(torch.arange(H, device=q.device), counts)             # [T]
    logits = (q.float().index_select(0, head) * k.float()).sum(-1) * scaling             # [T]
    seg_max = torch.full((H,), float("-inf"), device=q.device).scatter_reduce(
        0, head, logits, reduce="amax")                                                  # [H]
    p = torch.exp(logits - seg_max.index_select(0, head))                                # [T]
    denom = torch.zeros(H, device=q.device).index_add_(0, head, p)                       # [H]
    acc = torch.zeros(H, D, device=q.device).index_add_(0, head, p[:, None] * v.float())  # [H, D]
    return acc / torch.where(denom > 0, denom, 1.0)[:, None]
