"""Decode attention of a KV group's query heads over its KIVI-quantized rows, fused for the CPU:
the packed codes are read once, in place — keys scored with the scale folded into the query and
the zero into one bias per key group, values summed with the probability folded into each
token's scale and the zeros summed apart per run of channels — never a dequantized copy of K or
V. At batch on this CPU decode is bound by the rows the step touches; the torch composition
(`quant_attend_reference`) makes a float copy of every code at every step.

    kernel      C++ (`kernels/cpu_decode.cpp`, `quant_decode`; built by `kernels.cpu_extension`):
                a list of groups (the KV heads of one layer of every sequence in a step, in one
                call), split-K over blocks of BLOCK quantized rows plus the dense fp16 tail as a
                block of its own, combined in a fixed order (the same result whatever the thread
                count or the other groups of the call); torch's thread pool. AVX2 paths for
                g = 32 at 2/4/8 bits, h <= 4, D 64 or 128 (codes unpacked eight lanes at a time,
                accumulated in the order the bytes hold them); any other shape a scalar loop.
    launcher    `QuantRows`: a group's quantized rows checked once and held until a flush makes
                new ones; `attend_groups_cpu` runs any number of groups alike in bits, g, g_v, D
                and h in one call, with their fp16 tails and masks
    reference   `quant_attend_reference`: the same math in plain torch

Layout (`executor.layers.quant.QuantGroup`): keys per channel in groups of g tokens, values per
token in runs of g_v channels, codes packed low bits first; the newest R rows dense.
Shapes: h query heads; n key groups; Q = n·g quantized rows; R tail rows; U = Q + R; D head dim."""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.quant import per_byte, unpack_dequantize_reference as unpack_dequantize

BLOCK = 256          # quantized rows per split-K task (whole key groups)


class QuantRows:
    """One KV group's quantized rows as the decode kernel reads them: checked once (contiguous)
    and held until the rows change — a flush makes a new one."""

    def __init__(self, k_codes: torch.Tensor,  # [n, D, g·b/8] uint8: keys per channel in groups of g tokens
                 k_scale: torch.Tensor,        # [n, D] fp16
                 k_zero: torch.Tensor,         # [n, D] fp16
                 v_codes: torch.Tensor,        # [Q = n·g, D·b/8] uint8: values per token
                 v_scale: torch.Tensor,        # [Q, D/g_v] fp16
                 v_zero: torch.Tensor,         # [Q, D/g_v] fp16
                 bits: int):
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
        if k_codes.dim() != 3 or v_codes.dim() != 2 or k_codes.dtype != torch.uint8 or v_codes.dtype != torch.uint8:
            raise ValueError(f"k_codes must be uint8 [n, D, B] and v_codes uint8 [Q, B], got {k_codes.dtype} "
                             f"{list(k_codes.shape)} and {v_codes.dtype} {list(v_codes.shape)}")
        n, d, g = k_codes.shape[0], k_codes.shape[1], k_codes.shape[2] * per_byte(bits)
        q_rows = v_codes.shape[0]
        if v_codes.shape[1] * per_byte(bits) != d or q_rows != n * g or not v_scale.shape[1] or d % v_scale.shape[1]:
            raise ValueError(f"codes do not match: k_codes {list(k_codes.shape)}, v_codes {list(v_codes.shape)}, "
                             f"v_scale {list(v_scale.shape)} at {bits} bits")
        if tuple(k_scale.shape) != (n, d) or k_zero.shape != k_scale.shape or v_scale.shape != v_zero.shape \
                or v_scale.shape[0] != q_rows:
            raise ValueError(f"scales and zeros must be k [{n}, {d}], v [{q_rows}, D/g_v]; got {list(k_scale.shape)}, "
                             f"{list(k_zero.shape)}, {list(v_scale.shape)}, {list(v_zero.shape)}")
        if any(t.dtype != torch.float16 for t in (k_scale, k_zero, v_scale, v_zero)):
            raise ValueError("scales and zeros must be fp16")
        self.tensors = tuple(t.contiguous() for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
        self.bits, self.g, self.gv, self.d, self.rows = bits, g, d // v_scale.shape[1], d, q_rows
        self.on_cpu = not k_codes.is_cuda

    def check(self, q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, mask: torch.Tensor | None) -> None:
        """q [h, D]; tails [R, D]; mask [h, Q + R] bool or None — else ValueError naming it."""
        d = self.d
        if q.dim() != 2 or q.shape[1] != d:
            raise ValueError(f"q must be [h, {d}], got {list(q.shape)}")
        if k_tail.shape != v_tail.shape or k_tail.dim() != 2 or k_tail.shape[1] != d:
            raise ValueError(f"tails must both be [R, {d}], got {list(k_tail.shape)} and {list(v_tail.shape)}")
        u = self.rows + k_tail.shape[0]
        if mask is not None and (tuple(mask.shape) != (q.shape[0], u) or mask.dtype != torch.bool):
            raise ValueError(f"mask must be bool [{q.shape[0]}, {u}], got {mask.dtype} {list(mask.shape)}")

    def attend_reference(self, q, k_tail, v_tail, mask, scaling: float) -> torch.Tensor:
        return quant_attend_reference(q, *self.tensors, k_tail, v_tail, mask, self.bits, scaling)


def handles(rows: list[QuantRows], tails: list) -> bool:
    """Whether these groups get the kernel: on the CPU, fp16 tails with contiguous rows, the kernel built."""
    return (all(r.on_cpu for r in rows) and all(t.dtype == torch.float16 and not t.is_cuda and t.stride(-1) == 1
                                                 for t in tails) and cpu_extension.module() is not None)


def attend_groups_cpu(rows: list[QuantRows], q: torch.Tensor, k_tails: list, v_tails: list, masks: list | None,
                      scaling: float) -> torch.Tensor:        # [G, h, D] fp32
    """The fused kernel over G groups at once (arguments as `QuantRows.check` accepts them, the
    groups alike in bits, g, g_v and D; `handles` says yes): q [G, h, D]; a tail pair [R_i, D]
    fp16 and a mask [h, U_i] (or None: every row seen) per group."""
    first = rows[0]
    kc, ks, kz, vc, vs, vz = (list(x) for x in zip(*(r.tensors for r in rows)))
    ms = [] if masks is None else [_ALL_SEEN if m is None else m.contiguous() for m in masks]
    return cpu_extension.module().quant_decode(q.float().contiguous(), kc, ks, kz, vc, vs, vz, list(k_tails),
                                               list(v_tails), ms, first.bits, first.g, first.gv, float(scaling), BLOCK)


_ALL_SEEN = torch.empty(0, dtype=torch.bool)     # a group whose every row is seen, in a call with masks


def quant_attend_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_tail, v_tail, mask, bits: int,
                           scaling: float) -> torch.Tensor:
    """What the kernel computes, in plain torch (dequantized copies of K and V). -> [h, D] fp32"""
    n, d = k_codes.shape[0], q.shape[1]
    g = k_codes.shape[2] * per_byte(bits)
    gv = d // v_scale.shape[1]
    k = unpack_dequantize(k_codes.reshape(n * d, k_codes.shape[2]), k_scale.reshape(-1, 1), k_zero.reshape(-1, 1), bits, g)
    k = torch.cat([k.view(n, d, g).transpose(1, 2).reshape(n * g, d), k_tail.float()])            # [U, D]
    v = torch.cat([unpack_dequantize(v_codes, v_scale, v_zero, bits, gv), v_tail.float()])          # [U, D]
    scores = (q.float() @ k.T) * scaling                                                           # [h, U]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
