"""The statistics a plan is made from, per layer of a prompt's prefill: the window attention each
token gets, the share of similar key/value rows, the angle between adjacent layers' rows, and —
for `auto` — what each storage form would lose. The planner's probe computes them in a mini-prefill
of its own; the executor's prefill computes the same from its cache at the context's last chunk
(`LayerStatistics`), so a probing strategy needs no second prefill.

- `window_scores` [m, H_e, T]: the attention the last `window` queries (post-RoPE) pay each
  token, summed over the window, avg-pooled (`pool_kernel`) and normalised to sum 1 per
  stored head (query heads in GQA `repeat` mode, KV heads — the group mean — in `mean`);
- `k_similar`, `v_similar` [m]: the share of sampled token pairs whose pre-RoPE keys (values)
  have cosine above 0.9 (0.6) — SpindleKV's observation statistic (spec App. B thresholds);
- `k_angle`, `v_angle` [m-1]: the mean angular distance (arccos(cos)/π) between the same token's
  pre-RoPE key (value) rows in layer i and i+1 — MiniCache's cue for which layers merge;
- `Losses`: the relative error of the last `ERROR_QUERIES` queries' attention output when each
  KV head keeps only a share of the context (SnapKV selection: group-mean window scores, pooled,
  copy span), and when K/V are quantized (the pool's KIVI groups, `kvcore.blocks.quant_shape`:
  one page a group), each against the exact output; plus the window attention mass the kept
  share retains.

Cost (it runs inside the executor's prefill, at the context's last chunk): the window's attention
is computed once, grouped by KV head (no repeated K), summed per head and its last rows (the loss
queries' probabilities) kept, in one call (`kernels.window_stats`: C++ on the CPU); the kept sets'
outputs are sums over disjoint sets of rows made in one pass; each bit width's quantized K and V
are made group by group inside one attention pass (`kernels.quant_attention`), never stored; the
angles come from the post-RoPE keys (no unrotated copy) where no shares are asked for."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvcore import scoring

K_SIMILAR, V_SIMILAR = 0.9, 0.6     # the cosine thresholds of SpindleKV's observation plots
FRACTIONS = (1.0, 0.75, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05, 0.0)   # context share kept per KV head
BITS = (16, 8, 4, 2)                # 16: the storage dtype, unquantized
QUANT_GROUP = 32                    # the plans' Quant.group_size (planner.auto); the losses follow the pool's
                                    # groups instead: kvcore.blocks.quant_shape(bits)
ERROR_QUERIES = 8                   # the window's last queries whose output errors are measured
SINKS, SPAN, POOL = 4, 16, 7        # the selection the losses assume (auto's eviction part)


@dataclass(frozen=True)
class Losses:
    """Per layer, the predicted relative output error of storage forms (see the module doc)."""
    fractions: np.ndarray        # [F] context share kept per KV head (sinks and window always kept)
    evict: np.ndarray            # [m, F] output error keeping that share, exact rows
    retained: np.ndarray         # [m, F] window attention mass the kept tokens hold (group mean)
    bits: np.ndarray             # [B] storage bits (16 = unquantized)
    quant: np.ndarray            # [m, B] output error with every token quantized at those bits


@dataclass(frozen=True)
class ProbeStats:
    tokens: int                  # T, the probed prompt's length
    window_scores: np.ndarray    # [m, H_e, T] float32, each row sums to 1
    k_similar: np.ndarray        # [m] share of sampled pre-RoPE key pairs with cosine > 0.9 ([0]: not gathered)
    v_similar: np.ndarray        # [m] the same for values (> 0.6)
    k_angle: np.ndarray          # [m-1] mean angular distance of layer i and i+1 keys, in [0, 1]
    v_angle: np.ndarray          # [m-1] the same for values
    window: int = 32             # the observation window the scores came from
    seconds: float = 0.0         # wall time of the probe
    losses: Losses | None = None  # storage-form losses, when asked for


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """[H, T] -> [H, T], the executor's pooling (`kvcore.scoring.pool`), each row then
    normalised to sum 1."""
    scores = scoring.pool(scores, kernel)
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-30)


def similar_share(x: torch.Tensor, theta: float, sample: int, gen: torch.Generator) -> float:
    """x [H_kv, T, D] -> share of (row, other row) pairs with cosine > theta, over `sample`
    sampled rows against 4·`sample` sampled rows (every pair when T is that small)."""
    return float(_similar_share(x, theta, sample, gen))


def _similar_share(x: torch.Tensor, theta: float, sample: int, gen: torch.Generator) -> torch.Tensor:
    """`similar_share` as a 0-d tensor on x's device (nothing read back; the sample is drawn on the CPU)."""
    hk, t, _ = x.shape
    if t < 2:
        return torch.zeros((), device=x.device)
    rows = torch.randperm(t, generator=gen)[:min(sample, t)].to(x.device)                     # [S]
    cols = torch.randperm(t, generator=gen)[:min(4 * sample, t)].to(x.device)                 # [C]
    cos = torch.einsum("hsd,hcd->hsc", F.normalize(x[:, rows].float(), dim=-1),             # only the rows sampled
                       F.normalize(x[:, cols].float(), dim=-1))                               # [H_kv, S, C]
    other = rows[:, None] != cols[None, :]                                                    # [S, C] not itself
    return ((cos > theta) & other).float().sum() / (hk * other.sum())


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """a, b [H_kv, T, D]: the same tokens in two layers -> mean arccos(cos)/π over rows
    (`kernels.window_stats.mean_angle`)."""
    from kernels.window_stats import mean_angle
    return float(mean_angle(a, b))


