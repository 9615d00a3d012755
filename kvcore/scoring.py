"""Token importance for eviction, computed by the executor from its own attention (the plan only
gives budgets): SnapKV observation window + pooling, H2O accumulated attention (in chunks,
never a full T x T matrix), StreamingLLM (no scores: sinks + recent window).

Scores come per query head; GQA `repeat` keeps them per query head, `mean` averages each KV
group's query heads (PyramidInfer/SnapKV style)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """x: [H_kv, T, D] -> [H_kv * n_rep, T, D], query head q reads KV head q // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=0)


def window_scores(q_win: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """SnapKV: q_win [H, W, D] (the last W queries, post-RoPE), k [H_kv, T, D] post-RoPE
    -> [H, T] attention mass the window pays each key (causal inside the window)."""
    h, w, _ = q_win.shape
    t = k.shape[1]
    kr = repeat_kv(k.float(), h // k.shape[0])
    logits = torch.einsum("hwd,htd->hwt", q_win.float(), kr) * scaling                     # [H, W, T]
    cols = torch.arange(t, device=k.device)
    rows = torch.arange(w, device=k.device)[:, None] + (t - w)
    logits.masked_fill_((cols[None, :] > rows)[None], float("-inf"))
    return logits.softmax(-1).sum(1)                                                          # [H, T]


def accumulate_attention(acc: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, scaling: float,
                         chunk: int = 256) -> torch.Tensor:
    """H2O: add the attention each key receives from the queries q [H, Tq, D] (the last Tq of
    the T keys k [H_kv, T, D]) to acc [H, T'] (T' <= T, grown with zeros) -> [H, T]."""
    h, tq, _ = q.shape
    t = k.shape[1]
    out = torch.zeros(h, t, device=k.device) if acc is None else F.pad(acc, (0, t - acc.shape[1]))
    kr = repeat_kv(k.float(), h // k.shape[0])
    cols = torch.arange(t, device=k.device)
    for s in range(0, tq, chunk):                                        # [H, c, T] at a time
        qc = q[:, s:s + chunk].float()
        logits = torch.einsum("hcd,htd->hct", qc, kr) * scaling
        rows = torch.arange(qc.shape[1], device=k.device)[:, None] + (t - tq + s)
        logits.masked_fill_((cols[None, :] > rows)[None], float("-inf"))
        out += logits.softmax(-1).sum(1)
    return out


def pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """scores: [H, T] -> [H, T], 1-D average pooling (odd kernel, same length)."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    k = kernel if kernel % 2 else kernel + 1
    return F.avg_pool1d(scores[:, None], k, stride=1, padding=k // 2, count_include_pad=False)[:, 0]


SPAN_TIE_BREAK = 2.0 ** -20     # relative score step per token behind a run's peak (fp32 resolves it)


def spread(scores: torch.Tensor, span: int) -> torch.Tensor:
    """Copy span [ours]: scores [H, T] -> [H, T], each token scored as high as the best of itself
    and the `span` tokens before it (a causal max filter; 0 = unchanged).

    Why: attention from the observation window peaks where an answer *starts* (the first digits
    of a number, the first word of a name); decoding then copies it token by token, each step
    reading the token after the one it just read (an induction step). Pooling is symmetric and
    keeps only a few tokens past the peak, so the copy runs off the end of what was kept (the
    answer comes out truncated). Letting a peak cover the next `span` tokens keeps the run.

    A run's tokens would tie at the peak's score, and where a budget ends inside a run `topk`
    picks among ties in no set order, so a cut run kept scattered tokens. Each token is instead
    scored a relative `SPAN_TIE_BREAK` lower per token it lies behind its peak: a cut run keeps
    its first tokens, the ones a copy reads first, and runs of different peaks keep their order."""
    if span <= 0 or scores.shape[-1] == 0:
        return scores
    ext = _cpu_kernels(scores.device) if scores.dim() == 2 and scores.dtype == torch.float32 else None
    if ext is not None:
        return ext.copy_span(scores.contiguous(), span)              # kernels/cpu_statistics.cpp: the same, bit for bit
    return spread_reference(scores, span)


def spread_reference(scores: torch.Tensor, span: int) -> torch.Tensor:
    """`spread` in plain torch (any device): a window's max and its first place by unfold."""
    if span <= 0 or scores.shape[-1] == 0:
        return scores
    padded = F.pad(scores, (span, 0), value=float("-inf"))                             # [H, span + T]
    peak, at = padded.unfold(-1, span + 1, 1).max(-1)                                  # [H, T] each; at: the first
    behind = span - at                                                                 # peak's place, 0..span; [H, T]
    return torch.where(peak.isfinite(), peak - behind * SPAN_TIE_BREAK * peak.abs(), peak)


def _cpu_kernels(device: torch.device | str = "cpu"):
    """The built CPU extension where `kernels.backend` picks it for `device` and it has `copy_span`
    (`kernels/cpu_statistics.cpp`), else None."""
    from kernels import cpu_extension
    from kernels.backend import backend
    ext = cpu_extension.module() if backend(device) == "cpp" else None
    return ext if ext is not None and hasattr(ext, "copy_span") else None


def group_mean(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """GQA `mean`: [H, T] -> [H_kv, T], each KV head scored by its query heads' mean."""
    h, t = scores.shape
    return scores.view(num_kv_heads, h // num_kv_heads, t).mean(1)


def ranking(scores: torch.Tensor, ev, num_kv_heads: int) -> torch.Tensor:
    """The ranking an eviction part keeps the top of: raw head scores [H, T] pooled, spread by
    the copy span, and in GQA `mean` mode averaged per KV group -> [stored heads, T]."""
    scores = spread(pool(scores, ev.pool_kernel), ev.span_tokens)
    return scores if ev.gqa_mode == "repeat" else group_mean(scores, num_kv_heads)


def select(scores: torch.Tensor | None, num_tokens: int, keep: int, window: int, sinks: int,
           heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Kept token indices per stored head: the first `sinks`, the top-`keep` of the context
    between them and the last `window` by score, and the window -> [heads, n] sorted, on the
    scores' device (without scores, `device`)."""
    device = scores.device if scores is not None else device
    window = min(window, num_tokens)
    sinks = min(sinks, num_tokens - window)
    lo, hi = sinks, num_tokens - window                              # scored context span
    keep = max(0, min(keep, hi - lo))
    fixed = torch.cat([torch.arange(sinks, device=device), torch.arange(hi, num_tokens, device=device)])
    if keep == 0:
        top = torch.empty(heads, 0, dtype=torch.long, device=device)
    elif keep == hi - lo:
        top = torch.arange(lo, hi, device=device).expand(heads, -1)
    else:
        top = scores[:, lo:hi].topk(keep, dim=-1).indices + lo
    rows = torch.cat([fixed.expand(heads, -1), top], dim=1)
    return rows.sort(dim=1).values
