"""The statistics a plan that comes after the context is made from: gathered inside the prefill, at
the context's last chunk of every layer (phase STATS), before any plan; compression itself is the
plan's press once the plan comes (`executor.presses`).

Shapes: H query heads, H_kv KV heads, T context rows, D head dim."""
from __future__ import annotations

import time

import torch

from kernels.rope_reconstruct import unrotate_rope


def gather(stats, queries: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           rope: tuple[torch.Tensor, float]) -> None:
    """The context's last chunk of a layer before any plan: q [H, Tq, D] its queries, k, v
    [H_kv, T, D] the whole context (post-RoPE keys, compute dtype) -> its statistics added to
    `stats`, its last queries appended to `queries` (`compress` uses them once the plan comes)."""
    t0 = time.perf_counter()
    keep = stats.keep_queries
    k_pre = unrotate_rope(k.float(), torch.arange(k.shape[1], device=k.device), *rope) if stats.shares else None
    stats.add(q[:, -keep:], k, k_pre, v, scaling)
    queries.append(q[:, -keep:].clone())
    stats.spent_s += time.perf_counter() - t0
