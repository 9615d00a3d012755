"""A step's new K/V rows into the engine's pool: one layer's rows of every sequence, each to the
arena row its block table names (K there, V `R` rows after it), in the storage dtype.

    kernel      C++ on the CPU for fp32 or bf16 rows into fp16 storage (`write_kv` in
                `kernels/cpu_decoder_ops.cpp`: convert and scatter in one pass)
    launcher    `write_kv`: the kernel where it applies, else the reference
    reference   `write_kv_reference`: two `index_copy_` of the converted rows

Shapes: M rows written (a step's rows × KV heads), D head dim."""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.backend import backend


def write_kv_reference(rows: torch.Tensor, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: int) -> None:
    """rows [n, D] storage dtype; at [M] int64 K rows; k, v [M, D] -> rows[at] := k, rows[at + r] := v."""
    rows.index_copy_(0, at, k.to(rows.dtype))
    rows.index_copy_(0, at + r, v.to(rows.dtype))


def write_kv(rows: torch.Tensor, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: int) -> None:
    """rows [n, D] fp16 (the arena's rows); at [M] int64; k, v [M, D] fp32 or bf16 (the compute dtype)."""
    if (rows.dtype == torch.float16 and k.dtype in (torch.float32, torch.bfloat16) and v.dtype == k.dtype
            and backend(rows.device) == "cpp"):
        cpu_extension.module().write_kv(rows, at.contiguous(), k.contiguous(), v.contiguous(), r)
        return
    write_kv_reference(rows, at, k, v, r)
