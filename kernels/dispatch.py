"""The dispatched hot ops, one function per op: each validates its arguments (ValueError /
IndexError) and then runs the Triton kernel or its plain-torch reference (quantize_pack: the C++
loop on the CPU) as `kernels.backend` decides — Triton when it is importable and either every
tensor is on CUDA or the kernels run in the interpreter; otherwise the reference. Both paths
see only inputs the kernels' launchers accept.
"""
from __future__ import annotations

import torch

from kernels import codebook, gather, quant, rope_reconstruct, slerp
from kernels.backend import use_triton
from kernels import hamming
from kernels import lowbit_qk as lowbit


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x [N, D] with unit column stride (a copy only when it has not), as the launchers require."""
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


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
            _unit(C), ref.contiguous(), mag.contiguous(),
            pos_, freq_, attention_scaling, out_dtype)
    return rope_reconstruct.reconstruct_reference(C, ref, mag, pos, inv_freq, attention_scaling, out_dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride and non-overlapping rows, as the kernels' launchers require."""
    ok = (x.shape[1] <= 1 or x.stride(1) == 1) and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1])
    return x if ok else x.contiguous()


def slerp_merge(
    x0: torch.Tensor,                        # [N, D] rows of the pair's lower layer
    x1: torch.Tensor,                        # [N, D] rows of the upper layer
    t: float,                                # 0 -> x0's direction, 1 -> x1's (MiniCache Eq. 3)
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (direction [N, D] unit rows, mag0 [N], mag1 [N] in out_dtype, angle Ω [N] fp32 radians);
    see `kernels.slerp`."""
    if x0.dim() != 2 or x0.shape != x1.shape or x0.dtype not in slerp.DTYPES or x1.dtype not in slerp.DTYPES:
        raise ValueError(f"x0 and x1 must be fp16/bf16/fp32 [N, D] of one shape, got {x0.dtype} {list(x0.shape)} "
                         f"and {x1.dtype} {list(x1.shape)}")
    if not 0.0 <= t <= 1.0 or out_dtype not in slerp.DTYPES:
        raise ValueError(f"t must be in [0, 1] and out_dtype fp16/bf16/fp32, got t={t}, {out_dtype}")
    if use_triton(x0, x1):
        return slerp.slerp_merge_triton(_rows(x0), _rows(x1), t, out_dtype)
    return slerp.slerp_merge_reference(x0, x1, t, out_dtype)


def slerp_restore(
    direction: torch.Tensor,                 # [N, D]
    mag: torch.Tensor,                       # [N]
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:                           # [N, D]: direction * mag / ‖direction‖, row-wise
    """MiniCache Eq. 2; see `kernels.slerp`."""
    if direction.dim() != 2 or direction.dtype not in slerp.DTYPES:
        raise ValueError(f"direction must be an fp16/bf16/fp32 [N, D], got {direction.dtype} {list(direction.shape)}")
    if mag.shape != (direction.shape[0],) or mag.dtype not in slerp.DTYPES or out_dtype not in slerp.DTYPES:
        raise ValueError(f"mag must be fp16/bf16/fp32 [N] = [{direction.shape[0]}], got {mag.dtype} {list(mag.shape)}")
    if use_triton(direction, mag):
        return slerp.slerp_restore_triton(_rows(direction), mag.contiguous(), out_dtype)
    return slerp.slerp_restore_reference(direction, mag, out_dtype)


def _check_bits(bits: int, group_size: int) -> None:
    if bits not in quant.BITS:
        raise ValueError(f"bits must be one of {quant.BITS}, got {bits}")
    per = quant.per_byte(bits)
    if group_size < 1 or group_size % per:
        raise ValueError(f"group_size must be a positive multiple of {per} (codes per byte at {bits} bits), "
                         f"got {group_size}")


def quantize_pack(
    x: torch.Tensor,        # [N, L] fp16/bf16/fp32, L = G * group_size; groups are along the last axis
    bits: int,              # 1, 2, 4 or 8
    group_size: int,        # g, a multiple of 8 / bits
    midpoint: bool = False,  # 1 bit only: SpeCache's midpoint levels instead of min / max
    refine: int = 0,        # least-squares refits of each group's scale and zero (0: min/max as they are)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:   # codes [N, L * bits / 8] uint8, scale, zero [N, G] fp16
    """Per group of g consecutive elements of a row: asymmetric min/max quantization, codes
    packed 8 / bits to a byte (see `kernels.quant`)."""
    if midpoint and bits != 1:
        raise ValueError(f"midpoint quantization is 1-bit only, got bits={bits}")
    if isinstance(refine, bool) or not isinstance(refine, int) or not 0 <= refine <= quant.MAX_REFINE:
        raise ValueError(f"refine must be an int in 0..{quant.MAX_REFINE}, got {refine!r}")
    if x.dim() != 2 or x.dtype not in quant.X_DTYPES:
        raise ValueError(f"x must be a fp16/bf16/fp32 [N, L] tensor, got {x.dtype} shape {list(x.shape)}")
    _check_bits(bits, group_size)
    if x.shape[1] % group_size:
        raise ValueError(f"x's last dim L = {x.shape[1]} must be a multiple of group_size {group_size}")
    if use_triton(x):
        return quant.quantize_pack_triton(_unit(x), bits, group_size, midpoint=midpoint, refine=refine)
    if not midpoint and not refine and quant.quantize_pack_cpu_handles(x):
        return quant.quantize_pack_cpu(x, bits, group_size)
    return quant.quantize_pack_reference(x, bits, group_size, midpoint, refine)


def unpack_dequantize(
    codes: torch.Tensor,    # [N, L * bits / 8] uint8
    scale: torch.Tensor,    # [N, G] fp16, G = L / group_size
    zero: torch.Tensor,     # [N, G] fp16
    bits: int,
    group_size: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:          # [N, L] out_dtype
    """The inverse of `quantize_pack`: x = code * scale + zero per group."""
    _check_bits(bits, group_size)
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be a uint8 [N, B] tensor, got {codes.dtype} shape {list(codes.shape)}")
    n, L = codes.shape[0], codes.shape[1] * quant.per_byte(bits)
    if L % group_size:
        raise ValueError(f"codes hold L = {L} values a row at {bits} bits, not a multiple of group_size {group_size}")
    for name, t in (("scale", scale), ("zero", zero)):
        if t.dtype != quant.PARAM_DTYPE or t.shape != (n, L // group_size):
            raise ValueError(f"{name} must be fp16 [N, L / group_size] = [{n}, {L // group_size}], got {t.dtype} "
                             f"shape {list(t.shape)}")
    if out_dtype not in quant.X_DTYPES:
        raise ValueError(f"out_dtype must be fp16/bf16/fp32, got {out_dtype}")
    if use_triton(codes, scale, zero):
        return quant.unpack_dequantize_triton(_unit(codes), _unit(scale), _unit(zero), bits, group_size, out_dtype)
    return quant.unpack_dequantize_reference(codes, scale, zero, bits, group_size, out_dtype)


def hamming_distance(
    bits: torch.Tensor,     # [N, W] uint8/int32 packed bit vectors (`kernels.hamming.pack_bits`)
    anchor: torch.Tensor,   # [W] same dtype
) -> torch.Tensor:          # [N] int32: popcount(bits[n] XOR anchor)
    """KVCrush's distance of each token's head-behaviour bits to the anchor; see `kernels.hamming`."""
    if bits.dim() != 2 or bits.dtype not in hamming.WORD_DTYPES:
        raise ValueError(f"bits must be a uint8/int32 [N, W] tensor, got {bits.dtype} shape {list(bits.shape)}")
    if anchor.shape != (bits.shape[1],) or anchor.dtype != bits.dtype:
        raise ValueError(f"anchor must be {bits.dtype} [W] = [{bits.shape[1]}], "
                         f"got {anchor.dtype} {list(anchor.shape)}")
    if use_triton(bits, anchor):
        return hamming.hamming_distance_triton(_rows(bits), anchor.contiguous())
    return hamming.hamming_distance_reference(bits, anchor)


def lowbit_scores(
    q: torch.Tensor,        # [H, R, D] fp16/bf16/fp32: R query rows per KV head
    k_codes: torch.Tensor,  # [H, n, D, B] uint8: keys per channel in groups of g = B·8/bits tokens
    k_scale: torch.Tensor,  # [H, n, D] fp16
    k_zero: torch.Tensor,   # [H, n, D] fp16
    bits: int,
) -> torch.Tensor:          # [H, R, n·g] fp32
    """q · dequant(K)ᵀ straight from the packed keys (SpeCache's approximate scores); see
    `kernels.lowbit_qk`. Raises ValueError naming a bad argument."""
    lowbit.check_scores_args(q, k_codes, k_scale, k_zero, bits)
    if use_triton(q, k_codes, k_scale, k_zero):
        return lowbit.lowbit_scores_triton(q, k_codes, k_scale, k_zero, bits)
    return lowbit.lowbit_scores_reference(q, k_codes, k_scale, k_zero, bits)
