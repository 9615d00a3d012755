"""The passes over a layer's context that its statistics make (`kvcore.statistics.LayerStatistics.add`):
the observation window's attention summed per query head, with the loss queries' probabilities;
the loss queries' attention summed over disjoint sets of context rows, each row's set from its
rank, and each nested share's output error from those sums; the mean angle between the same rows
of two layers.

    kernel      C++ on the CPU with AVX-512 (`kernels/cpu_statistics.cpp`: `window_stats`,
                `segment_sums`, `mean_angle`; `segment_sums` with AVX2 too; `rank_sets`, `nested_errors` on any host): K transposed once into
                blocks of 64 keys, a block of query rows against 64 keys in registers; each set's
                rows listed and summed in registers; the ranks' cuts by nth_element, no full sort;
                norms and dot products of both rows in one pass
    launcher    `window_stats`, `segment_sums`, `rank_sets`, `nested_errors`, `mean_angle`: check the arguments, the kernel
                where built for this host, else the reference
    reference   `window_stats_reference`, `segment_sums_reference`, `rank_sets_reference`,
                `nested_errors_reference`, `mean_angle_reference`: plain torch

Shapes: G KV heads; gq query heads a KV head; w window rows, e <= w loss rows; T context rows; D
head dim; Q query rows a KV head; S sets."""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.backend import backend

DTYPES = (torch.float32, torch.bfloat16)


