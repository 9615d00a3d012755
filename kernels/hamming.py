"""Hamming distance of packed bit vectors to one anchor: out[n] = popcount(bits[n] XOR anchor),
summed over the row's W words — KVCrush's grouping key (spec kvcrush.md §2.4 step 1).

Packing (`pack_bits`): bit h of a vector lives in word h // B at bit position h % B (least
significant bit first), B = 8 for uint8 words, 32 for int32 words (bit 31 is the sign bit; the
kernel reads the word's bits, not its value). Unused high bits of the last word are 0 in the
vectors and in the anchor alike, so they never count.

The Triton kernel counts bits with the SWAR popcount (shift / mask / add on uint32; the
interpreter has no libdevice `popc`); the reference XORs in torch and looks each byte up in a
256-entry table. Three pieces as for every kernel here: Triton kernel, launcher that checks the
contract, torch reference; `kernels.dispatch.hamming_distance` chooses between them.
"""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, INTERPRETED, pow2_at_least, require_triton, tl, triton  # noqa: F401

WORD_DTYPES = {torch.uint8: 8, torch.int32: 32}
MAX_BLOCK_W = 64
POPCOUNT8 = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)   # [256]


if HAS_TRITON:

    @triton.jit
    def _popcount32(x):
        """x: uint32 block -> the number of set bits of each element (uint32)."""
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        x = x + (x >> 8)
        x = x + (x >> 16)
        return x & 0x3F

    @triton.jit
    def _hamming_kernel(
        bits_ptr,       # [N, W] uint8/int32 words, unit column stride
        anchor_ptr,     # [W] same dtype, contiguous
        out_ptr,        # [N] int32, contiguous
        N, W,
        stride_n,
        WORD_BITS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)        # BLOCK_N rows per program
        nmask = n < N
        n64 = n.to(tl.int64)
        acc = tl.zeros([BLOCK_N], dtype=tl.int32)
        for w0 in range(0, W, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            wmask = w < W
            mask = nmask[:, None] & wmask[None, :]
            b = tl.load(bits_ptr + n64[:, None] * stride_n + w[None, :], mask=mask, other=0)
            a = tl.load(anchor_ptr + w, mask=wmask, other=0)
            x = b ^ a[None, :]                                           # masked lanes: 0 ^ 0
            if WORD_BITS == 8:
                x = x.to(tl.uint32)                                      # zero-extend the byte
            else:
                x = x.to(tl.uint32, bitcast=True)                        # same 32 bits, unsigned shifts
            acc += tl.sum(_popcount32(x).to(tl.int32), axis=1)
        tl.store(out_ptr + n, acc, mask=nmask)


def check_hamming_args(bits: torch.Tensor, anchor: torch.Tensor, out: torch.Tensor) -> None:
    """The launcher's contract; raises AssertionError naming what is wrong.

    bits: [N, W] uint8/int32 with unit column stride and non-overlapping rows; anchor: [W] same
    dtype, contiguous; out: [N] int32 contiguous; one device."""
    assert bits.dim() == 2, f"bits must be [N, W], got shape {list(bits.shape)}"
    assert bits.dtype in WORD_DTYPES, f"bits must be uint8 or int32 words, got {bits.dtype}"
    assert anchor.shape == (bits.shape[1],), f"anchor must be [W] = [{bits.shape[1]}], got {list(anchor.shape)}"
    assert anchor.dtype == bits.dtype, f"anchor dtype {anchor.dtype} differs from bits dtype {bits.dtype}"
    assert anchor.is_contiguous(), f"anchor must be contiguous, got stride {anchor.stride()}"
    assert out.shape == (bits.shape[0],), f"out must be [N] = [{bits.shape[0]}], got {list(out.shape)}"
    assert out.dtype == torch.int32, f"out must be int32, got {out.dtype}"
    assert out.is_contiguous(), f"out must be contiguous, got stride {out.stride()}"
    assert bits.device == anchor.device == out.device, (
        f"bits, anchor, out must share a device, got {bits.device}, {anchor.device}, {out.device}")
    assert bits.shape[1] <= 1 or bits.stride(1) == 1, f"bits must have unit column stride, got strides {bits.stride()}"
    assert bits.shape[0] <= 1 or bits.stride(0) >= bits.shape[1], (
        f"bits rows overlap: strides {bits.stride()} for shape {list(bits.shape)}")


def hamming_distance_triton(
    bits: torch.Tensor,               # [N, W] uint8/int32 packed bit vectors
    anchor: torch.Tensor,             # [W] same dtype
    out: torch.Tensor | None = None,  # [N] int32; allocated when None
    block_n: int = 32,
    block_w: int | None = None,
) -> torch.Tensor:                    # [N] int32
    """Launch the Triton Hamming distance; checks the contract first (see `check_hamming_args`)."""
    if out is None:
        assert bits.dim() == 2, f"bits must be [N, W], got shape {list(bits.shape)}"
        out = torch.empty(bits.shape[0], dtype=torch.int32, device=bits.device)
    check_hamming_args(bits, anchor, out)
    require_triton()
    N, W = bits.shape
    if N == 0:
        return out
    if W == 0:
        return out.zero_()
    bw = block_w or pow2_at_least(W, 1, MAX_BLOCK_W)
    assert bw & (bw - 1) == 0 and block_n & (block_n - 1) == 0, "block sizes must be powers of two"
    _hamming_kernel[(triton.cdiv(N, block_n),)](
        bits, anchor, out, N, W, bits.stride(0),
        WORD_BITS=WORD_DTYPES[bits.dtype], BLOCK_N=block_n, BLOCK_W=bw)
    return out


def hamming_distance_reference(
    bits: torch.Tensor,     # [N, W] uint8/int32 packed bit vectors
    anchor: torch.Tensor,   # [W] same dtype
) -> torch.Tensor:          # [N] int32
    """What the kernel computes, in plain torch: popcount(bits XOR anchor) summed over words."""
    x = (bits ^ anchor[None, :]).contiguous()                  # [N, W]
    per_byte = x.view(torch.uint8).long()                      # [N, W * bytes per word]
    return POPCOUNT8.to(x.device)[per_byte].sum(1, dtype=torch.int32)


def pack_bits(
    bits: torch.Tensor,             # [N, H] bool
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:                  # [N, ceil(H / B)] dtype, B = 8 (uint8) or 32 (int32)
    """Pack each row's H bits into words, bit h -> word h // B, bit position h % B (LSB first)."""
    assert bits.dim() == 2 and bits.dtype == torch.bool, (
        f"bits must be a bool [N, H], got {bits.dtype} {list(bits.shape)}")
    assert dtype in WORD_DTYPES, f"words must be uint8 or int32, got {dtype}"
    B = WORD_DTYPES[dtype]
    n, h = bits.shape
    w = -(-h // B)
    padded = torch.zeros(n, w * B, dtype=torch.int64, device=bits.device)
    padded[:, :h] = bits.long()
    weights = torch.ones(B, dtype=torch.int64, device=bits.device) << torch.arange(B, device=bits.device)  # [B]
    words = (padded.view(n, w, B) * weights).sum(-1)                           # [N, W] in [0, 2^B)
    if B == 32:
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)    # two's complement: the same 32 bits
    return words.to(dtype)
