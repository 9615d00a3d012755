"""Approximate attention scores of queries against packed low-bit keys (SpeCache's speculative
scores; KIVI's key layout), without materialising the dequantized keys.

Keys are quantized per channel over groups of g consecutive tokens (`kernels.quant`'s format
with the token axis last): for KV head h, key group i, channel c, codes of the g tokens packed
P = 8 / bits to a byte, little end first, one fp16 scale s[h, i, c] and zero z[h, i, c]. Then

    K'[h, i·g + j, c] = code[h, i, c, j] · s[h, i, c] + z[h, i, c]
    scores[h, r, i·g + j] = Σ_c q[h, r, c] · K'[h, i·g + j, c]
                          = Σ_c (q[h, r, c] · s[h, i, c]) · code[h, i, c, j] + Σ_c q[h, r, c] · z[h, i, c]

(fp32 math; no scaling factor, no softmax). The second form is what both paths use: the scale
folds into the query, the zero into one bias per (row, group), and the codes are read once as
small integers.

Shapes: H KV heads, R query rows per head, n key groups of g tokens, D head dim,
B = g · bits / 8 bytes per (group, channel).
"""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, pow2_at_least, require_triton, tl, triton
from kernels.quant import BITS, PARAM_DTYPE, X_DTYPES, per_byte, unpack_codes

if HAS_TRITON:

    @triton.jit
    def _lowbit_scores_kernel(
        q_ptr,          # [H, R, D] fp16/bf16/fp32, contiguous
        codes_ptr,      # [H, n, D, B] uint8, contiguous
        scale_ptr,      # [H, n, D] fp16, contiguous
        zero_ptr,       # [H, n, D] fp16, contiguous
        out_ptr,        # [H, R, n·g] fp32, contiguous
        R, D, n,
        GROUP: tl.constexpr,     # g
        BITS: tl.constexpr,
        PER: tl.constexpr,       # P = 8 // BITS
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr,   # >= g
    ):
        h = tl.program_id(0)
        i = tl.program_id(1)                                            # key group
        r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_D)
        j = tl.arange(0, BLOCK_G)
        rmask, cmask, jmask = r < R, c < D, j < GROUP
        h64 = h.to(tl.int64)
        hi = h64 * n + i                                                # (head, group) row of scale/zero
        q = tl.load(q_ptr + (h64 * R + r[:, None]) * D + c[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)          # [BLOCK_R, BLOCK_D]
        s = tl.load(scale_ptr + hi * D + c, mask=cmask, other=0.0).to(tl.float32)           # [BLOCK_D]
        z = tl.load(zero_ptr + hi * D + c, mask=cmask, other=0.0).to(tl.float32)
        B: tl.constexpr = GROUP // PER
        byte = tl.load(codes_ptr + (hi * D + c[:, None]) * B + (j // PER)[None, :],
                       mask=cmask[:, None] & jmask[None, :], other=0).to(tl.int32)          # [BLOCK_D, BLOCK_G]
        code = ((byte >> ((j % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        qs = q * s[None, :]                                                                  # [BLOCK_R, BLOCK_D]
        acc = tl.sum(qs[:, :, None] * code[None, :, :], axis=1)                              # [BLOCK_R, BLOCK_G]
        bias = tl.sum(q * z[None, :], axis=1)                                                # [BLOCK_R]
        acc = acc + bias[:, None]
        tl.store(out_ptr + (h64 * R + r[:, None]) * (n * GROUP) + i * GROUP + j[None, :], acc,
                 mask=rmask[:, None] & jmask[None, :])


def check_scores_args(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      bits: int) -> int:
    """The contract of both paths -> g; raises ValueError naming the argument.

    q: [H, R, D] fp16/bf16/fp32; codes: [H, n, D, B] uint8 with g = B · 8 / bits; scale, zero:
    [H, n, D] fp16; one device."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if q.dim() != 3 or q.dtype not in X_DTYPES:
        raise ValueError(f"q must be fp16/bf16/fp32 [H, R, D], got {q.dtype} shape {list(q.shape)}")
    h, _, d = q.shape
    if codes.dim() != 4 or codes.dtype != torch.uint8 or codes.shape[0] != h or codes.shape[2] != d:
        raise ValueError(f"k_codes must be uint8 [H, n, D, B] = [{h}, n, {d}, B], got {codes.dtype} "
                         f"shape {list(codes.shape)}")
    n = codes.shape[1]
    for name, t in (("k_scale", scale), ("k_zero", zero)):
        if t.dtype != PARAM_DTYPE or tuple(t.shape) != (h, n, d):
            raise ValueError(f"{name} must be fp16 [H, n, D] = [{h}, {n}, {d}], got {t.dtype} shape {list(t.shape)}")
    for name, t in (("k_codes", codes), ("k_scale", scale), ("k_zero", zero)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: one device")
    return codes.shape[3] * per_byte(bits)


def lowbit_scores_triton(
    q: torch.Tensor,        # [H, R, D]
    codes: torch.Tensor,    # [H, n, D, B] uint8
    scale: torch.Tensor,    # [H, n, D] fp16
    zero: torch.Tensor,     # [H, n, D] fp16
    bits: int,
    block_r: int = 8,
) -> torch.Tensor:          # [H, R, n·g] fp32
    """Launch the scores kernel: one program per (head, key group, block of query rows)."""
    g = check_scores_args(q, codes, scale, zero, bits)
    if block_r <= 0 or block_r & (block_r - 1):
        raise ValueError(f"block_r must be a power of two, got {block_r}")
    require_triton()
    q, codes, scale, zero = (t.contiguous() for t in (q, codes, scale, zero))
    h, r, d = q.shape
    n = codes.shape[1]
    out = torch.empty(h, r, n * g, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    grid = (h, n, triton.cdiv(r, block_r))
    _lowbit_scores_kernel[grid](q, codes, scale, zero, out, r, d, n, GROUP=g, BITS=bits, PER=per_byte(bits),
                                BLOCK_R=block_r, BLOCK_D=pow2_at_least(d), BLOCK_G=pow2_at_least(g))
    return out


def lowbit_scores_reference(
    q: torch.Tensor,        # [H, R, D]
    codes: torch.Tensor,    # [H, n, D, B] uint8
    scale: torch.Tensor,    # [H, n, D] fp16
    zero: torch.Tensor,     # [H, n, D] fp16
    bits: int,
) -> torch.Tensor:          # [H, R, n·g] fp32
    """What the kernel computes, in plain torch: the codes unpacked once (`unpack_codes`)
    and one batched matmul per (head, group) with the scale-folded query.
    Arguments as `check_scores_args` accepts them (the dispatch checks; not again here)."""
    g = codes.shape[3] * per_byte(bits)
    h, r, d = q.shape
    n = codes.shape[1]
    qf = q.float()
    code = unpack_codes(codes, bits)                                                         # [H, n, D, g]
    qs = qf[:, None] * scale.float()[:, :, None]                                            # [H, n, R, D]
    scores = torch.matmul(qs, code)                                                          # [H, n, R, g]
    bias = torch.einsum("hrd,hnd->hnr", qf, zero.float())                                   # [H, n, R]
    scores = scores + bias[..., None]
    return scores.permute(0, 2, 1, 3).reshape(h, r, n * g)
