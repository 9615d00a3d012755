"""Paged KV storage: the one page size every storage form of the engine's pool shares, the forms'
layouts inside a page, and what a layer's streams cost in pages. The executor's pool allocates by
it and the engine reserves by it; the planner prices plans by it (`kvcore.plan_cost`), so a plan's
bytes are the bytes its pages hold.

A *stream* is one KV head of one layer of one sequence. Its rows (tokens, in the order the layer
stores them: every token for a full layer, the kept ones for an evicted one) are numbered from 0.
Every page belongs to one stream and holds rows of one form; forms differ only in how many rows a
page holds, so any free page serves any form (vLLM v1's hybrid allocator unifies its KV groups'
page sizes for the same reason) and the pages a stream holds follow from its row counts alone:

    dense   R = 16 fp16 rows a page: K rows [R, D], then V rows [R, D]; a stream's rows
            [start, end) in pages table[r // R] (rows below `start` of the first page are dead)
    q{b}    one KIVI group a page at b = 1, 2, 4 or 8 bits (`quant_shape`): g = 192 / b rows, K
            codes per channel, V codes per row, fp16 scales and zeros; a stream's oldest rows
            [0, n·g) in n pages, the newest (its tail) dense: rows [n·g, end)

A quantized stream keeps its newest rows dense; whenever its tail reaches residual + g rows after
a step, its oldest g tail rows become a group (a new page) and the dense pages wholly below the
new start are freed.

The pool is one free list of pages, so nothing fragments: a sequence can only ever hold the pages
its streams' row counts give, and the engine reserves the most of those over its job
(`kvcore.plan_cost`, `executor.engine.kv_budget`).

Shapes in bytes; D head dim, R dense rows a page, g a group's rows, g_v channels a value scale."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

BLOCK_ROWS = 16             # dense rows (tokens of one KV head) a page holds
QUANT_BITS = (1, 2, 4, 8)   # the widths a quantized stream may use
SCALE_BYTES = 2             # fp16 scale and zero


def ceil_div(a, b):
    return -(-a // b)


def quant_shape(bits: int, head_dim: int = 64) -> tuple[int, int]:
    """A KIVI group of the pool at `bits` (1, 2, 4 or 8) -> (rows it holds, channels sharing a value
    scale). Where the value group divides the head dim D: (192 // bits, 64 // bits), and one group
    fills one page exactly: codes 2·g·D·b/8 = 48·D bytes, K scale and zero per channel 4·D, V scale
    and zero per row and value group 4·g·D/g_v = 12·D; 64·D in all, the page of R = 16 dense fp16 K
    and V rows. A smaller D (test models) takes one value scale a row and the most rows (a multiple
    of 8) that fit the page."""
    if bits not in QUANT_BITS:
        raise ValueError(f"the pool quantizes at 1, 2, 4 or 8 bits, not {bits}")
    g, gv = 192 // bits, 64 // bits
    if head_dim % gv == 0:
        return g, gv
    per_row = head_dim * bits // 4 + 4                      # codes of K and V, the row's value scale and zero
    return (64 * head_dim - 4 * head_dim) // per_row // 8 * 8, head_dim


@dataclass(frozen=True)
class Layout:
    head_dim: int
    itemsize: int = 2                   # the storage dtype's bytes (fp16: 2)
    rows: int = BLOCK_ROWS

    def __post_init__(self):
        for b in QUANT_BITS:
            if self.quant_bytes(b) > self.page_bytes:
                raise ValueError(f"a {b}-bit group ({self.quant_bytes(b)} bytes) does not fit a page ({self.page_bytes})")

    @property
    def row_bytes(self) -> int:
        """One K (or V) row of one head in the storage dtype."""
        return self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """A page: R dense K rows then R V rows (a quant group fills the same bytes in fp16)."""
        return 2 * self.rows * self.row_bytes

    @property
    def dense_bytes(self) -> int:
        return self.page_bytes

    def group_rows(self, bits: int) -> int:
        return quant_shape(bits, self.head_dim)[0]

    def value_group(self, bits: int) -> int:
        """Channels of a row's value sharing one scale and zero."""
        return quant_shape(bits, self.head_dim)[1]

    def quant_parts(self, bits: int) -> dict[str, tuple[int, int]]:
        """A quant page's parts -> (byte offset, bytes): K codes [D, g·b/8] (channel-major, 8/b
        codes a byte, low bits first), K scale and zero [D] fp16, V codes [g, D·b/8], V scale and
        zero [g, D/g_v] fp16."""
        d, g, gv = self.head_dim, self.group_rows(bits), self.value_group(bits)
        sizes = [("kc", d * g * bits // 8), ("ks", d * SCALE_BYTES), ("kz", d * SCALE_BYTES),
                 ("vc", g * d * bits // 8), ("vs", g * (d // gv) * SCALE_BYTES), ("vz", g * (d // gv) * SCALE_BYTES)]
        parts, at = {}, 0
        for name, n in sizes:
            parts[name] = (at, n)
            at += n
        return parts

    def quant_bytes(self, bits: int) -> int:
        """Bytes of a quant page a group fills (the rest of the page, if any, is held unused)."""
        return sum(n for _, n in self.quant_parts(bits).values())

    @cached_property
    def form_rows(self) -> dict[str, int]:
        """Rows a page of each form holds: "dense", "q1" … "q8"."""
        return {"dense": self.rows, **{f"q{b}": self.group_rows(b) for b in QUANT_BITS}}

    def first_row(self, page):
        """The arena row (of `row_bytes`) a dense page starts at: its first K row; its V rows start
        `rows` later."""
        return page * (self.page_bytes // self.row_bytes)

    # -- what streams cost ----------------------------------------------------------------------
    def dense_pages(self, start, end):
        """Dense pages a stream holding rows [start, end) has (numbers or arrays)."""
        return np.maximum(ceil_div(np.asarray(end), self.rows) - np.asarray(start) // self.rows, 0)

    def quant_groups(self, tokens, bits: int, residual: int):
        """Groups a quant stream holds with `tokens` rows after a step's flush."""
        return np.maximum((np.asarray(tokens) - residual) // self.group_rows(bits), 0)

    def dense_stream_bytes(self, tokens):
        return self.dense_pages(0, tokens) * self.page_bytes

    def quant_stream_pages(self, before, added, bits: int, residual: int):
        """Most pages a quant stream holds during a step that takes it from `before` rows to
        `before + added` (numbers or arrays): the new rows sit in its dense tail before the step's
        flush turns whole groups of its oldest into quant pages (allocated before the dense pages
        they empty are freed)."""
        g = self.group_rows(bits)
        before, after = np.asarray(before), np.asarray(before) + np.asarray(added)
        n0, n1 = self.quant_groups(before, bits, residual), self.quant_groups(after, bits, residual)
        return n1 + self.dense_pages(n0 * g, after)

    def quant_stream_bytes(self, before, added, bits: int, residual: int):
        return self.quant_stream_pages(before, added, bits, residual) * self.page_bytes

    def quant_stream_held(self, tokens, bits: int, residual: int):
        """Bytes a quant stream holds between steps with `tokens` rows."""
        n = self.quant_groups(tokens, bits, residual)
        return (n + self.dense_pages(n * self.group_rows(bits), tokens)) * self.page_bytes


def pooled_layers(plan, num_query_heads: int, num_kv_heads: int) -> list[bool]:
    """Which layers of `plan` (a `kvplan.plan.CompressionPlan`) keep their rows in the pool: full
    layers, eviction per KV head (GQA `mean`, or one query head a KV head), and KIVI at the pool's
    group for its width (`quant_shape`), alone or under such an eviction. The rest are cache layers
    of their own (`executor.layers`): codebooks, merged pairs, offloaded copies, per-query-head
    eviction."""
    if plan.offload.enabled:
        return [False] * len(plan.layers)
    merged = {lp.merge.with_layer for lp in plan.layers if lp.merge is not None}
    out = []
    for i, lp in enumerate(plan.layers):
        ev, q = lp.eviction, lp.quant
        ok = lp.merge is None and i not in merged and lp.codebook is None
        ok = ok and (ev is None or ev.gqa_mode == "mean" or num_query_heads == num_kv_heads)
        ok = ok and (q is None or q.bits in QUANT_BITS and q.residual >= 0)
        out.append(ok)
    return out