def _grouped_probs(q: torch.Tensor, k_t: torch.Tensor, causal: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [H, Wq, D], k_t [H_kv, D, T] (keys transposed), causal [Wq, T] bool -> softmax(q·k) over
    the seen keys, [H_kv, g·Wq, T]: each KV head's g query heads (heads h·g .. h·g+g-1, SDPA's GQA
    order) in one batch row, so every kept-token subset is a mask on these probabilities, renormalised."""
    h, wq, d = q.shape
    hk = k_t.shape[0]
    logits = torch.matmul(q.reshape(hk, (h // hk) * wq, d), k_t).mul_(scaling)
    logits.masked_fill_(~causal.repeat(h // hk, 1), float("-inf"))
    return torch.softmax(logits, dim=-1)


def _rel_each(outs: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """outs [N, *S], exact [*S] -> [N]: each output's squared error relative to the exact one's square."""
    return (outs - exact).pow(2).flatten(1).sum(1) / exact.pow(2).sum().clamp_min(1e-30)


def layer_losses(q_win: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_mass: torch.Tensor,
                 scaling: float, window: int, probs: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer: q_win [H, Wq, D] the last queries, k [H_kv, T, D] post-RoPE, v [H_kv, T, D],
    window_mass [H, T] the window's attention -> (evict [F], retained [F], quant [B]) fp32 on k's
    device: nothing read back to the host, so a CUDA prefill's layers do not wait on it.
    probs: q_win's attention [H_kv, g·Wq, T] fp32 when the caller has it (`window_stats`' last rows).

    The kept sets are nested (sinks and window, then the context's rows best first): each row
    belongs to the set of the first share that keeps it, the loss queries' p·v is summed per set
    in one pass (`kernels.window_stats.segment_sums`), and each share's output is the prefix sum of
    the sets up to it (= softmax over just the kept logits); all of them is the exact output."""
    from kernels.quant_attention import groups, quant_attention
    from kernels.window_stats import nested_errors, rank_sets, segment_sums
    wq, d = q_win.shape[1], q_win.shape[2]
    hk, t, _ = k.shape
    window = min(window, t)
    sinks = min(SINKS, t - window)
    n_ctx = t - window - sinks
    if probs is None:
        cols = torch.arange(t, device=k.device)
        causal = cols[None, :] <= cols[t - wq:, None]                                        # [Wq, T]
        probs = _grouped_probs(q_win.float(), k.float().transpose(1, 2), causal, scaling)    # [H_kv, g Wq, T]
    mass = scoring.group_mean(window_mass, hk)                                              # [H_kv, T]
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    ranked = scoring.spread(scoring.pool(mass, POOL), SPAN)[:, sinks:t - window]            # [H_kv, n_ctx]
    counts = [round(f * n_ctx) for f in FRACTIONS]
    bounds = sorted({c for c in counts if c > 0})                                           # set i + 1: ranks below bounds[i]
    seg = torch.zeros(hk, t, dtype=torch.int32, device=k.device)                            # set 0: sinks and window
    seg[:, sinks:t - window] = rank_sets(ranked, bounds[:-1])                               # ranks best first (ties: earlier)
    sets = 1 + len(bounds)
    num, den = segment_sums(probs, v, seg, sets)                                            # [H_kv, S, g Wq, D], [.., g Wq]
    exact = num.sum(1)                                                                      # [H_kv, g Wq, D] every row: p·v
    at = {0: 0} | {c: 1 + i for i, c in enumerate(bounds)}
    upto = [at[c] for c in counts]                                                          # [F] each share's last set
    evict = nested_errors(num, den, upto)                                                   # [F]
    evict = evict.masked_fill(torch.tensor([c == n_ctx for c in counts], device=k.device), 0.0)  # all kept: exact
    held = torch.zeros(hk, sets, device=k.device).scatter_add_(1, seg.long(), mass).cumsum(1)  # [H_kv, S] mass kept
    held = held / held[:, -1:].clamp_min(1e-30)                     # a share of the whole: <= 1 exactly, 1 with all kept
    retained = held[:, upto].mean(0)                                                        # [F]
    widths = [b for b in BITS if b != 16 and t >= groups(b, d)[0]]              # shorter than a group: all dense
    quant = torch.zeros(len(BITS), device=k.device)                                         # [B] (16, dense: 0)
    if widths:
        outs = quant_attention(q_win.float().reshape(hk, -1, d), k, v, widths, wq, scaling)
        quant[[BITS.index(b) for b in widths]] = _rel_each(outs, exact)                     # [B', H_kv, g Wq, D]
    return evict, retained, quant


