"""`merge` cache layers: MiniCache's cross-layer merging of one layer pair (spec minicache.md §2).

The pair is declared by its upper layer's plan, `Merge(with_layer=lower, t, retention_k,
retention_v)`; the lower layer's plan carries no part. The cache builds both layers as `merge`
layers and calls `upper.pair(lower)`: the two then share one `MergedPair`.

- Rows: token granularity, as in the paper: one row per token, all KV heads concatenated
  (W = H_kv·D). K and V are merged independently (own directions, magnitudes, retained rows).
- Keys are merged post-RoPE, as cached. Both layers rotate a position by the same orthogonal
  RoPE matrix, so norms, angles and SLERP commute with it: merging post-RoPE keys equals merging
  pre-RoPE keys and rotating (digest §2.8, tested there). The restored keys are post-RoPE.
- Prefill: both layers keep dense K/V (storage dtype) through the context; right after the upper
  layer's attention over the context's last chunk (`end_context`, phase COMPRESS) the pair merges and both
  dense copies are dropped. Until then the pair holds what full KV holds (peak memory: the pair
  dense plus, for a moment, its merged form).
- Stored per pair and K/V (`MergedRows`): the unit directions [N, W] and both layers' magnitudes
  [2, N] in the storage dtype; the retained rows' exact values of both layers [2, M, W] (storage
  dtype) and their indices [M] int32. The upper layer's `tensors()` hold all of it, the lower's
  nothing: the pair's bytes are counted once.
- Retention (context rows): per K/V, ⌈share·N⌉ rows by `retention_rule` (`RETENTION_RULES`;
  default "distinct": the largest angular distances, as the paper's prose intends; "similar": the
  smallest, Eq. 4 as printed; "*_minmax": the paper's γ-of-the-range threshold in either reading).
- Later tokens (question, decode), as in Alg. 2: the lower layer attends over its restored rows
  plus its exact new rows and leaves the new rows pending on the pair; the upper layer, which runs
  next in the same forward, attends the same way, merges its new rows with the pending ones and
  appends them. A new row is retained when its angular distance passes the context's cut-off τ
  (the least extreme retained distance): decisions local to each token, as a planner's absolute
  τ would make them, and no more than the context's share of tokens in expectation.

Shapes: B = 1; H_kv KV heads; D head dim; W = H_kv·D; N tokens merged; M retained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executor.layers.base import LayerContext
from executor.layers.full import FullLayer
from kernels import slerp_merge, slerp_restore
from kvplan.plan import LayerPlan, Merge

RETENTION_RULES = ("distinct", "similar", "distinct_minmax", "similar_minmax")


def retained(d: torch.Tensor, share: float, rule: str) -> tuple[torch.Tensor, float]:
    """d: [N] angular distances Ω/π -> (retained rows [M] int64 ascending, τ): a later row is
    retained when d >= τ ("distinct*" rules) or d <= τ ("similar*" rules)."""
    if rule not in RETENTION_RULES:
        raise ValueError(f"retention rule {rule!r} is not one of {RETENTION_RULES}")
    distinct = rule.startswith("distinct")
    n = d.shape[0]
    if rule.endswith("_minmax"):                           # γ = share of the range [d_min, d_max]
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=d.device), math.inf if distinct else -math.inf
        lo, hi = d.min().item(), d.max().item()
        tau = hi - (hi - lo) * share if distinct else lo + (hi - lo) * share
        keep = d > tau if distinct else d < tau
        return keep.nonzero()[:, 0], tau
    m = min(n, math.ceil(share * n - 1e-9))
    order = torch.argsort(d, descending=distinct, stable=True)[:m]
    if m == 0:
        return order, math.inf if distinct else -math.inf
    tau = d[order].min().item() if distinct else d[order].max().item()
    return order.sort().values, tau


def _passes(d: torch.Tensor, tau: float, rule: str) -> torch.Tensor:
    """d: [N] -> [N] bool, the rows a later chunk retains."""
    return d >= tau if rule.startswith("distinct") else d <= tau


@dataclass
class MergedRows:
    """K or V of a merged pair; index 0 is the lower layer, 1 the upper."""
    direction: torch.Tensor   # [N, W] unit rows, storage dtype
    mags: torch.Tensor        # [2, N] per-row norms of each layer, storage dtype
    idx: torch.Tensor         # [M] int32 retained rows, ascending
    exact: torch.Tensor       # [2, M, W] the retained rows of each layer, storage dtype
    tau: float                # retention cut-off for later rows (see `retained`)

    @classmethod
    def merge(cls, x_lo: torch.Tensor, x_hi: torch.Tensor, t: float, share: float, rule: str,
              dtype: torch.dtype) -> "MergedRows":
        """x_lo, x_hi: [N, W] the context's rows of the two layers (storage dtype)."""
        e, m0, m1, omega = slerp_merge(x_lo, x_hi, t, dtype)
        idx, tau = retained(omega / math.pi, share, rule)
        return cls(e, torch.stack([m0, m1]), idx.to(torch.int32),
                   torch.stack([x_lo[idx], x_hi[idx]]).to(dtype), tau)

    @property
    def num_rows(self) -> int:
        return self.direction.shape[0]

    def append(self, x_lo: torch.Tensor, x_hi: torch.Tensor, t: float, rule: str) -> None:
        """x_lo, x_hi: [T_new, W] new rows of the two layers (storage dtype)."""
        e, m0, m1, omega = slerp_merge(x_lo, x_hi, t, self.direction.dtype)
        new = _passes(omega / math.pi, self.tau, rule).nonzero()[:, 0]                  # [M_new]
        self.idx = torch.cat([self.idx, (new + self.num_rows).to(torch.int32)])
        self.exact = torch.cat([self.exact, torch.stack([x_lo[new], x_hi[new]]).to(self.exact.dtype)], dim=1)
        self.direction = torch.cat([self.direction, e])
        self.mags = torch.cat([self.mags, torch.stack([m0, m1])], dim=1)

    def restore(self, which: int, dtype: torch.dtype) -> torch.Tensor:
        """which: 0 lower, 1 upper -> that layer's rows [N, W] in `dtype`: direction times its
        magnitude, the retained rows overwritten with their exact values."""
        x = slerp_restore(self.direction, self.mags[which], dtype)
        x[self.idx.long()] = self.exact[which].to(dtype)
        return x

    def tensors(self) -> list[torch.Tensor]:
        return [self.direction, self.mags, self.idx, self.exact]


