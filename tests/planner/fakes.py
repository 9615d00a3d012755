"""Probe statistics without a model: peaked, per-layer different window scores, and a probe
callable that counts its calls."""
from __future__ import annotations

import numpy as np

from kvcore.statistics import BITS, FRACTIONS, Losses, ProbeStats


def stats(m: int = 30, heads: int = 9, t: int = 4096, seed: int = 0) -> ProbeStats:
    """Window scores [m, heads, t], each row summing to 1: layer i's attention is sparse in
    proportion to i (deep layers concentrate on few tokens), so XKV's split differs by layer."""
    rng = np.random.default_rng(seed)
    ws = np.empty((m, heads, t), np.float32)
    for i in range(m):
        s = rng.pareto(0.5 + 3.0 * (m - i) / m, size=(heads, t)) + 1e-6      # [heads, t]
        ws[i] = s / s.sum(-1, keepdims=True)
    f = np.array(FRACTIONS)
    evict = (1.0 - f)[None, :] ** 2 * rng.uniform(0.05, 1.0, (m, 1))                  # [m, F], 0 when all kept
    quant = np.array([0.0, 1e-4, 3e-3, 0.08])[None, :] * rng.uniform(0.5, 2.0, (m, 1))  # [m, B], per BITS
    losses = Losses(fractions=f, evict=evict, retained=1.0 - evict / 2, bits=np.array(BITS), quant=quant)
    return ProbeStats(tokens=t, window_scores=ws, k_similar=np.zeros(m, np.float32),
                      v_similar=np.zeros(m, np.float32), k_angle=np.zeros(max(0, m - 1), np.float32),
                      v_angle=np.zeros(max(0, m - 1), np.float32), losses=losses)


class CountingProbe:
    """`probe()` returns fixed statistics and counts the calls; `calls` records token ids and mode
    when used as a Prober (`probe(token_ids, gqa_mode)`)."""

    def __init__(self, s: ProbeStats | None = None):
        self.s = s if s is not None else stats()
        self.calls: list = []

    def __call__(self, **kw) -> ProbeStats:
        self.calls.append(None)
        return self.s

    def probe(self, token_ids, gqa_mode: str = "repeat", losses: bool = False) -> ProbeStats:
        self.calls.append((list(token_ids), gqa_mode))
        return self.s
