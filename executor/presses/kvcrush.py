"""KVCrush on top of any scoring eviction (spec kvcrush.md): a layer's budget of `keep` context
tokens per stored head is split into B_imp = keep − B_rep tokens the base scorer ranks highest
(as plain eviction) and B_rep = round(rep_fraction · keep) representatives of the tokens no head
kept: one per group of tokens whose heads behave alike.

  1. Bits (§2.2). Per query head h, bit[j, h] = 1 iff token j is among the head's top
     ⌊q · M⌋ tokens of the candidate span C (the M context tokens between the sinks and the
     observation window), q = BIT_KEEP_FRACTION = 0.5 — "Recommended default: bit_keep_fraction
     q = 0.5, implemented with top-k rather than a quantile so ties cannot skew the count", with
     "The threshold is computed over the candidate region C (sinks and recent window excluded),
     as both implementations do". The statistic is the base scorer's per-query-head attention
     before pooling/spreading (those are the base method's importance tweaks): snapkv, the mass
     the observation window pays each token (`scoring.window_scores`); h2o, its accumulated
     attention divided by the number of queries that saw the token, T − j (NORM_SUM, §2.1 and §6
     "Statistic bias … Use observation-window scores (SnapKV) or count normalisation (NORM_SUM)
     both for importance and for the bits" — we apply it to the bits only; importance stays
     the scorer's). StreamingLLM ranks nothing, so KVCrush has nothing to add there.
  2. Eligible set E = C minus the union over stored heads of their base picks (§2.8:
     "Recommended: make E the complement of the union over heads of the per-head important
     sets. The shared R then never duplicates a head's own picks, and every head keeps the same
     count B_imp + |R|").
  3. Anchor (§2.3): random (Bernoulli(0.5) from a generator seeded with SEED, the same for every
     layer and run), mean (bitwise majority over E, a tie at 0.5 gives 0), alternate (0,1,0,1…
     from index 0); zeros / ones as in OpenVINO.
  4. d_j = popcount(b_j XOR a) on packed int32 words (`kernels.hamming_distance`), a stable
     sort on (d, position), and B_rep equal-count buckets along that order (§2.4), one
     representative each. bucket_rule: `uniform` — bucket i is sorted[⌊iS/B_rep⌋ :
     ⌊(i+1)S/B_rep⌋] and its middle member represents it (deterministic; OpenVINO takes the
     first, the paper a random one); `linspace` — the vLLM PR's ⌊linspace(0, S−1, B_rep)⌋;
     `random` — the paper's random member per bucket, from the seeded generator.

GQA (§6 "GQA"): bits over the layer's QUERY heads (H bits, as the paper states; the vLLM PR's
group mean would give only H_kv + 1 distance levels), and one representative set R per layer
shared by every stored head (§8.3 "KVCrush representatives are shared across the heads of a
layer"), in both `mean` (stored heads = KV heads) and `repeat` (stored heads = query heads)
modes; E is the complement of the union of all stored heads' picks, so no head holds a
representative twice.

Small sets (§6): B_rep = 0 or keep covering all of C -> the plain base selection. S ≤ B_rep ->
all of E are representatives and each head fills the rest of its budget from its own ranking,
so every stored head still keeps exactly `keep` context tokens. B_rep is carved out of the
budget (paper, vLLM PR), never added on top of it (OpenVINO).

Everything is vectorised over tokens; shapes: H query heads, T tokens, M = |C|, S = |E|."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore import scoring
from kernels import hamming_distance, pack_bits
from kvcore.plan import Eviction, KVCrush

SEED = 0
BIT_KEEP_FRACTION = 0.5
ANCHORS = ("random", "mean", "alternate", "zeros", "ones")
BUCKET_RULES = ("uniform", "linspace", "random")


def check(crush: KVCrush) -> None:
    """Raises ValueError naming the field of a KVCrush plan part the executor cannot obey."""
    if not 0.0 <= crush.rep_fraction <= 1.0:
        raise ValueError(f"kvcrush.rep_fraction must be in [0, 1], got {crush.rep_fraction}")
    if crush.anchor not in ANCHORS:
        raise ValueError(f"kvcrush.anchor must be one of {ANCHORS}, got {crush.anchor!r}")
    if crush.bucket_rule not in BUCKET_RULES:
        raise ValueError(f"kvcrush.bucket_rule must be one of {BUCKET_RULES}, got {crush.bucket_rule!r}")


def rep_budget(keep: int, crush: KVCrush) -> int:
    """B_rep = round(rep_fraction · keep) (Python rounding), within [0, keep]."""
    return max(0, min(keep, round(crush.rep_fraction * keep)))


def bit_statistic(stats: torch.Tensor, scorer: str) -> torch.Tensor:
    """stats: [H, T] the scorer's per-query-head attention -> [H, T] the statistic bits threshold:
    h2o's accumulated attention divided by the causal count T − j (NORM_SUM), else unchanged."""
    if scorer != "h2o":
        return stats
    t = stats.shape[1]
    return stats / torch.arange(t, 0, -1, dtype=stats.dtype, device=stats.device)


