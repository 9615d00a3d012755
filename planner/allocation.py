"""Per-layer token budgets: uniform (SnapKV, H2O) and the linear pyramid (PyramidKV, SpindleKV).

Every count here is CONTEXT tokens kept per stored head: it excludes the always-kept part
(the last `l_w` window tokens, plus sinks where a strategy has them), exactly what
`Eviction.keep_tokens` means. Shapes: one entry per layer, `[m]`, layer 0 = shallowest.

The pyramid is SpindleKV's eqs. 5–7 (spec spindlekv.md §2.5–2.6), with the α branch
corrected to r_c(m−1) = 2·r_c − 1 so that the layer average equals r_c, and a flat schedule
(ours) for r_c ≤ β, which the paper leaves undefined.
"""
from __future__ import annotations

import numpy as np

BETA = 0.05   # minimal context ratio of any layer (SpindleKV Table 3); α = (1 + β) / 2
_EPS = 1e-9   # floors of products that are whole numbers in exact arithmetic must not drop by one


def uniform(total_keep: int, m: int) -> np.ndarray:
    """Split a model-wide total of kept context tokens evenly over m layers.

    Each layer gets ⌊total/m⌋; the remainder goes one token each to the shallowest layers,
    so the counts sum to `total_keep` exactly.  -> [m] int64
    """
    if m < 1 or total_keep < 0:
        raise ValueError(f"need m >= 1 and total_keep >= 0, got m={m}, total_keep={total_keep}")
    base, rest = divmod(int(total_keep), m)
    return np.full(m, base, dtype=np.int64) + (np.arange(m) < rest)


def context_ratio(r: float, l: int, l_w: int) -> float:
    """r_c = (r·l − l_w) / l_c (eq. 5): the context share that makes the total kept equal r·l.

    Clamped to [0, 1]; a prompt no longer than the window has no context and gives 1.0
    (keep everything).
    """
    l_c = l - l_w
    if l_c <= 0:
        return 1.0
    return min(1.0, max(0.0, (r * l - l_w) / l_c))


def pyramid_ratios(r: float, l: int, l_w: int, m: int, beta: float = BETA) -> np.ndarray:
    """Per-layer context ratios r_c(λ), linear from layer 0 down to layer m−1 (eq. 6).  -> [m] float64

    r: the eviction-stage reserve ratio (kept tokens / prompt tokens, window included);
    l: prompt tokens; l_w: always-kept tokens (the window); beta: the minimal layer ratio.
    End points (eq. 5, corrected):
      r_c ≤ β      : flat r_c in every layer
      β < r_c ≤ α  : (2·r_c − β, β)
      α < r_c      : (1, 2·r_c − 1)
    so the layer average equals r_c in every case.
    """
    if m < 1:
        raise ValueError(f"need m >= 1, got {m}")
    rc = context_ratio(r, l, l_w)
    alpha = (1.0 + beta) / 2.0
    if rc <= beta:
        top, bot = rc, rc
    elif rc <= alpha:
        top, bot = 2.0 * rc - beta, beta
    else:
        top, bot = 1.0, 2.0 * rc - 1.0
    if m == 1:
        return np.array([rc])
    lam = np.arange(m, dtype=np.float64)
    return np.clip(top + (bot - top) * lam / (m - 1), 0.0, 1.0)


def pyramid_keep_counts(r: float, l: int, l_w: int, m: int, beta: float = BETA) -> np.ndarray:
    """k_λ = ⌊r_c(λ) · l_c⌋ context tokens per stored head (eq. 7).  -> [m] int64

    A prompt no longer than the window has no context: every k_λ is 0 and the window keeps
    the whole prompt.
    """
    l_c = max(0, l - l_w)
    return np.floor(pyramid_ratios(r, l, l_w, m, beta) * l_c + _EPS).astype(np.int64)


def uniform_keep_counts(r: float, l: int, l_w: int, m: int) -> np.ndarray:
    """The same context count ⌊r·l⌋ − l_w (clamped to [0, l_c]) in every layer.  -> [m] int64"""
    l_c = max(0, l - l_w)
    per_layer = min(l_c, max(0, int(np.floor(r * l + _EPS)) - l_w))
    return uniform(m * per_layer, m)


# allocation name -> (r, l, l_w, m) -> [m] kept context tokens per layer
ALLOCATIONS = {
    "uniform": uniform_keep_counts,
    "pyramid": pyramid_keep_counts,
}
