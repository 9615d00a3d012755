"""Per-layer option choice under one byte budget — a multiple-choice knapsack: each layer takes
exactly one option (a storage form at a size), the options' bytes add up to at most the
budget, and the sum of their predicted losses is as small as possible.

Solved exactly by dynamic programming over the budget cut into `resolution` units, options'
bytes rounded to the nearest unit; if that answer overshoots in real bytes, again with bytes
rounded UP (a choice that fits in units then fits in bytes).
Cost: m x O x resolution (30 layers x 40 options x 2048 units: 2.5 M cells, a few ms)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Choice:
    option: np.ndarray      # [m] the option each layer takes
    loss: float             # sum of the chosen losses
    bytes: float            # sum of the chosen bytes (<= budget whenever any choice fits)


def choose(loss: np.ndarray, cost: np.ndarray, budget: float, resolution: int = 2048) -> Choice:
    """loss, cost: [m, O] per layer and option (inf loss = not allowed); budget: total bytes.
    When even the cheapest allowed options overshoot, each layer takes its cheapest one."""
    loss, cost = np.asarray(loss, np.float64), np.asarray(cost, np.float64)
    if loss.shape != cost.shape or loss.ndim != 2:
        raise ValueError(f"loss and cost must be [m, O] alike, got {loss.shape} and {cost.shape}")
    if not np.isfinite(loss).any(axis=1).all():
        raise ValueError("every layer needs at least one allowed option (finite loss)")
    m, o = loss.shape
    rows = np.arange(m)
    cheapest = np.where(np.isfinite(loss), cost, np.inf).argmin(1)                          # [m]
    if cost[rows, cheapest].sum() > budget:
        return Choice(cheapest, float(loss[rows, cheapest].sum()), float(cost[rows, cheapest].sum()))
    unit = budget / resolution if budget > 0 else 1.0
    for rounding in (np.round, np.ceil):
        option = _dp(loss, np.asarray(rounding(cost / unit), np.int64).clip(0), resolution)
        if cost[rows, option].sum() <= budget:
            break
    return Choice(option, float(loss[rows, option].sum()), float(cost[rows, option].sum()))


def _dp(loss: np.ndarray, units: np.ndarray, resolution: int) -> np.ndarray:
    """loss [m, O], units [m, O] int -> [m] options of least total loss within `resolution` units."""
    m, o = loss.shape
    best = np.full(resolution + 1, np.inf)                                                  # best[b]: least loss spending <= b
    best[:] = 0.0
    back = np.zeros((m, resolution + 1), np.int64)
    b = np.arange(resolution + 1)
    for i in range(m):
        cand = np.full((o, resolution + 1), np.inf)
        for j in range(o):
            if np.isfinite(loss[i, j]) and units[i, j] <= resolution:
                cand[j, units[i, j]:] = best[: resolution + 1 - units[i, j]] + loss[i, j]
        back[i] = cand.argmin(0)
        best = cand[back[i], b]
    option = np.zeros(m, np.int64)
    left = resolution
    for i in range(m - 1, -1, -1):
        option[i] = back[i, left]
        left -= units[i, option[i]]
    return option