@dataclass
class LayerStatistics:
    """Statistics gathered layer by layer, in order: `add` each layer's last queries and its
    context's K/V, `result` the `ProbeStats`. window, pool_kernel, sample: as the probe's."""
    gqa_mode: str
    losses: bool
    window: int = 32
    pool_kernel: int = 7
    sample: int = 256
    seed: int = 0
    keep_queries: int = 64       # the last queries an executor layer keeps to compress later (>= any plan's window)
    shares: bool = True          # the similar-row shares (SpindleKV's observation; no plan reads them): the
                                 # executor's prefill leaves them out, a quarter of its gathering
    _scores: list = field(default_factory=list)
    _k_sim: list = field(default_factory=list)
    _v_sim: list = field(default_factory=list)
    _k_ang: list = field(default_factory=list)
    _v_ang: list = field(default_factory=list)
    _lost: list = field(default_factory=list)
    _prev: tuple | None = None
    _gen: torch.Generator | None = None
    tokens: int = 0
    spent_s: float = 0.0         # wall time its gatherer spent on the layers (`ProbeStats.seconds` by default)

    def add(self, q_last: torch.Tensor, k_rot: torch.Tensor, k_pre: torch.Tensor | None, v: torch.Tensor,
            scaling: float) -> None:
        """q_last: [H, W', D] the layer's last queries (post-RoPE; W' >= min(window, T) and
        ERROR_QUERIES); k_rot, k_pre: [H_kv, T, D] its keys post- and pre-RoPE; v [H_kv, T, D].
        k_pre may be None without the shares: the angles and norms are the same from post-RoPE
        keys (RoPE turns a token's key by the same rotation in every layer)."""
        from kernels.window_stats import mean_angle, window_stats
        if self._gen is None:
            self._gen = torch.Generator().manual_seed(self.seed)
        hk, t, d = k_rot.shape
        h = q_last.shape[0]
        w = min(self.window, t)
        e = min(ERROR_QUERIES, w) if self.losses else 0                                  # the window's last rows
        self.tokens = t
        q_win = q_last[:, -w:].to(k_rot.dtype).reshape(hk, (h // hk) * w, d)
        s, last = window_stats(q_win, k_rot, w, e, scaling)                              # [H_kv, g, T], [H_kv, g e, T]
        s = s.view(h, t)                                                                 # [H, T] (scoring.window_scores)
        if self.losses:
            self._lost.append(layer_losses(q_last[:, -e:], k_rot, v, s, scaling, w, probs=last))
        if self.gqa_mode == "mean":
            s = s.view(hk, h // hk, t).mean(1)
        self._scores.append(pooled(s, self.pool_kernel))
        if self.shares:
            if k_pre is None:
                raise ValueError("LayerStatistics.add: the shares need the pre-RoPE keys (k_pre)")
            self._k_sim.append(_similar_share(k_pre, K_SIMILAR, self.sample, self._gen))
            self._v_sim.append(_similar_share(v, V_SIMILAR, self.sample, self._gen))
        k_pre = k_rot if k_pre is None else k_pre
        if self._prev is not None:
            k_prev, v_prev = self._prev
            self._k_ang.append(mean_angle(k_prev, k_pre))
            self._v_ang.append(mean_angle(v_prev, v))
        self._prev = (k_pre, v)

    def result(self, seconds: float | None = None) -> "ProbeStats":
        """seconds: the wall time to report (default: `spent_s`, what gathering the layers took)."""
        lost = self._lost
        return ProbeStats(
            tokens=self.tokens, window_scores=torch.stack(self._scores).float().cpu().numpy(),
            k_similar=_host(self._k_sim), v_similar=_host(self._v_sim),
            k_angle=_host(self._k_ang), v_angle=_host(self._v_ang),
            window=min(self.window, self.tokens), seconds=self.spent_s if seconds is None else seconds,
            losses=None if not self.losses else Losses(
                fractions=np.array(FRACTIONS), evict=_host([x[0] for x in lost], np.float64),
                retained=_host([x[1] for x in lost], np.float64), bits=np.array(BITS),
                quant=_host([x[2] for x in lost], np.float64)),
        )


def _host(values: list, dtype=np.float32) -> np.ndarray:
    """Per-layer tensors on the gathering device -> one array on the host (one copy for all layers)."""
    return torch.stack(values).cpu().numpy().astype(dtype) if values else np.zeros(0, dtype)


# -- on the wire (PlanRequest.stats) -------------------------------------------------------------
def to_proto(stats: ProbeStats):
    """-> `kvplan.v1.ProbeStatistics` (window scores per stored head of the mode they came in)."""
    from protos import planner_pb2
    msg = planner_pb2.ProbeStatistics(
        tokens=stats.tokens, window=stats.window, heads=stats.window_scores.shape[1],
        window_scores=_fp16_bytes(stats.window_scores), k_similar=stats.k_similar.tolist(),
        v_similar=stats.v_similar.tolist(), k_angle=stats.k_angle.tolist(), v_angle=stats.v_angle.tolist())
    lo = stats.losses
    if lo is not None:
        msg.losses.CopyFrom(planner_pb2.StorageLosses(
            fractions=lo.fractions.tolist(), evict=lo.evict.ravel().tolist(), retained=lo.retained.ravel().tolist(),
            bits=lo.bits.astype(int).tolist(), quant=lo.quant.ravel().tolist()))
    return msg


def from_proto(msg, num_layers: int, heads: int, tokens: int) -> ProbeStats:
    """A `ProbeStatistics` checked against the job (ValueError naming the field) -> ProbeStats.
    heads: the rows per layer the strategy's GQA mode scores (query heads in "repeat", KV heads
    in "mean")."""
    m, h = num_layers, heads
    if msg.tokens != tokens:
        raise ValueError(f"stats.tokens: {msg.tokens}, but the prompt has {tokens} tokens")
    if msg.heads != h:
        raise ValueError(f"stats.heads: {msg.heads} rows per layer, but the strategy scores {h} (its GQA mode)")
    if not 0 < msg.window <= tokens:
        raise ValueError(f"stats.window: must be in [1, {tokens}], got {msg.window}")
    if len(msg.window_scores) != 2 * m * h * tokens:
        raise ValueError(f"stats.window_scores: expected {m * h * tokens} fp16 values, got {len(msg.window_scores) / 2:g}")
    for name, n in (("k_similar", m), ("v_similar", m), ("k_angle", m - 1), ("v_angle", m - 1)):
        if not (name.endswith("similar") and len(getattr(msg, name)) == 0):      # shares: none, or one a layer
            _sized(getattr(msg, name), n, f"stats.{name}")
    scores = _from_fp16_bytes(msg.window_scores).reshape(m, h, tokens)
    if not np.isfinite(scores).all() or (scores < 0).any():
        raise ValueError("stats.window_scores: must be finite and >= 0")
    losses = None
    if msg.HasField("losses"):
        lo = msg.losses
        f, b = len(lo.fractions), len(lo.bits)
        for name, n in (("evict", m * f), ("retained", m * f), ("quant", m * b)):
            _sized(getattr(lo, name), n, f"stats.losses.{name}")
        arrays = [np.asarray(x, dtype=np.float64) for x in (lo.fractions, lo.evict, lo.retained, lo.quant)]
        if not all(np.isfinite(a).all() for a in arrays) or not f or not b:
            raise ValueError("stats.losses: must be finite and name fractions and bits")
        losses = Losses(arrays[0], arrays[1].reshape(m, f), arrays[2].reshape(m, f), np.asarray(lo.bits),
                        arrays[3].reshape(m, b))
    return ProbeStats(tokens, scores, np.asarray(msg.k_similar, np.float32), np.asarray(msg.v_similar, np.float32),
                      np.asarray(msg.k_angle, np.float32), np.asarray(msg.v_angle, np.float32), msg.window,
                      losses=losses)


def _fp16_bytes(x: np.ndarray) -> bytes:
    """fp32 array -> its values as little-endian fp16 bytes (nearest even). Through torch: numpy
    converts subnormal halves in software, and most window scores of a long prompt are subnormal
    in fp16 (a 4k prompt's scores took 77 ms in numpy, 4 ms here; the same bytes)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.float16).numpy().astype("<f2", copy=False).tobytes()


def _from_fp16_bytes(b: bytes) -> np.ndarray:
    """little-endian fp16 bytes -> fp32 array (through torch, as `_fp16_bytes`)."""
    return torch.from_numpy(np.frombuffer(b, dtype="<f2").astype(np.float16, copy=True)).float().numpy()


def _sized(values, n: int, field: str) -> None:
    if len(values) != n:
        raise ValueError(f"{field}: expected {n} values, got {len(values)}")