def head_bits(stats: torch.Tensor, fraction: float = BIT_KEEP_FRACTION) -> torch.Tensor:
    """stats: [H, M] over the candidate span -> bits [M, H] bool: bit[j, h] = token j is in head h's
    top ⌊fraction · M⌋ (at least 1)."""
    h, m = stats.shape
    if m == 0:
        return torch.zeros(0, h, dtype=torch.bool, device=stats.device)
    top = stats.topk(max(1, int(fraction * m)), dim=-1).indices                          # [H, k]
    return torch.zeros(h, m, dtype=torch.bool, device=stats.device).scatter_(1, top, True).T


def anchor_bits(bits: torch.Tensor, mode: str) -> torch.Tensor:
    """bits: [S, H] the eligible tokens' vectors -> anchor [H] bool."""
    h = bits.shape[1]
    if mode == "random":
        gen = torch.Generator().manual_seed(SEED)
        return torch.randint(0, 2, (h,), generator=gen).bool().to(bits.device)
    if mode == "mean":
        return bits.float().mean(0) > 0.5
    if mode == "alternate":
        return torch.arange(h, device=bits.device) % 2 == 1
    if mode in ("zeros", "ones"):
        return torch.full((h,), mode == "ones", dtype=torch.bool, device=bits.device)
    raise ValueError(f"kvcrush.anchor must be one of {ANCHORS}, got {mode!r}")


def distances(bits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """bits: [S, H] bool, anchor: [H] bool -> [S] int32 Hamming distances (packed int32 words)."""
    return hamming_distance(pack_bits(bits), pack_bits(anchor[None])[0])


def bucket_picks(s: int, count: int, rule: str) -> torch.Tensor:
    """Positions along the distance-sorted order of S > count > 0 tokens -> [count] int64, one in
    each of `count` equal-count buckets, ascending."""
    if rule == "linspace":
        return torch.linspace(0, s - 1, count, dtype=torch.float64).long()
    edges = torch.arange(count + 1) * s // count                                         # [count + 1]
    if rule == "uniform":
        return (edges[:-1] + edges[1:] - 1) // 2
    if rule == "random":
        u = torch.rand(count, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
        return edges[:-1] + (u * (edges[1:] - edges[:-1])).long()
    raise ValueError(f"kvcrush.bucket_rule must be one of {BUCKET_RULES}, got {rule!r}")


def representatives(bits: torch.Tensor, eligible: torch.Tensor, count: int, crush: KVCrush) -> torch.Tensor:
    """bits: [M, H] bool, eligible: [M] bool -> [min(count, S)] int64 ascending indices into M:
    one token per equal-count bucket of E sorted by (distance to the anchor, position)."""
    e = eligible.nonzero().squeeze(1)                                                     # [S]
    if count <= 0:
        return e[:0]
    if e.numel() <= count:
        return e
    b = bits[e]                                                                           # [S, H]
    d = distances(b, anchor_bits(b, crush.anchor)).long()                                 # [S]
    order = torch.argsort(d * bits.shape[0] + e, stable=True)                             # (d, position)
    picks = bucket_picks(e.numel(), count, crush.bucket_rule).to(e.device)
    return e[order[picks]].sort().values


@dataclass
class Crushed:
    rows: torch.Tensor   # [heads, sinks + keep + window] kept token indices per stored head, sorted
    reps: torch.Tensor   # [r] the representatives (token indices, ascending), shared by every head


def select(scores: torch.Tensor, stats: torch.Tensor, num_tokens: int, keep: int, ev: Eviction) -> Crushed:
    """scores: [heads, T] the base ranking per stored head (`EvictedLayer.scores`); stats: [H, T]
    the scorer's per-query-head attention (`EvictedLayer.head_scores`) -> rows as
    `scoring.select`, with B_rep of each head's `keep` context tokens replaced by KVCrush
    representatives."""
    heads = scores.shape[0]
    window = min(ev.window, num_tokens)
    sinks = min(ev.sink_tokens, num_tokens - window)
    lo, hi = sinks, num_tokens - window
    m = hi - lo
    keep = max(0, min(keep, m))
    n_rep = rep_budget(keep, ev.kvcrush)
    if n_rep == 0 or keep == m:
        rows = scoring.select(scores, num_tokens, keep, ev.window, ev.sink_tokens, heads)
        return Crushed(rows, torch.empty(0, dtype=torch.long, device=rows.device))
    span = scores[:, lo:hi]                                                               # [heads, M]
    base = span.topk(keep - n_rep, dim=-1).indices                                        # [heads, B_imp]
    eligible = torch.ones(m, dtype=torch.bool, device=span.device)
    eligible[base.flatten()] = False
    bits = head_bits(bit_statistic(stats, ev.scorer)[:, lo:hi])                           # [M, H]
    reps = representatives(bits, eligible, n_rep, ev.kvcrush)                             # [r] into M
    if reps.numel() < n_rep:                       # S <= B_rep: E all kept, heads backfill their own ranking
        base = span.masked_fill(eligible[None], float("-inf")).topk(keep - reps.numel(), dim=-1).indices
    fixed = torch.cat([torch.arange(sinks, device=span.device), torch.arange(hi, num_tokens, device=span.device)])
    fixed = fixed.expand(heads, -1)
    rows = torch.cat([fixed, base + lo, (reps + lo).expand(heads, -1)], dim=1)
    return Crushed(rows.sort(dim=1).values, reps + lo)
