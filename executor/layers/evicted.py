"""`evicted` cache layer: dense K/V while the context is prefilled, then — right after the
attention of the context's last chunk — each stored head keeps its own token set: sinks, its
top-scored context tokens, the observation window. In GQA `repeat` mode each query head
chooses its own tokens, and the KV group stores the union once plus a per-head bool mask over
it (never h_n dense copies; a byte per head and row, the form attention takes it in). Tokens
added later (question, decode) join every head of their group.

Shapes: B = 1; H query heads, H_kv KV heads, h_n = H / H_kv; D head dim."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor import kvcrush
from kvcore import scoring
from kvcore.attention import causal_attention
from executor.layers.base import LayerContext, Phase
from executor.layers.full import FullLayer
from executor.layers.groups import DenseGroup, grown, index_dtype
from kvcore import cost
from kvplan.plan import Eviction, LayerPlan

KEEP_ALL = Eviction(keep_tokens=1 << 62, window=0, scorer="streaming_llm", gqa_mode="mean")


@dataclass
class Kept:
    """What compression keeps: per stored head the token indices, [heads, n] sorted."""
    rows: torch.Tensor
    repeat: bool


class EvictedLayer(FullLayer):
    kind = "evicted"
    fused_decode = False     # decodes through its own attention (`FullLayer._decodes_stored`)

    def __init__(self, plan: LayerPlan, ctx: LayerContext):
        super().__init__(plan, ctx)
        self.eviction = plan.eviction or KEEP_ALL
        if self.eviction.kvcrush is not None:
            kvcrush.check(self.eviction.kvcrush)
        self.groups: list | None = None            # one token store per KV group, after compression
        self.masks: list[torch.Tensor] | None = None  # per group [h_n, >= U] bool: what each head sees (`repeat`);
                                                      # grown like a DenseGroup's rows (`groups.grown`)
        self.prompt_rows = 0                       # n: kept prompt tokens per stored head
        self.acc: torch.Tensor | None = None       # [H, T] H2O accumulated attention (prefill only)

    @property
    def seedable(self) -> bool:
        """H2O accumulates the context's attention while it is prefilled: K/V alone cannot seed it."""
        return self.eviction.scorer != "h2o"

    @property
    def compressed(self) -> bool:
        return self.groups is not None

    # -- transformers Cache API ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [1, H_kv, T_new, D] (post-RoPE keys)."""
        if not self.compressed:
            return super().update(key_states, value_states)
        pos = torch.arange(self.tokens_seen, self.tokens_seen + key_states.shape[-2], device=key_states.device)
        for g, group in enumerate(self.groups):
            if self.masks is not None:
                self._grow_mask(g, group.num_tokens, len(pos))
            group.append(key_states[0, g], value_states[0, g], pos)
        self.tokens_seen += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens_seen + query_length, 0

    # -- attention -------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  phase: Phase) -> torch.Tensor:
        """q: [1, H, Tq, D] -> [1, Tq, H, D]: over the kept groups once compressed, else dense (H2O
        accumulating the context's attention)."""
        if self.compressed:
            return self._attend_groups(q, scaling)
        out = causal_attention(q, k, v, scaling)
        if self.eviction.scorer == "h2o" and phase.prefills_context:
            self.acc = scoring.accumulate_attention(self.acc, q[0], k[0], scaling)
        return out

    def end_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        if not self.compressed:
            self.compress_context(q[0], k[0], v[0], scaling)

    def _attend_groups(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """q: [1, H, Tq, D] -> [1, Tq, H, D]. Per KV group one attention over the group's tokens,
        each query head masked to its own kept prompt tokens (no per-head copies of K/V); tokens
        added after compression are causal."""
        hn = self.ctx.num_query_heads // self.ctx.num_kv_heads
        tq, outs = q.shape[2], []
        for g, group in enumerate(self.groups):
            p, u = self.prompt_counts[g], group.num_tokens
            mask = None
            if self.masks is not None and tq == 1:                                     # decode: own tokens + all later
                mask = self.masks[g][:, None, :u]
            elif self.masks is not None or tq > 1:
                dev = q.device
                prompt = self.masks[g][:, :p] if self.masks is not None else \
                    torch.ones(hn, p, dtype=torch.bool, device=dev)
                tail = (torch.arange(u - p, device=dev)[None, :]
                        <= torch.arange(tq, device=dev)[:, None] + (u - p - tq))                  # [Tq, t]
                mask = torch.cat([prompt[:, None, :].expand(hn, tq, p), tail[None].expand(hn, tq, u - p)], dim=-1)
            outs.append(group.attend(q[0, g * hn:(g + 1) * hn], mask, scaling))           # [h_n, Tq, D]
        return torch.cat(outs).transpose(0, 1)[None].contiguous()

    def _grow_mask(self, g: int, used: int, m: int) -> None:
        """Room in group g's mask for m tokens joining its `used` rows, by the rows' own growth
        rule (so the bytes it holds are the ones `planner.budget` reserves): the new columns are
        True (tokens added after compression are seen by every head)."""
        mask = self.masks[g]
        cols = grown(mask.shape[1], used, m)
        if cols > mask.shape[1]:
            self.masks[g] = torch.cat([mask, mask.new_ones(mask.shape[0], cols - mask.shape[1])], dim=1)

    @property
    def head_rows(self) -> torch.Tensor | None:
        """[H, n] each query head's kept prompt tokens as indices into its group's rows (`repeat`
        mode; None otherwise). An inspection view of the masks."""
        if self.masks is None:
            return None
        rows = [torch.nonzero(m[:, :p])[:, 1].view(m.shape[0], -1) for m, p in zip(self.masks, self.prompt_counts)]
        return torch.cat(rows).to(index_dtype(max(self.prompt_counts)))

    def _heads(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored head's K/V rows, [H_e, n + t, D] (compute dtype): what each head attends
        over. An inspection view; attention itself never builds it."""
        ks, vs = [], []
        hn = self.ctx.num_query_heads // self.ctx.num_kv_heads
        for g, group in enumerate(self.groups):
            kg, vg = group.materialize(dtype)                                            # [U_g, D]
            if self.head_rows is None:
                ks.append(kg[None]), vs.append(vg[None])
                continue
            tail = torch.arange(self.prompt_counts[g], group.num_tokens, device=kg.device).expand(hn, -1)
            idx = torch.cat([self.head_rows[g * hn:(g + 1) * hn].long(), tail], dim=1)   # [h_n, n + t]
            ks.append(kg[idx]), vs.append(vg[idx])
        return torch.cat(ks), torch.cat(vs)

    # -- compression -----------------------------------------------------------------------------
    @property
    def repeat(self) -> bool:
        return self.eviction.gqa_mode == "repeat"

    @property
    def stored_heads(self) -> int:
        return self.ctx.num_query_heads if self.repeat else self.ctx.num_kv_heads

    def planned_keep(self, t: int) -> int:
        ev = self.eviction
        return ev.keep_tokens if ev.keep_tokens is not None else int((ev.keep_ratio or 1.0) * t)

    def scores(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """q: [H, Tq, D] (the context's last chunk), k: [H_kv, T, D] -> [stored heads, T] or
        None when nothing ranks the context (StreamingLLM)."""
        return self.rank(self.head_scores(q, k, scaling))

    def head_scores(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """The scorer's raw attention per query head: q: [H, Tq, D], k: [H_kv, T, D] -> [H, T] or None."""
        ev = self.eviction
        if ev.scorer == "snapkv":
            return scoring.window_scores(q[:, -max(1, min(ev.window, q.shape[1])):], k, scaling)
        return self.acc if ev.scorer == "h2o" else None

    def rank(self, scores: torch.Tensor | None) -> torch.Tensor | None:
        """[H, T] raw head scores -> [stored heads, T] the ranking eviction keeps the top of."""
        return None if scores is None else scoring.ranking(scores, self.eviction, self.ctx.num_kv_heads)

    def rows(self, scores: torch.Tensor | None, t: int, keep: int, head_scores: torch.Tensor | None = None) -> Kept:
        """scores: [stored heads, T]; head_scores: [H, T] raw (KVCrush's head-behaviour bits)."""
        if scores is None and keep < t:          # nothing ranks the context: sinks + window only
            keep = 0
        ev = self.eviction
        if ev.kvcrush is not None and scores is not None and head_scores is not None:
            return Kept(kvcrush.select(scores, head_scores, t, keep, ev).rows, self.repeat)
        return Kept(scoring.select(scores, t, keep, ev.window, ev.sink_tokens, self.stored_heads, self._k.device),
                    self.repeat)

    def compress_now(self, q: torch.Tensor, scaling: float) -> None:
        """q: [H, W, D] the context's last queries; the dense context is this layer's own."""
        self.compress_context(q, self.keys[0].to(q.dtype), self.values[0].to(q.dtype), scaling)

    def compress_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        """q: [H, Tq, D] the context's last chunk; k, v: [H_kv, T, D] the whole context."""
        t = k.shape[1]
        raw = self.head_scores(q, k, scaling)                                               # [H, T] or None
        self.compress(self.rows(self.rank(raw), t, self.planned_keep(t), raw), k, v)

    def compress(self, kept: Kept, k: torch.Tensor, v: torch.Tensor, groups: list | None = None) -> None:
        """k, v: [H_kv, T, D] the whole context (post-RoPE keys); `groups`: token stores already
        built for each group's kept tokens. Drops the dense copy."""
        hn = self.ctx.num_query_heads // self.ctx.num_kv_heads if kept.repeat else 1
        built, locals_, counts = [], [], []
        for g in range(self.ctx.num_kv_heads):
            rows = kept.rows[g * hn:(g + 1) * hn]                                       # [h_n, n]
            uniq, inverse, weight = torch.unique(rows, return_inverse=True, return_counts=True)
            built.append(groups[g] if groups else self.make_group(k[g, uniq], v[g, uniq], uniq, weight.float()))
            locals_.append(inverse)
            counts.append(len(uniq))
        self.groups, self.prompt_counts, self.prompt_rows = built, counts, kept.rows.shape[1]
        self.masks = [torch.zeros(inv.shape[0], c, dtype=torch.bool, device=inv.device).scatter_(1, inv, True)
                      for inv, c in zip(locals_, counts)] if hn > 1 else None   # one head per group: all seen
        self.keys = self.values = self.acc = None

    def make_group(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor):
        """k, v: [U, D] a group's kept tokens; pos: [U]; weight: [U] heads keeping each."""
        return DenseGroup(k, v, pos, self.storage_dtype)

    # -- accounting ------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        if not self.compressed:
            return super().tensors()
        held = [t for group in self.groups for t in group.tensors()]
        return held + (self.masks or [])

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows join in turn: each group's own bound,
        and each `repeat` mask growing by its rows' rule (a byte per query head and column)."""
        if not self.compressed:
            return super().bytes_bound(adds)
        total = sum(g.bytes_bound(adds) for g in self.groups)
        for mask, group in zip(self.masks or [], self.groups):
            cols = cost.capacities(mask.shape[1], group.num_tokens, adds)[-1] if adds else mask.shape[1]
            total += mask.shape[0] * cols
        return total

    def kept_tokens(self) -> int:
        if not self.compressed:
            return super().kept_tokens()
        return self.prompt_rows + self.tokens_seen - self.ctx.state.context_tokens
