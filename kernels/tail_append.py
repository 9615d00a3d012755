"""A decode step's new K/V rows into the dense fp16 tails of a layer's KV groups.

A quant layer's groups each keep their newest rows dense in storage grown `kvcore.cost.TAIL_CHUNK`
rows at a time. Written from Python that is a convert, slices and copies per group, per K and V,
at every layer of every sequence, and a new storage every 8 steps: a sizeable share of a
16-sequence step in torch's per-op overhead, not bytes (docs/benchmarks.md, "Figures behind the
code"). One call per layer writes every group's rows, growing the tails that are full.

    kernel      C++ (`kernels/cpu_decode.cpp`, `append_tails`; built by `kernels.cpu_extension`):
                checks shapes, dtypes and room, then converts each row to fp16 (round to nearest
                even, as `Tensor.to(torch.float16)`) straight into its tail, or into a larger one
    launcher    `append_tails`: the kernel where it runs (CPU rows, fp16 tails, built), else the reference
    reference   `append_tails_reference`: the same in plain torch

Shapes: G groups, T new rows, D head dim; group i's tails [cap_i, D], at[i] rows of them used."""
from __future__ import annotations

import torch

from kernels import cpu_extension


def _room(at: int, t: int, cap: int, chunk: int, limit: int) -> int:
    """Rows a tail's storage needs for t more rows after `at`: its own where they fit, else
    rounded up to a chunk, at most `limit` (`kvcore.cost.tail_storage_rows` with the
    quant layer's chunk and limit)."""
    need = at + t
    return cap if need <= cap else min(-(-need // chunk) * chunk, limit)


def append_tails_reference(k: torch.Tensor, v: torch.Tensor, k_tails: list, v_tails: list, at: list[int],
                           chunk: int, limit: int) -> tuple[list, list]:
    t, caps = k.shape[1], []
    for i, (kt, a) in enumerate(zip(k_tails, at)):
        caps.append(_room(a, t, kt.shape[0], chunk, limit))
        if a + t > caps[-1]:
            raise ValueError(f"group {i}: rows {a}..{a + t} past its tail's limit of {limit}")
    outs = []
    for tails, x in ((k_tails, k), (v_tails, v)):
        grown = []
        for i, (tail, a, cap) in enumerate(zip(tails, at, caps)):
            if cap > tail.shape[0]:
                new = tail.new_empty(cap, tail.shape[1])
                new[:a] = tail[:a]
                tail = new
            tail[a:a + t] = x[i]
            grown.append(tail)
        outs.append(grown)
    return outs[0], outs[1]


def handles(k: torch.Tensor, tails: list) -> bool:
    """Whether the kernel writes these: rows on the CPU, fp16 tails (one layer's tails share a
    dtype; the kernel checks each and raises on a mismatch), the kernel built."""
    return k.device.type == "cpu" and tails[0].dtype == torch.float16 and cpu_extension.module() is not None


def append_tails(k: torch.Tensor, v: torch.Tensor, k_tails: list, v_tails: list, at: list[int],
                 chunk: int, limit: int) -> tuple[list, list]:
    """k, v [G, T, D] fp32 or fp16 (any strides); k_tails, v_tails: G tails [cap_i, D] of which at[i]
    rows are used -> (k_tails', v_tails'): each the same tail with the rows written in place, or a
    new one of `_room` rows holding its used rows then the new. An error (ValueError: reference;
    RuntimeError: kernel) before any write where even `limit` rows are too few."""
    if handles(k, k_tails):                               # the kernel checks the rest of every argument
        out = cpu_extension.module().append_tails(k, v, list(k_tails), list(v_tails), [int(a) for a in at],
                                                  chunk, limit)
        return out[:len(k_tails)], out[len(k_tails):]
    return append_tails_reference(k, v, k_tails, v_tails, at, chunk, limit)
