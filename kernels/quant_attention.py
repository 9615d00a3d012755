"""Attention of a layer's last queries over its K/V as the pool's KIVI groups would store them, at
several bit widths: the outputs the statistics' quant losses compare with the exact one
(`kvcore.statistics.layer_losses`).

    kernel      C++ on the CPU (`kernels/cpu_quant_attention.cpp`, `quant_attention`): each width's
                quantized copy made group by group and attended flash-style, never stored
    launcher    `quant_attention`: checks the arguments, the kernel for CPU K/V in fp32 or bf16, else the reference
    reference   `quant_attention_reference`: every width's K and V dequantized whole
                (`kernels.quant`, the pool's quantization), then plain attention

Groups (`kvcore.blocks.quant_shape`): at b bits K is quantized per channel over groups of g_b rows,
V per row over groups of gcd(value group, D) channels; rows past T - T mod g_b stay exact (the pool's
dense tail). Queries are grouped by KV head, head-major: row r of a head sits at position
T - Wq + r mod Wq and sees rows 0..that (`kvcore.statistics._grouped_probs`' layout).

Shapes: G KV heads, Qn = g·Wq query rows per head, T rows, D head dim, B widths."""
from __future__ import annotations

import math

import torch

from kernels import cpu_extension
from kernels.backend import backend
from kvcore.blocks import quant_shape


KV_DTYPES = (torch.float32, torch.bfloat16)      # what the kernel reads K and V in


def groups(bits: int, d: int) -> tuple[int, int]:
    """A width's (K group rows, V group channels) for head dim d: the pool's (`quant_shape`)."""
    rows, value_group = quant_shape(bits)
    return rows, math.gcd(value_group, d)


def quantized(k: torch.Tensor, v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [G, T, D] -> their copies through quantization at `bits` and back, fp32 (the reference's)."""
    from kernels.quant import dequantized_at, group_ranges
    g, t, d = k.shape
    rows, vg = groups(bits, d)
    q_t = t - t % rows
    k, v = k.float().clone(), v.float().clone()
    if q_t:
        kt = k[:, :q_t].transpose(1, 2).reshape(g * d, q_t)
        k[:, :q_t] = dequantized_at(*group_ranges(kt, rows), bits).view(g, d, q_t).transpose(1, 2)
        v[:, :q_t] = dequantized_at(*group_ranges(v[:, :q_t].reshape(-1, d), vg), bits).view(g, q_t, d)
    return k, v


def quant_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: list[int], wq: int,
                              scaling: float) -> torch.Tensor:
    """q [G, Qn, D], k, v [G, T, D] -> [B, G, Qn, D] fp32: per width, softmax(q·k̂ᵀ·scaling, causal)·v̂."""
    g, qn, d = q.shape
    t = k.shape[1]
    pos = t - wq + torch.arange(qn, device=q.device) % wq
    seen = torch.arange(t, device=q.device)[None, :] <= pos[:, None]                 # [Qn, T]
    outs = []
    for b in bits:
        kq, vq = quantized(k, v, b)
        logits = torch.matmul(q.float(), kq.transpose(1, 2)).mul_(scaling).masked_fill_(~seen, float("-inf"))
        outs.append(torch.bmm(torch.softmax(logits, dim=-1), vq))
    return torch.stack(outs)


def quant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: list[int], wq: int,
                    scaling: float) -> torch.Tensor:
    """q [G, Qn, D], k, v [G, T, D] -> [B, G, Qn, D] fp32. The C++ kernel for CPU K/V in fp32 or bf16
    (widened as it reads them) where built (contiguous copies made here), else the reference."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [G, Qn, D] and k, v [G, T, D] alike, got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    if not 1 <= wq <= k.shape[1] or q.shape[1] % wq:
        raise ValueError(f"wq must divide the {q.shape[1]} query rows and be within 1..{k.shape[1]}, got {wq}")
    ext = cpu_extension.module() if backend(q.device) == "cpp" else None
    if ext is not None and hasattr(ext, "quant_attention") and k.dtype == v.dtype and k.dtype in KV_DTYPES:
        widths = [groups(b, q.shape[2]) for b in bits]
        return ext.quant_attention(q.float().contiguous(), k.contiguous(), v.contiguous(), list(bits),
                                   [r for r, _ in widths], [c for _, c in widths], wq, float(scaling))
    return quant_attention_reference(q, k, v, bits, wq, scaling)
