"""One sequence's KV: its slot in the pool's tables (`executor.engine.block_tables`) under its plan.
It holds no tensors: its bytes are the pages its streams hold, counted as they come and go.

    open / close     take a slot at admission (a seeded prefix written into it), give every page
                     back when the sequence ends (what each layer held kept for its report)
    layer_bytes      per layer: bytes held against the fp16 K+V of every token it has seen
    bytes_bound      the most its pages can come to while the rows still to come join, from the
                     tables as they are (`kvcore.blocks`): what the engine reserves once the
                     context is compressed"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor.engine.block_tables import BlockTables
from kvcore.blocks import ceil_div
from kvcore.plan import CompressionPlan


@dataclass(frozen=True)
class LayerBytes:
    layer: int
    kind: str
    kept_tokens: int      # rows held per KV head (the most of its heads)
    kv_bytes: int         # bytes of every page the layer holds
    full_kv_bytes: int    # K and V of every token seen, all KV heads, in the storage dtype


def layer_kinds(plan: CompressionPlan) -> list[str]:
    """What each layer is stored as, for reports: its plan's kind; a merged pair's lower layer and
    an offloading plan's full layers by what they hold."""
    lower = {lp.merge.with_layer for lp in plan.layers if lp.merge is not None}
    return ["merge" if i in lower else "offload" if plan.offload.enabled and lp.kind == "full" else lp.kind
            for i, lp in enumerate(plan.layers)]


class SeqCache:
    def __init__(self, plan: CompressionPlan, tables: BlockTables, num_kv_heads: int, head_dim: int):
        self.plan, self.tables = plan, tables
        self.row_bytes = num_kv_heads * head_dim * tables.layout.itemsize
        self.slot: int | None = None
        self.seed = None                                # a `executor.runner.Prefix` to start from, when admitted
        self.tokens_seen = 0                            # rows fed through every layer
        self.closed = False
        self.final: list[LayerBytes] = []

    @property
    def max_window(self) -> int:
        """The longest observation window of any layer: the context's last chunk must hold it."""
        return max((lp.eviction.window for lp in self.plan.layers if lp.eviction), default=0)

    @property
    def seedable(self) -> bool:
        """Whether its context chunks can start from a dense prefix: nothing but K/V is kept while
        the context is prefilled (H2O accumulates attention)."""
        return not any(lp.eviction is not None and lp.eviction.scorer == "h2o" for lp in self.plan.layers)

    def open(self) -> None:
        """Take a slot in the tables (at admission; idempotent), starting from `seed`'s dense K/V."""
        if self.slot is not None:
            return
        self.slot = self.tables.open()
        if self.seed is not None:
            for i, (k, v) in enumerate(zip(self.seed.keys, self.seed.values)):     # [1, H_kv, T, D] stored dtype
                self.tables.store_dense(i, self.slot, k[0], v[0])
            self.tokens_seen, self.seed = self.seed.tokens, None

    def close(self) -> None:
        """Every page back to the pool (idempotent); what each layer held is kept for the job's
        report (`layer_bytes`)."""
        if not self.closed:
            self.final = self.layer_bytes()
            if self.slot is not None:
                self.tables.close(self.slot)
        self.closed = True

    @property
    def holds(self) -> bool:
        """Whether it holds pages now (admitted, not yet ended)."""
        return self.slot is not None and not self.closed

    # -- bytes ----------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes held now: the pages of its streams."""
        return int(self.tables.layer_bytes(self.slot).sum()) if self.holds else 0

    def layer_bytes(self) -> list[LayerBytes]:
        """Per layer: bytes held against K+V of every token seen in fp16 (once closed: what it
        held when it closed)."""
        if self.closed:
            return self.final
        kinds = layer_kinds(self.plan)
        if not self.holds:
            return [LayerBytes(i, kind, 0, 0, 0) for i, kind in enumerate(kinds)]
        held = self.tables.layer_bytes(self.slot)
        rows = self.tables.rows_held(self.slot)                                          # [L, H]
        full = 2 * self.tokens_seen * self.row_bytes
        return [LayerBytes(i, kind, self.tokens_seen if kind in ("merge", "offload") else int(rows[i].max()),
                           int(held[i]), full) for i, kind in enumerate(kinds)]

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows (the question's parts, then one per decode
        step) join every stream in turn."""
        return sum(self.layer_bounds(adds))

    def layer_bounds(self, adds: list[int]) -> list[int]:
        """Per layer, the most bytes its pages come to while `adds` rows join: its coded, entry and
        skip pages as they are, its quant pages and dense tail as they grow (`kvcore.blocks`)."""
        if not self.holds:                        # ended: what it held then; not yet admitted: nothing
            return [x.kv_bytes for x in self.final] if self.final else [0] * len(self.plan.layers)
        t, lay, s = self.tables, self.tables.layout, self.slot
        steps = np.cumsum([0, *adds])                                                 # rows added before each step
        fixed = t.layer_pages(s) - self._growing_pages(s)
        out = []
        for i in range(t.L):
            form = int(t.qform[i, s])
            total = 0
            for h in range(t.H):
                start, end = int(t.dstart[i, s, h]), int(t.dend[i, s, h])
                if form:
                    f = lay.quant_forms[form]
                    u = int(t.qn[i, s, h]) * f.rows + end - start
                    worst = lay.quant_pages_held(u, f.rows, int(t.qres[i, s]))
                    if adds:
                        worst = max(worst, lay.quant_pages_during(u + steps[:-1], np.asarray(adds), f.rows,
                                                                  int(t.qres[i, s])).max())
                else:
                    worst = lay.dense_pages(start, end + steps[-1])
                total += int(worst)
            out.append((total + int(fixed[i])) * lay.page_bytes)
        return out

    def _growing_pages(self, slot: int) -> np.ndarray:
        """[L] pages of the parts that grow (quant pages and the dense tail)."""
        t, lay = self.tables, self.tables.layout
        dense = (ceil_div(t.dend[:, slot], lay.rows) - t.dstart[:, slot] // lay.rows).clamp_min(0)
        return (dense + t.qn[:, slot]).sum(1).numpy()