class MergedPair:
    """What the two layers of a pair share: the plan's merge part, the merged K and V (None until
    the merge), and the lower layer's new rows awaiting the upper's within a forward."""

    def __init__(self, merge: Merge, rule: str):
        self.merge, self.rule = merge, rule
        self.k: MergedRows | None = None
        self.v: MergedRows | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None   # lower's new K, V rows [T_new, W]

    @property
    def merged(self) -> bool:
        return self.k is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[1, H_kv, T, D] -> [T, H_kv·D]: one row per token, its heads concatenated."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def _heads(r: torch.Tensor, h: int) -> torch.Tensor:
    """[T, H_kv·D] -> [1, H_kv, T, D]."""
    return r.view(r.shape[0], h, -1).transpose(0, 1).unsqueeze(0)


class MergeLayer(FullLayer):
    kind = "merge"
    fused_decode = False     # decodes through its own attention (`FullLayer._decodes_stored`)
    retention_rule = "distinct"        # flag: one of RETENTION_RULES

    def __init__(self, plan: LayerPlan, ctx: LayerContext):
        super().__init__(plan, ctx)
        if self.retention_rule not in RETENTION_RULES:
            raise ValueError(f"retention rule {self.retention_rule!r} is not one of {RETENTION_RULES}")
        self.upper = plan.merge is not None       # the upper layer declares the pair and holds its store
        self.shared: MergedPair | None = None     # set by `pair`
        self.partner: MergeLayer | None = None    # the pair's other layer

    def pair(self, lower: "MergeLayer") -> None:
        """Called by the cache on the upper layer with its partner (which runs first in a forward)."""
        assert self.upper and not lower.upper, "pair() joins an upper merge layer to its lower partner"
        self.shared = lower.shared = MergedPair(self.plan.merge, self.retention_rule)
        self.partner, lower.partner = lower, self

    @property
    def merged(self) -> bool:
        return self.shared is not None and self.shared.merged

    # -- transformers Cache API ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [1, H_kv, T_new, D] (post-RoPE keys) -> K, V [1, H_kv, T, D], compute
        dtype: before the merge the dense rows; after it the restored rows plus the exact new ones."""
        if not self.merged:
            return super().update(key_states, value_states)
        pair, h, which = self.shared, key_states.shape[1], int(self.upper)
        k_new = _rows(key_states).to(self.storage_dtype)                 # [T_new, W]
        v_new = _rows(value_states).to(self.storage_dtype)
        k = torch.cat([pair.k.restore(which, self.dtype), k_new.to(self.dtype)])         # [T, W]
        v = torch.cat([pair.v.restore(which, self.dtype), v_new.to(self.dtype)])
        if self.upper:
            if pair.pending is None or pair.pending[0].shape != k_new.shape:
                raise RuntimeError(f"layer {self.plan.layer}: its merge partner did not run first on these tokens")
            (k_lo, v_lo), pair.pending = pair.pending, None
            pair.k.append(k_lo, k_new, pair.merge.t, pair.rule)
            pair.v.append(v_lo, v_new, pair.merge.t, pair.rule)
        else:
            pair.pending = (k_new, v_new)
        self.tokens_seen += key_states.shape[-2]
        return _heads(k, h), _heads(v, h)

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def end_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        """The upper layer merges the pair at the context's end (its lower layer ran first)."""
        self.compress_now(q, scaling)

    # -- merging ---------------------------------------------------------------------------------
    def compress_now(self, q: torch.Tensor, scaling: float) -> None:
        """The upper layer merges the pair's dense context (the lower one, earlier in the cache,
        waits for it)."""
        if self.upper and not self.merged:
            self.merge_context()

    def merge_context(self) -> None:
        """Merge the pair's dense context K/V (both layers [1, H_kv, T, D], storage dtype) and drop
        both dense copies."""
        lower, pair, m = self.partner, self.shared, self.shared.merge
        assert lower.keys.shape == self.keys.shape, "the pair's layers saw different tokens"
        pair.k = MergedRows.merge(_rows(lower.keys), _rows(self.keys), m.t, m.retention_k, pair.rule, self.storage_dtype)
        pair.v = MergedRows.merge(_rows(lower.values), _rows(self.values), m.t, m.retention_v, pair.rule,
                                  self.storage_dtype)
        lower.keys = lower.values = self.keys = self.values = None

    def restored(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K, V as attention sees them for merged tokens: [1, H_kv, N, D] (inspection)."""
        which, h = int(self.upper), self.ctx.num_kv_heads
        return _heads(self.shared.k.restore(which, dtype), h), _heads(self.shared.v.restore(which, dtype), h)

    # -- accounting ------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        if not self.merged:
            return super().tensors()
        if self.upper:
            return self.shared.k.tensors() + self.shared.v.tensors()
        return list(self.shared.pending) if self.shared.pending is not None else []

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows join in turn: the upper layer's merged
        rows grow by a direction, two magnitudes and (at most) two retained rows and an index per
        row of K and of V; the lower layer holds a call's new rows until its partner merges them."""
        if not self.merged:
            return super().bytes_bound(adds)
        w, itemsize = self.ctx.num_kv_heads * self.ctx.head_dim, self.storage_dtype.itemsize
        if not self.upper:
            return 2 * w * itemsize * max(adds, default=0)
        per_row = 2 * (w * itemsize + 2 * itemsize + 4 + 2 * w * itemsize)
        return sum(t.nbytes for t in self.tensors()) + per_row * sum(adds)

    def kept_tokens(self) -> int:
        return self.tokens_seen
