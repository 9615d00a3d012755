"""SpindleKV codebook (spec §2.8 Algorithm 1, §2.10 decode): unit directions shared by many vectors.

A scope's vectors x [N, D] become C [n, D] (unit rows, each an actual token's direction), a
reference ref [N] into C and the vectors' own norms mag [N]; `C[ref] * mag` reconstructs x within
angle arccos(theta). Greedy over the threshold graph G[a, b] = cos(x_a, x_b) > theta (self-loop
always on): pick the alive vertex of largest weighted degree (first on ties), make its direction an
entry, assign it and its alive neighbours, remove them, repeat. Degrees come from sum(G) — the
spec's fix for the listing's sum(S) — and are kept incrementally: removing a covered set R
subtracts, from every alive row, the weights of the columns in R it hits.

Tiled: G is never materialised. Degrees are computed in row tiles against all columns, and each
pick recomputes only its own covered set from xhat @ xhat[i] and the hits of alive rows against
those columns. The Triton part is that degree computation (`codebook_degree_triton`), used for the
initial degrees and for every decrement; the greedy loop itself is torch.

Zero-norm vectors (norm <= eps) take no part in the greedy and join entry 0: with norm 0 any unit
direction reconstructs them exactly. If every vector is zero-norm, C is the single row e_0 — the one
case where an entry is not a token's direction.

Cosines are compared in fp32 against fp32(theta). Degrees are fp32 sums of weights: exact for
integer multiplicities totalling < 2**24, so the incremental update then equals the literal
mask-and-resum loop (up to rounding of cosines within ~1e-7 of theta, which different matmul
shapes may classify differently).
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels._triton import HAS_TRITON, pow2_at_least, require_triton, tl, triton

DEFAULT_EPS = 1e-6
DEFAULT_TILE = 1024          # rows per degree tile: at most tile x N cosines exist at once

if HAS_TRITON:

    @triton.jit
    def _degree_kernel(
        xn_ptr,       # [N, D] fp32 unit rows, unit column stride
        row_ptr,      # [R] int64 row ids into xn
        col_ptr,      # [M] int64 column ids into xn
        w_ptr,        # [M] fp32 column weights
        out_ptr,      # [R] fp32
        R, M, D,
        stride_n,
        theta,
        BLOCK_R: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)     # one block of rows per program
        rmask = r < R
        rid = tl.load(row_ptr + r, mask=rmask, other=0)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for m0 in range(0, M, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            mmask = m < M
            cid = tl.load(col_ptr + m, mask=mmask, other=0)
            w = tl.load(w_ptr + m, mask=mmask, other=0.0)             # masked columns weigh 0
            cos = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                dmask = d < D
                a = tl.load(xn_ptr + rid[:, None] * stride_n + d[None, :],
                            mask=rmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]
                b = tl.load(xn_ptr + cid[:, None] * stride_n + d[None, :],
                            mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
                # ieee: TF32's ~1e-3 error is as large as 1 - theta_K
                cos = tl.dot(a, tl.trans(b), cos, input_precision="ieee")
            hit = (cos > theta) | (rid[:, None] == cid[None, :])
            acc += tl.sum(tl.where(hit, w[None, :], 0.0), axis=1)
        tl.store(out_ptr + r, acc, mask=rmask)


def check_degree_args(xn, rows, cols, w, out) -> None:
    """Launcher contract. xn: [N, D] fp32, unit column stride; rows: [R], cols: [M] contiguous int64
    ids into xn (not range-checked: that would synchronise a GPU); w: [M] contiguous fp32;
    out: [R] contiguous fp32; one device."""
    assert xn.dim() == 2, f"xn must be [N, D], got shape {list(xn.shape)}"
    assert xn.dtype == torch.float32, f"xn must be fp32 (normalized vectors), got {xn.dtype}"
    assert xn.shape[1] <= 1 or xn.stride(1) == 1, f"xn must have unit column stride, got strides {xn.stride()}"
    for name, t, dtype in (("rows", rows, torch.int64), ("cols", cols, torch.int64),
                           ("w", w, torch.float32), ("out", out, torch.float32)):
        assert t.dim() == 1, f"{name} must be 1-D, got shape {list(t.shape)}"
        assert t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"
        assert t.is_contiguous(), f"{name} must be contiguous, got stride {t.stride()}"
        assert t.device == xn.device, f"{name} is on {t.device}, xn on {xn.device}"
    assert w.shape == cols.shape, f"w must be [M] = [{cols.shape[0]}], got {list(w.shape)}"
    assert out.shape == rows.shape, f"out must be [R] = [{rows.shape[0]}], got {list(out.shape)}"


def codebook_degree_triton(
    xn: torch.Tensor,                 # [N, D] fp32 unit rows
    rows: torch.Tensor,               # [R] int64
    cols: torch.Tensor,               # [M] int64
    w: torch.Tensor,                  # [M] fp32
    theta: float,
    out: torch.Tensor | None = None,  # [R] fp32; allocated when None
    block_r: int = 32,
    block_m: int = 64,
    block_d: int | None = None,
) -> torch.Tensor:                    # [R] fp32
    """out[r] = sum_m w[m] * (xn[rows[r]] . xn[cols[m]] > theta or rows[r] == cols[m])."""
    if out is None:
        out = torch.empty(rows.shape, dtype=torch.float32, device=xn.device)
    check_degree_args(xn, rows, cols, w, out)
    require_triton()
    block_d = block_d or pow2_at_least(xn.shape[1], 16, 64)
    for name, b in (("block_r", block_r), ("block_m", block_m), ("block_d", block_d)):
        assert b >= 16 and b & (b - 1) == 0, f"{name} must be a power of two >= 16 (tl.dot), got {b}"
    R, M = rows.shape[0], cols.shape[0]
    if R == 0:
        return out
    _degree_kernel[(triton.cdiv(R, block_r),)](
        xn, rows, cols, w, out, R, M, xn.shape[1], xn.stride(0), float(theta),
        BLOCK_R=block_r, BLOCK_M=block_m, BLOCK_D=block_d)
    return out


def codebook_degree_reference(
    xn: torch.Tensor,      # [N, D] fp32 unit rows
    rows: torch.Tensor,    # [R] int64
    cols: torch.Tensor,    # [M] int64
    w: torch.Tensor,       # [M] fp32
    theta: float,
    max_elems: int = DEFAULT_TILE * 4096,
) -> torch.Tensor:         # [R] fp32
    """What the kernel computes, in row chunks holding at most max_elems cosines at a time."""
    out = torch.empty(rows.shape, dtype=torch.float32, device=xn.device)
    xc_t = xn.index_select(0, cols).T                                         # [D, M]
    step = max(1, max_elems // max(1, cols.shape[0]))
    for r0 in range(0, rows.shape[0], step):
        rid = rows[r0:r0 + step]                                              # [t]
        hit = (xn.index_select(0, rid) @ xc_t > theta) | (rid[:, None] == cols[None, :])   # [t, M]
        out[r0:r0 + step] = hit.to(torch.float32) @ w
    return out


DegreeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x32 = x.float()                                          # [N, D]
    mag = torch.linalg.vector_norm(x32, dim=1)               # [N]
    return x32 / mag.clamp_min(eps)[:, None], mag, mag <= eps


def build_codebook(
    x: torch.Tensor,                      # [N, D] any float dtype
    theta: float,
    weight: torch.Tensor | None = None,   # [N] multiplicities (> 0), None = all 1
    *,
    tile: int = DEFAULT_TILE,
    eps: float = DEFAULT_EPS,
    degree: DegreeFn | None = None,       # None: codebook_degree_reference tiled by `tile` rows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:   # C [n, D] fp32, ref [N] int64, mag [N] fp32
    """Algorithm 1 (incremental, tiled). See the module docstring for the rules."""
    assert x.dim() == 2, f"x must be [N, D], got shape {list(x.shape)}"
    assert x.is_floating_point(), f"x must be a float tensor, got {x.dtype}"
    N, D = x.shape
    dev = x.device
    if weight is None:
        w = torch.ones(N, dtype=torch.float32, device=dev)                   # [N]
    else:
        assert weight.shape == (N,), f"weight must be [N] = [{N}], got {list(weight.shape)}"
        w = weight.to(device=dev, dtype=torch.float32).contiguous()
        assert bool((w > 0).all()), "weights must be positive"
    if degree is None:
        degree = lambda *a: codebook_degree_reference(*a, max_elems=tile * max(N, 1))  # noqa: E731
    xn, mag, null = _normalize(x, eps)                                        # [N, D], [N], [N]
    xn = xn.contiguous()
    alive = ~null                                                             # [N] not yet covered
    live = alive.nonzero().squeeze(1)                                         # [L]
    deg = torch.full((N,), float("-inf"), device=dev)                         # [N]; -inf = removed
    deg[live] = degree(xn, live, live, w[live], theta)
    ref = torch.zeros(N, dtype=torch.int64, device=dev)                       # null vectors -> 0
    reps: list[int] = []                                                      # entry token ids
    tail = torch.zeros(0, dtype=torch.int64, device=dev)                      # isolated leftovers
    n_alive = live.numel()
    while n_alive:
        i = int(deg.argmax())                                                 # first max
        covered = alive & (xn @ xn[i] > theta)                                # [N]
        covered[i] = True
        R = covered.nonzero().squeeze(1)                                      # [|R|]
        ref[R] = len(reps)
        reps.append(i)
        alive &= ~covered
        deg[R] = float("-inf")
        n_alive -= R.numel()
        if not n_alive:
            break
        rows = alive.nonzero().squeeze(1)                                     # [n_alive]
        if R.numel() > 1:    # an isolated pick hits no alive row: nothing to subtract
            deg[rows] -= degree(xn, rows, R, w[R], theta)
        elif bool((deg[rows] <= w[rows]).all()):
            # every alive vertex is isolated: the rest of the greedy is a stable sort by degree
            order = rows[torch.sort(deg[rows], descending=True, stable=True).indices]
            ref[order] = len(reps) + torch.arange(order.numel(), device=dev)
            tail = order
            break
    if reps:
        C = xn[torch.cat([torch.tensor(reps, dtype=torch.int64, device=dev), tail])]   # [n, D]
    else:
        C = torch.zeros((1 if N else 0, D), device=dev)
        C[:, :1] = 1.0                                                        # e_0 for all-zero input
    return C, ref, mag


def mergeable_share(
    x: torch.Tensor,      # [N, D] any float dtype
    theta: float,
    sample: int = 256,
    eps: float = DEFAULT_EPS,
) -> float:
    """Upper estimate of the share of x's vectors with another vector above cosine theta — the
    most a codebook could merge — from `sample` evenly spaced rows against all N (sample x N
    cosines instead of N²): the sample share plus two binomial standard errors."""
    N = x.shape[0]
    if N < 2:
        return 0.0
    xn, _, _ = _normalize(x, eps)                                             # [N, D]
    rows = torch.linspace(0, N - 1, min(sample, N), device=x.device).round().long().unique()   # [S]
    cos = xn.index_select(0, rows) @ xn.T                                     # [S, N]
    cos[torch.arange(len(rows), device=x.device), rows] = -2.0                # not itself
    s = len(rows)
    share = float((cos > theta).any(dim=1).float().mean())
    return min(1.0, share + 2.0 * (max(share, 1.0 / s) * (1.0 - share) / s) ** 0.5) if s < N else share
