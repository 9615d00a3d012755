"""Decode attention over dense fp16 K/V, fused for the CPU: one query row per head reads its KV
head's fp16 rows once, converting them in registers (F16C), never a float copy of the cache.

On this CPU decode at batch is bound by the bytes a step reads. The torch path converts each
layer's fp16 K/V to a new fp32 tensor (reading 2 bytes and writing 4 per element) and SDPA then
reads the 4-byte copy: 5 bytes of traffic per cached element instead of 2.

    kernel      C++ (`kernels/cpu_decode.cpp`, `dense_decode`; built by `kernels.cpu_extension`):
                a list of groups, each with its own rows (the KV heads of one layer of every
                sequence in a step, in one call); split-K over blocks of BLOCK rows
                (flash-decoding): each (group, block) task keeps its running max, sum and h
                accumulators, then a group's blocks combine in a fixed order — the same result
                whatever the thread count or the other groups of the call. torch's own thread
                pool. AVX2 + F16C + FMA for h <= 8 query heads per KV head and D in 32..128; any
                other shape runs a scalar loop of the same math. Optional per-group masks
                [h, T] (GQA `repeat` eviction: each query head sees its own rows).
                Faster than torch's convert + SDPA (docs/benchmarks.md, "Figures behind the code").
    launcher    `dense_decode_groups` (a list of groups) and `dense_decode` (one layer's
                [G, T, D] rows): check shapes and dtypes, else the reference
    reference   `dense_decode_reference`: the same math in plain torch (fp32 SDPA)

Shapes: G groups, h query heads per group, T rows, D head dim."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension

BLOCK = 256          # rows per split-K task
ENABLED = True       # False: every call takes the reference (benches compare both in one process)


def build() -> bool:
    """Build (or load the cached build of) the CPU decode kernels now -> whether they are there."""
    return cpu_extension.build()


def handles(k: torch.Tensor) -> bool:
    """Whether K/V stored like k get the kernel: fp16 on the CPU, the kernel built (first call builds it)."""
    return ENABLED and k.dtype == torch.float16 and k.device.type == "cpu" and cpu_extension.module() is not None


def dense_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [G, h, D] fp32; k, v [G, T, D] any float dtype; mask [G, h, T] bool (True = seen) or None
    -> [G, h, D] fp32: softmax(q·kᵀ·scaling)·v over the rows each head sees."""
    return F.scaled_dot_product_attention(q[:, None], k[:, None].float(), v[:, None].float(), scale=scaling,
                                          enable_gqa=True, attn_mask=None if mask is None else mask[:, None])[:, 0]


def _check(q: torch.Tensor, ks: list, vs: list, masks: list | None) -> None:
    if q.dim() != 3 or len(ks) != q.shape[0] or len(vs) != len(ks) or (masks is not None and len(masks) != len(ks)):
        raise ValueError(f"q must be [G, h, D] with a k, v (and mask) per group, got q {list(q.shape)} for "
                         f"{len(ks)} k, {len(vs)} v")
    h, d = q.shape[1], q.shape[2]
    for i, (k, v) in enumerate(zip(ks, vs)):
        if k.dim() != 2 or k.shape != v.shape or k.shape[1] != d:
            raise ValueError(f"group {i}: k, v must both be [T, {d}], got {list(k.shape)} and {list(v.shape)}")
        if masks is not None and masks[i] is not None and (tuple(masks[i].shape) != (h, k.shape[0])
                                                           or masks[i].dtype != torch.bool):
            raise ValueError(f"group {i}: mask must be bool [{h}, {k.shape[0]}], got {masks[i].dtype} "
                             f"{list(masks[i].shape)}")


def dense_decode_groups(q: torch.Tensor, ks: list, vs: list, masks: list | None, scaling: float) -> torch.Tensor:
    """q [G, h, D]; ks[i], vs[i] [T_i, D] group i's rows (fp16 for the kernel); masks: None, or per
    group [h, T_i] bool (True = seen) or None -> [G, h, D] fp32. The kernel when built and every
    group is fp16 on the CPU with rows to attend, else the reference group by group."""
    _check(q, ks, vs, masks)
    fast = all(handles(k) and v.dtype == torch.float16 and k.shape[0] > 0 and k.stride(1) == 1 and v.stride(1) == 1
               for k, v in zip(ks, vs))
    if not fast and masks is None and len({k.shape for k in ks}) == 1:        # one layer's rows: one call
        return dense_decode_reference(q, torch.stack(ks), torch.stack(vs), scaling)
    if not fast:
        return torch.stack([dense_decode_reference(q[i:i + 1], k[None], v[None], scaling,
                                                   None if masks is None or masks[i] is None else masks[i][None])[0]
                            for i, (k, v) in enumerate(zip(ks, vs))])
    return attend_groups_cpu(q, ks, vs, masks, scaling)


def attend_groups_cpu(q: torch.Tensor, ks: list, vs: list, masks: list | None, scaling: float) -> torch.Tensor:
    """The kernel itself, for callers whose groups passed `dense_decode_groups`' checks (fp16 rows
    on the CPU, each group's rows contiguous; `handles` says yes): the same arguments and result."""
    ms = [] if masks is None else [m.contiguous() if m is not None else _NONE for m in masks]
    return cpu_extension.module().dense_decode(q.float().contiguous(), ks, vs, ms, float(scaling), BLOCK)


_NONE = torch.empty(0, dtype=torch.bool)     # a group whose every row is seen, in a call with masks


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [G, h, D]; k, v [G, T, D] one layer's rows -> [G, h, D] fp32 (`dense_decode_groups`)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [G, h, D] and k, v [G, T, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    return dense_decode_groups(q, list(k.unbind(0)), list(v.unbind(0)), None, scaling)
