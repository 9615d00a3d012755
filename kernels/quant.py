"""Group-wise asymmetric quantization with bit packing (KIVI; SpeCache's low-bit copy).

Rows x [N, L] are cut into G = L / g groups of g consecutive elements. Per group (fp32 math):
    scale = fp16((max - min) / (2^bits - 1)),  zero = fp16(min)
    code  = clamp(floor((x - zero) / scale + 0.5), 0, 2^bits - 1)      (scale 0: code 0)
    x'    = code * scale + zero
so |x' - x| <= scale / 2, up to the fp16 rounding of min (|zero| * 2^-11). At 1 bit `midpoint`
(SpeCache's fix of KIVI, whose two levels min and max inflate magnitudes): scale = (max - min)/2,
zero = (3·min + max)/4, so the levels are the midpoints of the two half-ranges, (3·min+max)/4
and (min+3·max)/4; (x - zero)/scale spans [-0.5, 1.5] and the clamp keeps x = max at code 1.

`refine` r > 0 then refits scale and zero r times by least squares on the codes they gave
(Lloyd's iteration for a uniform grid; at 1 bit it moves the two levels to the means of the
values each code holds): with the group's codes q and m = g,
    scale = (m·Σqx - Σq·Σx) / (m·Σq² - (Σq)²),   zero = (Σx - scale·Σq) / m     (both to fp16)
and the codes are recomputed from the new pair (a group whose codes are all equal keeps its
pair). Each refit can only lower the group's squared error before the fp16 rounding; on
SmolLM2's keys (per channel, g = 32) three refits cut the relative error from 0.19 to 0.15 at
2 bits and from 0.31 to 0.28 at 1 bit (SpeCache's low-bit keys, `executor.presses.offload`: what that does to attention).

Codes of bits ∈ {1, 2, 4, 8} are packed P = 8 / bits to a uint8, little end first: value j of a
row sits in byte j // P at bit (j % P) * bits; g must be a multiple of P, so a group owns whole
bytes.

K per channel (groups of g tokens) and V per token (groups of g channels) both use this form:
the caller lays the grouped axis last (`executor.engine.block_tables`). Three pieces, as for every
kernel here: Triton kernels, their launchers (checking shapes, dtypes, strides), and the
plain-torch references that define them; `kernels.dispatch` picks one.
"""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels._triton import HAS_TRITON, pow2_at_least, require_triton, tl, triton
from kernels.backend import backend

BITS = (1, 2, 4, 8)
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PARAM_DTYPE = torch.float16        # scales and zeros
MAX_REFINE = 8                     # least-squares refits a call may ask for


def per_byte(bits: int) -> int:
    """Codes one uint8 holds."""
    return 8 // bits


