"""XKV adaptive allocation (spec xkv.md §2.5–2.6, Algorithm 1): per-layer kept-token counts that
maximise the mean retained attention mass R_avg = mean_i Sum(TopK(n_i, w_i)) / Sum(w_i).

Input per layer i: the pooled observation-window scores w_i [H_s, T_c] (H_s scored heads, T_c
context tokens, window excluded). The marginal gain of the k-th slot of layer i is
G[i, k] = sum_h sort_desc(w_i[h])[k] / S_i (S_i sums all heads): non-increasing in k, so each
R_i(n) is concave and the greedy "take the largest gain next" is optimal. Vectorized, the
greedy is one global top-N over G (ties: lower layer first, then lower k — the literal loop's
order). Ours, on top of the paper: a per-layer floor (no layer left with zero slots: the
official code asserts > 0), counts capped at T_c, budgets larger than the context clamped, and
an R* target at or above what all tokens reach stops there instead of looping forever.

Shapes: L layers; counts are context tokens per scored head, window excluded ([L] int64).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Allocation:
    keep: np.ndarray          # [L] int64 context tokens kept per head, window excluded
    retained: np.ndarray      # [L] float64 R_i(keep_i): share of layer i's window attention kept

    @property
    def r_avg(self) -> float:
        return float(self.retained.mean()) if len(self.retained) else 1.0


def gains(scores: list[np.ndarray]) -> np.ndarray:
    """scores: L arrays [H_s, T_c] (non-negative; T_c may differ per layer) -> G [L, T_max],
    G[i, k] = k-th largest per-head score summed over heads / layer total; 0 past T_c."""
    t_max = max((s.shape[-1] for s in scores), default=0)
    g = np.zeros((len(scores), t_max))
    for i, s in enumerate(scores):
        s = np.asarray(s, dtype=np.float64)
        if s.ndim != 2 or (s < 0).any():
            raise ValueError(f"layer {i}: scores must be a non-negative [heads, tokens] array, got shape {s.shape}")
        total = s.sum()
        if s.shape[1] and total > 0:
            g[i, :s.shape[1]] = -np.sort(-s, axis=1).sum(0) / total
    return g


def _open(g: np.ndarray, floor: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """G with the floor's slots and the slots past each layer's tokens taken out (-inf). [L, T]"""
    k = np.arange(g.shape[1])[None, :]
    return np.where((k < floor[:, None]) | (k >= caps[:, None]), -np.inf, g)


def _take(g: np.ndarray, floor: np.ndarray, caps: np.ndarray, extra: int) -> np.ndarray:
    """The floor in every layer, then the `extra` largest gains among the slots left. -> [L] counts."""
    L, T = g.shape
    free = _open(g, floor, caps).ravel()                                             # [L·T]
    order = np.lexsort((np.arange(L * T), -free))                                    # gain desc, then (layer, k)
    picked = order[:extra]
    return floor + np.bincount(picked // T, minlength=L)


def allocate(scores: list[np.ndarray], total: int | None = None, r_target: float | None = None,
             floor: int = 1) -> Allocation:
    """Algorithm 1 in "N" mode (`total` slots over all layers) or "R" mode (`r_target` = R*:
    the fewest slots whose R_avg reaches it). Each layer gets at least min(floor, T_c) slots."""
    if (total is None) == (r_target is None):
        raise ValueError("give exactly one of total (slots) or r_target (R_avg)")
    g = gains(scores)
    L, T = g.shape
    caps = np.array([s.shape[-1] for s in scores], dtype=np.int64)                  # [L] T_c per layer
    fl = np.minimum(caps, max(0, int(floor)))
    room = int(caps.sum() - fl.sum())
    if total is not None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        keep = _take(g, fl, caps, min(room, max(0, int(total) - int(fl.sum()))))
    else:
        if not 0.0 <= r_target:
            raise ValueError(f"r_target must be >= 0, got {r_target}")
        base = np.where(np.arange(T)[None, :] < fl[:, None], g, 0.0).sum(1)         # [L] R_i at the floor
        rest = np.sort(_open(g, fl, caps).ravel())[::-1][:room]
        need = L * r_target - base.sum()
        reach = np.cumsum(rest)
        extra = 0 if need <= 1e-12 else int(np.searchsorted(reach, need - 1e-12) + 1)
        keep = _take(g, fl, caps, min(extra, room))
    retained = np.array([g[i, :k].sum() for i, k in enumerate(keep)])
    return Allocation(keep.astype(np.int64), retained)
