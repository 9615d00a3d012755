"""Codebook reconstruction fused with RoPE (spec §2.9, eq. 14): out = RoPE(C[ref] * mag, pos).

Keys are stored pre-RoPE as (entry, norm, original position) and re-rotated at every use; values
have no rotation (pos=None). RoPE follows HF Llama: angle = pos * inv_freq, duplicated over the two
halves of D; cos and sin are multiplied by `attention_scaling` (1.0 except for scaled RoPE types
such as YaRN); out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). Angles
and products are fp32. `apply_rope` / `unrotate_rope` are the torch helpers for callers that hold
dense keys (unrotate recovers pre-RoPE keys from post-RoPE ones).
"""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, pow2_at_least, require_triton, tl, triton

REF_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)   # uint8: codebooks of <= 256 entries
POS_DTYPES = (torch.int32, torch.int64)
MAG_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_D = 256

if HAS_TRITON:

    @triton.jit
    def _reconstruct_kernel(
        c_ptr,          # [n, D] codebook, unit column stride
        ref_ptr,        # [N] uint8/int16/int32/int64 rows of c
        mag_ptr,        # [N] fp16/bf16/fp32 norms
        pos_ptr,        # [N] int32/int64 positions (unused without HAS_ROPE)
        freq_ptr,       # [D/2] fp32 inverse frequencies (unused without HAS_ROPE)
        out_ptr,        # [N, D], unit column stride
        N, D,
        stride_c,
        stride_o,
        scaling,
        HAS_ROPE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,  # HAS_ROPE: covers D/2 in one block; else a slice of D
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)      # BLOCK_N output rows per program
        nmask = n < N
        e = tl.load(ref_ptr + n, mask=nmask, other=0).to(tl.int64)
        m = tl.load(mag_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        src = c_ptr + e[:, None] * stride_c
        dst = out_ptr + n.to(tl.int64)[:, None] * stride_o
        if HAS_ROPE:
            half = D // 2
            h = tl.arange(0, BLOCK_D)
            hmask = h < half
            mask = nmask[:, None] & hmask[None, :]
            p = tl.load(pos_ptr + n, mask=nmask, other=0).to(tl.float32)
            f = tl.load(freq_ptr + h, mask=hmask, other=0.0)
            ang = p[:, None] * f[None, :]                              # [BLOCK_N, BLOCK_D]
            cs = tl.cos(ang) * scaling
            sn = tl.sin(ang) * scaling
            x1 = tl.load(src + h[None, :], mask=mask, other=0.0).to(tl.float32) * m[:, None]
            x2 = tl.load(src + half + h[None, :], mask=mask, other=0.0).to(tl.float32) * m[:, None]
            tl.store(dst + h[None, :], (x1 * cs - x2 * sn).to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half + h[None, :], (x2 * cs + x1 * sn).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                mask = nmask[:, None] & (d < D)[None, :]
                x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32) * m[:, None]
                tl.store(dst + d[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


def check_reconstruct_args(C, ref, mag, pos, inv_freq, out) -> None:
    """Launcher contract. C: [n, D] float, unit column stride; ref: [N] uint8/int16/32/64 contiguous (values
    not range-checked here: dispatch does it); mag: [N] fp16/bf16/fp32 contiguous; pos: [N]
    int32/int64 contiguous or None; inv_freq: [D/2] fp32 contiguous (required with pos, D even);
    out: [N, D] float, unit column stride; one device."""
    assert C.dim() == 2 and C.is_floating_point(), f"C must be a float [n, D], got {C.dtype} {list(C.shape)}"
    assert C.shape[1] <= 1 or C.stride(1) == 1, f"C must have unit column stride, got strides {C.stride()}"
    assert ref.dim() == 1 and ref.dtype in REF_DTYPES, (
        f"ref must be [N] uint8/int16/int32/int64, got {ref.dtype} {list(ref.shape)}")
    N, D = ref.shape[0], C.shape[1]
    assert mag.shape == (N,) and mag.dtype in MAG_DTYPES, (
        f"mag must be [N] = [{N}] fp16/bf16/fp32, got {mag.dtype} {list(mag.shape)}")
    assert out.shape == (N, D) and out.is_floating_point(), (
        f"out must be float [N, D] = [{N}, {D}], got {out.dtype} {list(out.shape)}")
    assert out.shape[1] <= 1 or out.stride(1) == 1, f"out must have unit column stride, got strides {out.stride()}"
    assert N <= 1 or out.stride(0) >= D, f"out rows overlap: strides {out.stride()} for shape {list(out.shape)}"
    tensors = [C, ref, mag, out]
    if pos is not None:
        assert pos.shape == (N,) and pos.dtype in POS_DTYPES, (
            f"pos must be [N] = [{N}] int32/int64, got {pos.dtype} {list(pos.shape)}")
        assert D % 2 == 0, f"RoPE needs an even D, got {D}"
        assert inv_freq is not None and inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32, (
            f"inv_freq must be fp32 [D/2] = [{D // 2}]")
        tensors += [pos, inv_freq]
    for t in tensors[1:]:
        assert t.device == C.device, f"all tensors must share a device, got {t.device} and {C.device}"
        assert t is out or t.is_contiguous(), f"1-D inputs must be contiguous, got stride {t.stride()}"


def reconstruct_triton(
    C: torch.Tensor,                         # [n, D]
    ref: torch.Tensor,                       # [N]
    mag: torch.Tensor,                       # [N]
    pos: torch.Tensor | None = None,         # [N]
    inv_freq: torch.Tensor | None = None,    # [D/2]
    attention_scaling: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,         # [N, D]; allocated when None
    block_n: int = 16,
    block_d: int | None = None,
) -> torch.Tensor:                           # [N, D]
    """Launch the fused reconstruction; checks the contract first (see `check_reconstruct_args`)."""
    if out is None:
        assert ref.dim() == 1 and C.dim() == 2, f"ref must be [N] and C [n, D], got {list(ref.shape)}, {list(C.shape)}"
        out = torch.empty((ref.shape[0], C.shape[1]), dtype=out_dtype, device=C.device)
    check_reconstruct_args(C, ref, mag, pos, inv_freq, out)
    require_triton()
    N, D = out.shape
    if N == 0 or D == 0:
        return out
    if pos is not None:                    # one block holds a whole half of the row; block_d ignored
        assert D // 2 <= MAX_BLOCK_D, f"RoPE half-dim {D // 2} exceeds {MAX_BLOCK_D}"
        block_d = pow2_at_least(D // 2)
    block_d = block_d or pow2_at_least(D, 1, MAX_BLOCK_D)
    assert block_d & (block_d - 1) == 0 and block_n & (block_n - 1) == 0, "block sizes must be powers of two"
    _reconstruct_kernel[(triton.cdiv(N, block_n),)](
        C, ref, mag, ref if pos is None else pos, mag if inv_freq is None else inv_freq, out,
        N, D, C.stride(0), out.stride(0), float(attention_scaling),
        HAS_ROPE=pos is not None, BLOCK_N=block_n, BLOCK_D=block_d)
    return out


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}   # (inv_freq bytes, device) -> cos, sin [P, D/2]


def _table(inv_freq: torch.Tensor, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of every position below n (at least), one column per frequency, computed once per
    inv_freq and grown by doubling: decode re-applies RoPE to every kept key at every step, a
    lookup is cheaper than sin/cos. [P, D/2] each, fp32."""
    key = (inv_freq.detach().cpu().numpy().tobytes(), str(device))
    got = _TABLES.get(key)
    if got is None or got[0].shape[0] < n:
        size = 1 << max(10, (n - 1).bit_length())
        ang = torch.arange(size, device=device, dtype=torch.float32)[:, None] * inv_freq.to(device, torch.float32)
        got = _TABLES[key] = (ang.cos(), ang.sin())
    return got


def _cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, D: int, scale: torch.Tensor | float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """pos: [...] -> cos, sin [..., D/2] fp32 at those positions, times `scale` ([...] or a float)."""
    assert inv_freq.shape[-1] * 2 == D, f"inv_freq must be [D/2] = [{D // 2}], got [{inv_freq.shape[-1]}]"
    if pos.numel() == 0:
        empty = torch.empty(*pos.shape, D // 2, device=pos.device)
        return empty, empty
    cos, sin = _table(inv_freq, int(pos.max()) + 1, pos.device)
    idx = pos.reshape(-1).long()
    c = cos.index_select(0, idx).view(*pos.shape, D // 2)                                      # [..., D/2]
    s = sin.index_select(0, idx).view(*pos.shape, D // 2)
    if isinstance(scale, torch.Tensor):
        scale = scale.float().unsqueeze(-1)
        return c.mul_(scale), s.mul_(scale)
    return (c, s) if scale == 1.0 else (c.mul_(scale), s.mul_(scale))


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x: [..., D] fp32, c, s: [..., D/2] -> [..., D]: x * cos + rotate_half(x) * sin, the halves
    written in place of a concatenation (4 half-width passes)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1.0)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    return out


def apply_rope(
    x: torch.Tensor,          # [..., D]
    pos: torch.Tensor,        # x.shape[:-1] (or broadcastable), integer positions
    inv_freq: torch.Tensor,   # [D/2]
    attention_scaling: float = 1.0,
) -> torch.Tensor:            # [..., D] fp32
    """HF Llama RoPE in fp32: x * cos + rotate_half(x) * sin, with cos/sin scaled."""
    c, s = _cos_sin(pos, inv_freq, x.shape[-1], attention_scaling)
    return _rotate(x.float(), c, s)


def unrotate_rope(
    x: torch.Tensor,          # [..., D] post-RoPE
    pos: torch.Tensor,        # x.shape[:-1] (or broadcastable)
    inv_freq: torch.Tensor,   # [D/2]
    attention_scaling: float = 1.0,
) -> torch.Tensor:            # [..., D] fp32 pre-RoPE
    """Inverse of `apply_rope`: the transposed rotation (sin negated), divided by the scaling."""
    c, s = _cos_sin(pos, inv_freq, x.shape[-1], 1.0 / attention_scaling)
    return _rotate(x.float(), c, s.neg_())


def reconstruct_reference(
    C: torch.Tensor,                         # [n, D]
    ref: torch.Tensor,                       # [N] uint8/int16/int32/int64
    mag: torch.Tensor,                       # [N]
    pos: torch.Tensor | None = None,         # [N]
    inv_freq: torch.Tensor | None = None,    # [D/2]
    attention_scaling: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:                           # [N, D]
    """What the kernel computes, in plain torch."""
    x = C.index_select(0, ref.long()).float()                           # [N, D]
    if pos is None:
        return x.mul_(mag.float()[:, None]).to(out_dtype)
    c, s = _cos_sin(pos, inv_freq, C.shape[1], mag.float() * attention_scaling)   # magnitude folded in
    return _rotate(x, c, s).to(out_dtype)