def window_stats_reference(q: torch.Tensor, k: torch.Tensor, w: int, e: int, scaling: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [G, gq·w, D] the window's queries (query head j of KV head g: rows j·w .. j·w + w - 1, the
    last at position T - 1), k [G, T, D] -> (s [G, gq, T] the probabilities each head's w rows pay
    each key, summed; last [G, gq·e, T] the last e rows' probabilities), fp32, causal in the window."""
    g, r, d = q.shape
    t = k.shape[1]
    logits = torch.matmul(q.float(), k.float().transpose(1, 2)).mul_(scaling).view(g, r // w, w, t)
    ahead = torch.ones(w, w, dtype=torch.bool, device=k.device).triu_(1)                    # [w, w] keys after the query
    logits[..., t - w:].masked_fill_(ahead, float("-inf"))
    probs = torch.softmax(logits, dim=-1)                                                   # [G, gq, w, T]
    return probs.sum(2), probs[:, :, w - e:].reshape(g, (r // w) * e, t)


def segment_sums_reference(p: torch.Tensor, v: torch.Tensor, seg: torch.Tensor, sets: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """p [G, Q, T] fp32, v [G, T, D], seg [G, T] int (each row's set, 0 .. sets - 1; -1: none) ->
    (num [G, S, Q, D] the sum of p·v over each set's rows, den [G, S, Q] the sum of p), fp32."""
    onehot = (seg.long()[:, None, :] == torch.arange(sets, device=p.device)[None, :, None]).float()   # [G, S, T]
    masked = p[:, None] * onehot[:, :, None]                                                # [G, S, Q, T]
    return torch.matmul(masked, v.float()[:, None]), masked.sum(-1)


def nested_errors_reference(num: torch.Tensor, den: torch.Tensor, upto: list[int]) -> torch.Tensor:
    """num [G, S, Q, D], den [G, S, Q] per-set sums (`segment_sums`), upto [F] set indices -> [F] fp32:
    share f's output (num / den over sets 0..upto[f]) against every set's num, the squared error
    summed over G, Q, D relative to the latter's squared sum."""
    num, den = num.float().cumsum(1), den.float().cumsum(1)
    exact = num[:, -1]                                                                      # [G, Q, D]
    outs = num[:, upto] / den[:, upto, :, None].clamp_min(1e-30)                            # [G, F, Q, D]
    return (outs - exact[:, None]).pow(2).sum((0, 2, 3)) / exact.pow(2).sum().clamp_min(1e-30)


def nested_errors(num: torch.Tensor, den: torch.Tensor, upto: list[int]) -> torch.Tensor:
    """As `nested_errors_reference`: the C++ loop for CPU tensors where the extension is built."""
    if num.dim() != 4 or den.shape != num.shape[:3]:
        raise ValueError(f"num must be [G, S, Q, D] and den [G, S, Q], got {list(num.shape)}, {list(den.shape)}")
    if any(not 0 <= u < num.shape[1] for u in upto):
        raise ValueError(f"upto must be set indices within 0..{num.shape[1] - 1}, got {list(upto)}")
    ext = cpu_extension.module() if backend(num.device) == "cpp" else None
    if ext is not None and hasattr(ext, "nested_errors"):
        return ext.nested_errors(num.float().contiguous(), den.float().contiguous(), [int(u) for u in upto])
    return nested_errors_reference(num, den, upto)


def rank_sets_reference(ranked: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """ranked [G, n], cuts ascending within 0..n -> [G, n] int32: 1 + how many cuts are <= each row's
    rank (rank 0: the highest score; equal scores: the earlier row first)."""
    g, n = ranked.shape
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices                 # [G, n] best first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=ranked.device).expand(g, -1))
    bounds = torch.tensor(cuts, dtype=rank.dtype, device=ranked.device)
    return (1 + torch.bucketize(rank, bounds, right=True)).int()


def rank_sets(ranked: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """As `rank_sets_reference`: the C++ kernel for CPU tensors where the extension is built."""
    if ranked.dim() != 2:
        raise ValueError(f"ranked must be [G, n], got {list(ranked.shape)}")
    n = ranked.shape[1]
    if any(not 0 <= c <= n for c in cuts) or list(cuts) != sorted(cuts):
        raise ValueError(f"cuts must be ascending within 0..{n}, got {list(cuts)}")
    ext = cpu_extension.module() if backend(ranked.device) == "cpp" else None
    if ext is not None and hasattr(ext, "rank_sets"):
        return ext.rank_sets(ranked.float().contiguous(), [int(c) for c in cuts])
    return rank_sets_reference(ranked, cuts)


def _kernels(built: str = "stats_kernels"):
    """The built extension where its `built()` says it has the kernels for this host, else None:
    "stats_kernels" all of them (AVX-512), "segment_kernel" `segment_sums` (AVX-512 or AVX2)."""
    ext = cpu_extension.module()
    return ext if ext is not None and hasattr(ext, built) and getattr(ext, built)() else None


def window_stats(q: torch.Tensor, k: torch.Tensor, w: int, e: int, scaling: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `window_stats_reference`: the C++ kernel for CPU fp32 or bf16 tensors where built."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [G, gq*w, D] and k [G, T, D], got {list(q.shape)}, {list(k.shape)}")
    if not 1 <= w <= k.shape[1] or q.shape[1] % w or not 0 <= e <= w:
        raise ValueError(f"w must divide q's {q.shape[1]} rows and be within 1..{k.shape[1]}, e within 0..w; "
                         f"got w={w}, e={e}")
    ext = _kernels() if backend(q.device) == "cpp" else None
    if ext is not None and q.dtype == k.dtype and q.dtype in DTYPES:
        return tuple(ext.window_stats(q.contiguous(), k.contiguous(), w, e, float(scaling)))
    return window_stats_reference(q, k, w, e, scaling)


def segment_sums(p: torch.Tensor, v: torch.Tensor, seg: torch.Tensor, sets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `segment_sums_reference`: the C++ kernel for CPU tensors (p fp32, v fp32 or bf16, D = 64)
    where built (AVX-512 or AVX2)."""
    if p.dim() != 3 or v.dim() != 3 or seg.shape != p.shape[::2] or v.shape[:2] != seg.shape:
        raise ValueError(f"p must be [G, Q, T], v [G, T, D] and seg [G, T], got {list(p.shape)}, {list(v.shape)}, "
                         f"{list(seg.shape)}")
    ext = _kernels("segment_kernel") if backend(p.device) == "cpp" else None
    if ext is not None and p.dtype == torch.float32 and v.dtype in DTYPES and v.shape[2] == 64:
        return tuple(ext.segment_sums(p.contiguous(), v.contiguous(), seg.to(torch.int32).contiguous(), sets))
    return segment_sums_reference(p, v, seg, sets)


def mean_angle_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [..., D] alike -> the mean over rows of arccos(cos(a, b)) / π, 0-d fp32 (the cosine from
    one product and two norms, their product at least 1e-8)."""
    a, b = a.float(), b.float()
    dots = torch.linalg.vecdot(a, b)
    norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return torch.arccos((dots / norms.clamp_min(1e-8)).clamp_(-1.0, 1.0)).mean() / torch.pi


def mean_angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """As `mean_angle_reference`: the C++ kernel for CPU fp32 or bf16 tensors alike (D a multiple
    of 16) where built."""
    if a.shape != b.shape or a.dim() < 1:
        raise ValueError(f"a and b must be [..., D] alike, got {list(a.shape)}, {list(b.shape)}")
    ext = _kernels() if backend(a.device) == "cpp" else None
    if ext is not None and a.dtype == b.dtype and a.dtype in DTYPES and a.shape[-1] % 16 == 0 and a.numel():
        return ext.mean_angle(a.contiguous(), b.contiguous())
    return mean_angle_reference(a, b)