if HAS_TRITON:

    @triton.jit
    def _grid_codes(x, s, z, BITS: tl.constexpr):
        """x [BLOCK_N, BLOCK_B, P], s, z [BLOCK_N] fp32 -> codes as fp32 (scale 0: code 0)."""
        safe = tl.where(s > 0, s, 1.0)
        q = tl.floor((x - z[:, None, None]) / safe[:, None, None] + 0.5)
        return tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1)

    @triton.jit
    def _quantize_pack_kernel(
        x_ptr,          # [N, L] fp16/bf16/fp32, unit column stride
        codes_ptr,      # [N, L / P] uint8, unit column stride
        scale_ptr,      # [N, G] fp16, unit column stride
        zero_ptr,       # [N, G] fp16, unit column stride
        N,
        stride_x, stride_c, stride_s, stride_z,
        GROUP: tl.constexpr,     # g
        BITS: tl.constexpr,
        PER: tl.constexpr,       # P = 8 // BITS
        BLOCK_N: tl.constexpr,
        BLOCK_B: tl.constexpr,   # >= g / P bytes of one group
        MIDPOINT: tl.constexpr,  # 1 bit: SpeCache's levels (3·min+max)/4 and (min+3·max)/4
        REFINE: tl.constexpr,    # least-squares refits of scale and zero
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)          # rows of this program
        g = tl.program_id(1)                                            # one group per program
        b = tl.arange(0, BLOCK_B)                                       # byte within the group
        j = tl.arange(0, PER)                                           # code within the byte
        nmask = n < N
        n64 = n.to(tl.int64)
        inner = b[:, None] * PER + j[None, :]                           # [BLOCK_B, P] column in group
        cmask = inner < GROUP
        mask = nmask[:, None, None] & cmask[None, :, :]
        x = tl.load(x_ptr + n64[:, None, None] * stride_x + (g * GROUP + inner)[None, :, :],
                    mask=mask, other=0.0).to(tl.float32)                # [BLOCK_N, BLOCK_B, P]
        mx = tl.max(tl.max(tl.where(cmask[None, :, :], x, float("-inf")), axis=2), axis=1)   # [BLOCK_N]
        mn = tl.min(tl.min(tl.where(cmask[None, :, :], x, float("inf")), axis=2), axis=1)
        if MIDPOINT:
            scale = ((mx - mn) / 2).to(tl.float16)
            zero = ((3 * mn + mx) / 4).to(tl.float16)
        else:
            scale = ((mx - mn) / ((1 << BITS) - 1)).to(tl.float16)
            zero = mn.to(tl.float16)
        s = scale.to(tl.float32)
        z = zero.to(tl.float32)
        q = _grid_codes(x, s, z, BITS)                                  # [BLOCK_N, BLOCK_B, P]
        sx = tl.sum(tl.sum(x, axis=2), axis=1)                          # [BLOCK_N]; masked columns loaded as 0
        for _ in tl.static_range(REFINE):
            qm = tl.where(cmask[None, :, :], q, 0.0)
            sq = tl.sum(tl.sum(qm, axis=2), axis=1)                     # [BLOCK_N]
            sqq = tl.sum(tl.sum(qm * qm, axis=2), axis=1)
            sqx = tl.sum(tl.sum(qm * x, axis=2), axis=1)
            det = GROUP * sqq - sq * sq
            ok = det > 0
            s = tl.where(ok, (GROUP * sqx - sq * sx) / tl.where(ok, det, 1.0), s)
            z = tl.where(ok, (sx - s * sq) / GROUP, z)
            scale = s.to(tl.float16)
            zero = z.to(tl.float16)
            s = scale.to(tl.float32)
            z = zero.to(tl.float32)
            q = _grid_codes(x, s, z, BITS)
        q = q.to(tl.int32)
        packed = tl.sum(q << (j * BITS)[None, None, :], axis=2)         # [BLOCK_N, BLOCK_B], disjoint bits
        bmask = nmask[:, None] & (b < GROUP // PER)[None, :]
        tl.store(codes_ptr + n64[:, None] * stride_c + g * (GROUP // PER) + b[None, :], packed.to(tl.uint8), mask=bmask)
        tl.store(scale_ptr + n64 * stride_s + g, scale, mask=nmask)
        tl.store(zero_ptr + n64 * stride_z + g, zero, mask=nmask)

    @triton.jit
    def _unpack_dequantize_kernel(
        codes_ptr,      # [N, L / P] uint8, unit column stride
        scale_ptr,      # [N, G] fp16, unit column stride
        zero_ptr,       # [N, G] fp16, unit column stride
        out_ptr,        # [N, L] fp16/bf16/fp32, unit column stride
        N,
        stride_c, stride_s, stride_z, stride_o,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        PER: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.program_id(1)
        b = tl.arange(0, BLOCK_B)
        j = tl.arange(0, PER)
        nmask = n < N
        n64 = n.to(tl.int64)
        bmask = nmask[:, None] & (b < GROUP // PER)[None, :]
        byte = tl.load(codes_ptr + n64[:, None] * stride_c + g * (GROUP // PER) + b[None, :],
                       mask=bmask, other=0).to(tl.int32)               # [BLOCK_N, BLOCK_B]
        q = (byte[:, :, None] >> (j * BITS)[None, None, :]) & ((1 << BITS) - 1)   # [BLOCK_N, BLOCK_B, P]
        s = tl.load(scale_ptr + n64 * stride_s + g, mask=nmask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + n64 * stride_z + g, mask=nmask, other=0.0).to(tl.float32)
        x = q.to(tl.float32) * s[:, None, None] + z[:, None, None]
        inner = b[:, None] * PER + j[None, :]
        mask = nmask[:, None, None] & (inner < GROUP)[None, :, :]
        tl.store(out_ptr + n64[:, None, None] * stride_o + (g * GROUP + inner)[None, :, :],
                 x.to(out_ptr.dtype.element_ty), mask=mask)


def _unit_columns(t: torch.Tensor, name: str) -> None:
    assert t.shape[1] <= 1 or t.stride(1) == 1, f"{name} must have unit column stride, got strides {t.stride()}"
    assert t.shape[0] <= 1 or t.stride(0) >= t.shape[1], (
        f"{name} rows overlap: strides {t.stride()} for {list(t.shape)}")


def check_quant_args(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     bits: int, group_size: int) -> None:
    """The launchers' contract (x is the input of `quantize_pack`, the output of
    `unpack_dequantize`); raises AssertionError naming what is wrong.

    x: [N, L] fp16/bf16/fp32; codes: [N, L / P] uint8; scale, zero: [N, L / g] fp16; all 2-D
    with unit column stride, rows not overlapping, one device; bits ∈ {1, 2, 4, 8}; g >= 1 a
    multiple of P = 8 / bits dividing L."""
    assert bits in BITS, f"bits must be one of {BITS}, got {bits}"
    per = per_byte(bits)
    assert group_size >= 1 and group_size % per == 0, (
        f"group_size must be a positive multiple of {per} (codes per byte at {bits} bits), got {group_size}")
    assert x.dim() == 2 and x.dtype in X_DTYPES, f"x must be fp16/bf16/fp32 [N, L], got {x.dtype} {list(x.shape)}"
    n, L = x.shape
    assert L % group_size == 0, f"L = {L} must be a multiple of group_size {group_size}"
    assert codes.dtype == torch.uint8 and codes.shape == (n, L // per), (
        f"codes must be uint8 [N, L / {per}] = [{n}, {L // per}], got {codes.dtype} {list(codes.shape)}")
    for name, t in (("scale", scale), ("zero", zero)):
        assert t.dtype == PARAM_DTYPE and t.shape == (n, L // group_size), (
            f"{name} must be fp16 [N, L / g] = [{n}, {L // group_size}], got {t.dtype} {list(t.shape)}")
    for name, t in (("x", x), ("codes", codes), ("scale", scale), ("zero", zero)):
        _unit_columns(t, name)
        assert t.device == x.device, f"all tensors must share a device, got {t.device} and {x.device}"


def _grid_blocks(n: int, L: int, bits: int, group_size: int, block_n: int) -> tuple[tuple[int, int], int]:
    assert block_n > 0 and block_n & (block_n - 1) == 0, f"block_n must be a power of two, got {block_n}"
    return (triton.cdiv(n, block_n), L // group_size), pow2_at_least(group_size // per_byte(bits))


def quantize_pack_triton(
    x: torch.Tensor,                 # [N, L]
    bits: int,
    group_size: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,   # codes, scale, zero; allocated when None
    block_n: int = 16,
    midpoint: bool = False,
    refine: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:   # codes [N, L / P] uint8, scale, zero [N, L / g] fp16
    """Launch the quantize-and-pack kernel; checks the contract first (`check_quant_args`)."""
    assert not midpoint or bits == 1, "the midpoint quantizer is 1-bit only"
    assert 0 <= refine <= MAX_REFINE, f"refine must be in 0..{MAX_REFINE}, got {refine}"
    if out is None:
        assert x.dim() == 2 and bits in BITS and group_size >= 1, (
            f"x must be [N, L], bits in {BITS}, group_size >= 1; got {list(x.shape)}, {bits}, {group_size}")
        n, L = x.shape
        out = (torch.empty(n, L * bits // 8, dtype=torch.uint8, device=x.device),
               torch.empty(n, L // group_size, dtype=PARAM_DTYPE, device=x.device),
               torch.empty(n, L // group_size, dtype=PARAM_DTYPE, device=x.device))
    codes, scale, zero = out
    check_quant_args(x, codes, scale, zero, bits, group_size)
    require_triton()
    n, L = x.shape
    if n == 0 or L == 0:
        return codes, scale, zero
    grid, block_b = _grid_blocks(n, L, bits, group_size, block_n)
    _quantize_pack_kernel[grid](x, codes, scale, zero, n, x.stride(0), codes.stride(0), scale.stride(0),
                                zero.stride(0), GROUP=group_size, BITS=bits, PER=per_byte(bits),
                                BLOCK_N=block_n, BLOCK_B=block_b, MIDPOINT=midpoint, REFINE=refine)
    return codes, scale, zero


def unpack_dequantize_triton(
    codes: torch.Tensor,             # [N, L / P] uint8
    scale: torch.Tensor,             # [N, L / g] fp16
    zero: torch.Tensor,              # [N, L / g] fp16
    bits: int,
    group_size: int,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,  # [N, L]; allocated when None
    block_n: int = 16,
) -> torch.Tensor:                    # [N, L] out_dtype
    """Launch the unpack-and-dequantize kernel; checks the contract first (`check_quant_args`)."""
    if out is None:
        assert codes.dim() == 2 and bits in BITS, (
            f"codes must be [N, B] and bits in {BITS}, got {list(codes.shape)}, {bits}")
        out = torch.empty(codes.shape[0], codes.shape[1] * per_byte(bits), dtype=out_dtype, device=codes.device)
    check_quant_args(out, codes, scale, zero, bits, group_size)
    require_triton()
    n, L = out.shape
    if n == 0 or L == 0:
        return out
    grid, block_b = _grid_blocks(n, L, bits, group_size, block_n)
    _unpack_dequantize_kernel[grid](codes, scale, zero, out, n, codes.stride(0), scale.stride(0), zero.stride(0),
                                    out.stride(0), GROUP=group_size, BITS=bits, PER=per_byte(bits),
                                    BLOCK_N=block_n, BLOCK_B=block_b)
    return out


def quantize_pack_reference(
    x: torch.Tensor,        # [N, L] fp16/bf16/fp32, L a multiple of group_size
    bits: int,
    group_size: int,
    midpoint: bool = False,
    refine: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:   # codes [N, L / P] uint8, scale, zero [N, L / g] fp16
    """What the kernel computes, in plain torch (vectorized over rows and groups)."""
    n, L = x.shape
    per, levels = per_byte(bits), (1 << bits) - 1
    xg, mn, mx = group_ranges(x, group_size)                                    # [N, G, g], [N, G] each
    if midpoint:                                                                # 1 bit: levels at 1/4 and 3/4
        scale, zero = ((mx - mn) / 2).to(PARAM_DTYPE), ((3 * mn + mx) / 4).to(PARAM_DTYPE)
    else:
        scale, zero = ((mx - mn) / levels).to(PARAM_DTYPE), mn.to(PARAM_DTYPE)
    s, z = scale.float(), zero.float()
    q = _codes(xg, s, z, levels)                                                # [N, G, g] fp32
    sx = xg.sum(-1) if refine else None                                         # [N, G]
    for _ in range(refine):                                                     # least-squares refits
        sq, sqq, sqx = q.sum(-1), (q * q).sum(-1), (q * xg).sum(-1)             # [N, G]
        det = group_size * sqq - sq * sq
        ok = det > 0
        s = torch.where(ok, (group_size * sqx - sq * sx) / torch.where(ok, det, torch.ones_like(det)), s)
        z = torch.where(ok, (sx - s * sq) / group_size, z)
        scale, zero = s.to(PARAM_DTYPE), z.to(PARAM_DTYPE)
        s, z = scale.float(), zero.float()
        q = _codes(xg, s, z, levels)
    q = q.to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=x.device) * bits        # [P]
    codes = (q.reshape(n, L // per, per) << shifts).sum(dim=-1).to(torch.uint8)  # [N, L / P]
    return codes, scale, zero


def quantize_pack_cpu_handles(x: torch.Tensor) -> bool:
    """Whether `quantize_pack_cpu` takes x: fp32 or fp16 on the CPU (any strides), the C++ built
    (`kernels.backend`)."""
    return x.dtype in (torch.float32, torch.float16) and backend(x.device) == "cpp"


def quantize_pack_cpu(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C++ loop of `kernels/cpu_decode.cpp` (min/max levels, no refits): bit for bit
    `quantize_pack_reference(x, bits, group_size)`, without a torch op per step of it — a quant
    layer's tail flushes a group of rows every g decode steps."""
    return tuple(cpu_extension.module().quantize_pack(x, bits, group_size))


def dequantized_forms(x: torch.Tensor, bits: list[int], group_size: int, quantized: int, rows: int) -> list[torch.Tensor]:
    """x [R, L] (or a batch [B, R, L]) fp32, any strides -> per bit width the same shape in fp32: the
    first `quantized` elements of the first `rows` rows through quantization at that width and back
    (`dequantized_at`, within fp32 rounding), the rest exact — every width from one pass over x
    (C++; `quantize_pack_cpu_handles`)."""
    return list(cpu_extension.module().dequantized_forms(x, list(bits), group_size, quantized, rows))


def group_ranges(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, L] -> (its groups [N, G, g] fp32, their min and max [N, G]): what quantization at any
    bit width starts from (`quantize_pack_reference`, `dequantized_at`)."""
    n, L = x.shape
    xg = x.float().reshape(n, L // group_size, group_size)
    return xg, xg.amin(dim=-1), xg.amax(dim=-1)


def dequantized_at(xg: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int) -> torch.Tensor:
    """`group_ranges`' groups through quantization at `bits` and back -> [N, L] fp32: what
    `unpack_dequantize(*quantize_pack(x, bits, g), bits, g)` gives (min/max levels, no refits), without
    packing the codes — the same fp16 scale and zero, the same codes, code * scale + zero in fp32."""
    levels = (1 << bits) - 1
    s, z = ((mx - mn) / levels).to(PARAM_DTYPE).float(), mn.to(PARAM_DTYPE).float()
    q = _codes(xg, s, z, levels)                                                # [N, G, g] fp32
    return torch.addcmul(z[..., None], q, s[..., None]).view(xg.shape[0], -1)


def _codes(xg: torch.Tensor, s: torch.Tensor, z: torch.Tensor, levels: int) -> torch.Tensor:
    """xg [N, G, g], s, z [N, G] fp32 -> codes [N, G, g] fp32 (scale 0: code 0)."""
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = xg - z[..., None]                                     # the same ops as floor((x - z) / s + 0.5), in place
    return q.div_(safe[..., None]).add_(0.5).floor_().clamp_(0, levels)


def unpack_dequantize_reference(
    codes: torch.Tensor,    # [N, L / P] uint8
    scale: torch.Tensor,    # [N, L / g] fp16
    zero: torch.Tensor,     # [N, L / g] fp16
    bits: int,
    group_size: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:          # [N, L] out_dtype
    """What the kernel computes, in plain torch: the codes unpacked (`unpack_codes`), then
    code * scale + zero per group."""
    n = codes.shape[0]
    q = unpack_codes(codes, bits).view(n, scale.shape[1], group_size)          # [N, G, g] fp32
    x = torch.addcmul(zero.float()[..., None], q, scale.float()[..., None])
    return x.view(n, scale.shape[1] * group_size).to(out_dtype)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., B] uint8 -> [..., B·P] fp32, the P codes of each byte low bits first. Below 8
    bits each byte's codes come from a [256, P] table (an embedding lookup: faster on CPU than
    indexing the table); at 8 bits a byte is its code (a plain conversion, faster still)."""
    if bits == 8:
        return codes.float()
    q = torch.nn.functional.embedding(codes.int(), _code_table(bits, codes.device))   # [..., B, P]
    return q.view(*codes.shape[:-1], codes.shape[-1] * per_byte(bits))


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _code_table(bits: int, device: torch.device) -> torch.Tensor:
    """[256, P] fp32: the P codes a byte holds, low bits first."""
    key = (bits, torch.device(device))
    if key not in _TABLES:
        b = torch.arange(256, dtype=torch.int32, device=device)[:, None]
        shifts = torch.arange(per_byte(bits), dtype=torch.int32, device=device) * bits
        _TABLES[key] = ((b >> shifts) & ((1 << bits) - 1)).float()
    return _TABLES[key]
