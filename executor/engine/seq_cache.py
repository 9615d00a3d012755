"""One sequence's KV: a slot in the engine's block tables for its pooled layers (they hold no
tensors), and for layers whose form the pool does not hold (`kvcore.blocks.pooled_layers`:
codebooks, merged pairs, offloaded copies, per-query-head eviction) the cache layers of
`executor.cache.PlannedCache`, which also carries the job's state (`state`: context length,
statistics, offload recall).

Bytes: a pooled layer's are its blocks (`BlockTables.layer_bytes`), a cache layer's its tensors;
`bytes_bound` is the most they can hold while the rows still to come join (`kvcore.blocks`)."""
from __future__ import annotations

import numpy as np
import torch

from executor.cache import LayerBytes, PlannedCache, _kind
from executor.engine.compression import compress
from executor.engine.block_tables import BlockTables
from kvcore.blocks import pooled_layers
from kvplan.plan import CompressionPlan


class SeqCache:
    def __init__(self, plan: CompressionPlan, tables: BlockTables, legacy: PlannedCache, num_query_heads: int,
                 num_kv_heads: int, dtype: torch.dtype):
        """dtype: the model's compute dtype. The slot is taken when the sequence is admitted (`open`)."""
        self.plan, self.tables, self.legacy, self.dtype = plan, tables, legacy, dtype
        self.heads = (num_query_heads, num_kv_heads)
        self.pooled = pooled_layers(plan, num_query_heads, num_kv_heads)
        self.slot: int | None = None
        self.seed = None                                # a `executor.runner.Prefix` to start from, when admitted
        self.acc: dict[int, torch.Tensor] = {}          # H2O: accumulated attention per pooled layer [H, T]
        self.tokens_seen = 0                            # rows fed through every layer
        self.closed = False
        self.final: list[LayerBytes] = []

    def open(self) -> None:
        """Take a slot in the block tables (at admission; idempotent), starting from `seed`'s dense
        K/V if there is one."""
        if self.slot is not None:
            return
        self.slot = self.tables.open(self.pooled)
        if self.seed is not None:
            for i, (k, v) in enumerate(zip(self.seed.keys, self.seed.values)):     # [1, H_kv, T, D] stored dtype
                if self.pooled[i]:
                    self.tables.store_dense(i, self.slot, k[0], v[0])
                else:
                    self.legacy.layers[i].seed(k, v, self.dtype)   # never written in place: shared safely
            self.tokens_seen, self.seed = self.seed.tokens, None

    @property
    def state(self):
        return self.legacy.state

    @property
    def layers(self):
        return self.legacy.layers

    @property
    def max_window(self) -> int:
        return self.legacy.max_window

    def close(self) -> None:
        """Every pooled block back to the pool (idempotent); what each layer held is kept for the
        job's report (`layer_bytes`)."""
        if not self.closed:
            self.final = self.layer_bytes()
            if self.slot is not None:
                self.tables.close(self.slot)
        self.closed = True

    @property
    def holds(self) -> bool:
        """Whether its pooled layers hold blocks now (admitted, not yet ended)."""
        return self.slot is not None and not self.closed

    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A pooled, uncompressed layer's rows -> K, V [1, H_kv, T, D] in the storage dtype."""
        k, v = self.tables.dense(layer, self.slot)
        return k[None], v[None]

    # -- a later plan ---------------------------------------------------------------------------
    def rebuild(self, plan: CompressionPlan, legacy: PlannedCache, queries: list[torch.Tensor], scaling: float) -> None:
        """From a dense cache (every layer pooled and full: a plan that came after the context, or a
        shrink) to `plan`'s: each layer's context rows [0, C) compressed with the context's last
        queries [m] of [H, W, D], the rows fed since [C, T) joining after them. Pooled layers are
        transformed in place; the others seeded into their cache layers (`legacy`, empty, built for
        `plan`), compressed, then fed the later rows, in layer order (a merged pair's lower first)."""
        c = self.state.context_tokens
        legacy.state.context_tokens = c
        pooled = pooled_layers(plan, *self.heads)
        own = {}
        for i in range(len(plan.layers)):
            k, v = self.tables.dense(i, self.slot)                                  # [H_kv, T, D] stored dtype
            lp = plan.layers[i]
            if pooled[i]:
                compress(self.tables, i, self.slot, lp, queries[i], k.to(self.dtype), v.to(self.dtype),
                                     scaling, later=k.shape[1] - c)
                continue
            legacy.layers[i].seed(k[None, :, :c], v[None, :, :c], self.dtype)
            own[i] = (k[None, :, c:], v[None, :, c:])
            self.tables.drop(i, self.slot)
        with torch.inference_mode():
            for i in own:
                legacy.layers[i].compress_now(queries[i], scaling)
            for i, (k, v) in own.items():
                if k.shape[2]:
                    legacy.layers[i].update(k.to(self.dtype), v.to(self.dtype))
        self.tables.paged[:, self.slot] = torch.tensor(pooled)
        self.plan, self.legacy, self.pooled = plan, legacy, pooled

    # -- bytes ----------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes held now: the pooled layers' blocks and the cache layers' tensors."""
        pooled = int(self.tables.layer_bytes(self.slot).sum()) if self.holds else 0
        return pooled + self.own_bytes()

    def own_bytes(self) -> int:
        """Bytes the cache layers of the layers the pool does not hold keep in their tensors."""
        if all(self.pooled):
            return 0
        return sum(t.nbytes for i, layer in enumerate(self.legacy.layers) if not self.pooled[i]
                   for t in layer.tensors())

    def layer_bytes(self) -> list[LayerBytes]:
        """Per layer: bytes held against K+V of every token seen in fp16 (once closed: what it
        held when it closed)."""
        if self.closed:
            return self.final
        legacy = self.legacy
        pooled = self.tables.layer_bytes(self.slot) if self.holds else np.zeros(len(self.pooled))
        rows = self.tables.rows_held(self.slot) if self.holds else None           # [L, H]
        out = []
        for i, layer in enumerate(legacy.layers):
            if self.pooled[i]:
                lp = self.plan.layers[i]
                kind = "quant" if lp.quant else "evicted" if lp.eviction else "full"
                kept = int(rows[i].max()) if rows is not None else 0
                out.append(LayerBytes(i, kind, kept, int(pooled[i]), 2 * self.tokens_seen * legacy.row_bytes))
            else:
                out.append(LayerBytes(i, _kind(layer), layer.kept_tokens(), sum(t.nbytes for t in layer.tensors()),
                                      2 * layer.tokens_seen * legacy.row_bytes))
        return out

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows (the question's parts, then one per
        decode step) join every layer in turn."""
        return sum(self.layer_bounds(adds))

    def layer_bounds(self, adds: list[int]) -> list[int]:
        """Per layer, the most bytes it holds at any step while `adds` rows join (`kvcore.blocks`
        for pooled layers, each cache layer's own bound for the rest)."""
        lay, tables, s = self.tables.layout, self.tables, self.slot
        steps = np.cumsum([0, *adds])                                                 # rows added before each step
        out = []
        for i, layer in enumerate(self.legacy.layers):
            if not self.pooled[i]:
                out.append(int(layer.bytes_bound(adds)))
                continue
            if not self.holds:                        # ended: what it held then; not yet admitted: nothing
                out.append(self.final[i].kv_bytes if self.final else 0)
                continue
            bits, res, total = int(tables.qbits[i, s]), int(tables.qres[i, s]), 0
            for h in range(tables.H):
                start, end = int(tables.dstart[i, s, h]), int(tables.dend[i, s, h])
                if bits:
                    u = int(tables.qn[i, s, h]) * lay.group_rows(bits) + end - start
                    worst = lay.quant_stream_held(u, bits, res)
                    if adds:
                        worst = max(worst, lay.quant_stream_bytes(u + steps[:-1], np.asarray(adds), bits, res).max())
                else:
                    worst = lay.dense_pages(start, end + steps[-1]) * lay.page_bytes
                total += int(worst)
            out.append(total)
        return out
