"""Paged KV storage: the block of every storage form the engine's pool holds, and what a layer's
streams cost in blocks. The executor's pool allocates by it and the engine reserves by it; the
planner prices plans by it (`kvcore.plan_cost`), so a plan's bytes are the bytes its blocks hold.

A *stream* is one KV head of one layer of one sequence. Its rows (tokens, in the order the
layer stores them: every token for a full layer, the kept ones for an evicted one) are numbered
from 0. A stream stores them in up to two forms:

    dense   fp16 (the storage dtype) K and V rows, `rows` a block: rows [start, end) of the
            stream, in blocks of its dense table (block i holds rows [i·rows, (i+1)·rows))
    quant   KIVI groups of `group` consecutive rows (K per channel, V per token, fp16 scales
            and zeros), one group a block of form `q{bits}`: rows [0, n·group)

A quantized stream keeps its newest rows dense (its tail): rows [n·group, end); whenever the
tail reaches residual + group rows after a step, its oldest `group` rows become a group and
the dense blocks below the new start are freed (`group` is a multiple of `rows`).

Every block is a whole number of pages; the pool carves chunks of `chunk_pages` pages (a
multiple of every form's pages) into blocks of one form, so no form wastes part of a chunk.

Shapes in bytes; D head dim, g group, g_v = gcd(g, D) channels sharing a value scale."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

BLOCK_ROWS = 16             # dense rows (tokens of one KV head) a dense block holds
QUANT_GROUP = 32            # rows a quantized group holds: KIVI's group for keys (per channel)
QUANT_BITS = (2, 4, 8)      # the widths a pooled quant stream may use
SCALE_BYTES = 2             # fp16 scale and zero
MAX_CHUNK_BYTES = 256 << 10  # the most a chunk of the pool holds (the least multiple of the forms' blocks, if smaller)


def ceil_div(a, b):
    return -(-a // b)


def quant_shape(bits: int) -> tuple[int, int]:
    """A KIVI group of the pool at `bits` (1, 2, 4 or 8) -> (rows it holds, channels sharing a value
    scale): (192 // bits, 64 // bits). One group fills one page exactly for a head dim D that the
    value group divides: codes 2·g·D·b/8 = 48·D bytes, K scale and zero per channel 4·D, V scale and
    zero per row and value group 4·g·D/g_v = 12·D; 64·D in all, the page of 16 dense fp16 K and V rows."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"the pool quantizes at 1, 2, 4 or 8 bits, not {bits}")
    return 192 // bits, 64 // bits


@dataclass(frozen=True)
class Layout:
    head_dim: int
    itemsize: int = 2                   # the storage dtype's bytes (fp16: 2)
    rows: int = BLOCK_ROWS
    group: int = QUANT_GROUP

    def __post_init__(self):
        if self.group % self.rows:
            raise ValueError(f"the quant group ({self.group}) must be a multiple of a dense block's rows ({self.rows})")
        for b in QUANT_BITS:
            if self.value_group % (8 // b) or self.head_dim % (8 // b):
                raise ValueError(f"head dim {self.head_dim} cannot pack {b}-bit value codes")

    @property
    def value_group(self) -> int:
        """Channels of a token's value sharing one scale and zero."""
        return math.gcd(self.group, self.head_dim)

    @property
    def row_bytes(self) -> int:
        """One K (or V) row of one head in the storage dtype."""
        return self.head_dim * self.itemsize

    @property
    def dense_bytes(self) -> int:
        """A dense block: K rows [rows, D], then V rows [rows, D]."""
        return 2 * self.rows * self.row_bytes

    def quant_parts(self, bits: int) -> dict[str, tuple[int, int]]:
        """A quant block's parts -> (byte offset, bytes): K codes [D, g·b/8] (channel-major, 8/b
        codes a byte, low bits first), K scale and zero [D] fp16, V codes [g, D·b/8], V scale and
        zero [g, D/g_v] fp16."""
        d, g, gv = self.head_dim, self.group, self.value_group
        sizes = [("kc", d * g * bits // 8), ("ks", d * SCALE_BYTES), ("kz", d * SCALE_BYTES),
                 ("vc", g * d * bits // 8), ("vs", g * (d // gv) * SCALE_BYTES), ("vz", g * (d // gv) * SCALE_BYTES)]
        parts, at = {}, 0
        for name, n in sizes:
            parts[name] = (at, n)
            at += n
        return parts

    def quant_bytes(self, bits: int) -> int:
        return sum(n for _, n in self.quant_parts(bits).values())

    @cached_property
    def form_bytes(self) -> dict[str, int]:
        """Bytes of a block of each form: "dense", "q2", "q4", "q8"."""
        return {"dense": self.dense_bytes, **{f"q{b}": self.quant_bytes(b) for b in QUANT_BITS}}

    @cached_property
    def page_bytes(self) -> int:
        """The largest size every block (and a K row) is a whole number of: the pool's address unit."""
        return math.gcd(self.row_bytes, *self.form_bytes.values())

    @cached_property
    def form_pages(self) -> dict[str, int]:
        return {f: n // self.page_bytes for f, n in self.form_bytes.items()}

    @cached_property
    def chunk_pages(self) -> int:
        """Pages of a chunk: the least multiple of every form's block, or where that passes
        MAX_CHUNK_BYTES the most whole dense blocks within it (the other forms then leave a few
        pages of a chunk unused: `chunk_waste`)."""
        lcm = math.lcm(*self.form_pages.values())
        if lcm * self.page_bytes <= MAX_CHUNK_BYTES:
            return lcm
        dense = self.form_pages["dense"]
        return max(MAX_CHUNK_BYTES // self.page_bytes // dense, 1) * dense

    @cached_property
    def chunk_waste(self) -> float:
        """The largest share of a chunk no block of its form can use."""
        return max((self.chunk_pages % p) / self.chunk_pages for p in self.form_pages.values())

    def first_row(self, page):
        """The arena row (of `row_bytes`) a dense block at `page` starts at: its first K row; its
        V rows start `rows` later. Dense blocks sit at multiples of their own size in a chunk,
        so this is exact."""
        return page * self.page_bytes // self.row_bytes

    # -- what streams cost ----------------------------------------------------------------------
    def dense_blocks(self, start, end):
        """Dense blocks a stream holding rows [start, end) has (start a multiple of `rows`)."""
        return np.maximum(ceil_div(np.asarray(end), self.rows) - np.asarray(start) // self.rows, 0)

    def quant_groups(self, tokens, residual: int):
        """Groups a quant stream holds with `tokens` rows after a step's flush."""
        return np.maximum((np.asarray(tokens) - residual) // self.group, 0)

    def dense_stream_bytes(self, tokens):
        return self.dense_blocks(0, tokens) * self.dense_bytes

    def quant_stream_bytes(self, before, added, bits: int, residual: int):
        """Most bytes a quant stream holds during a step that takes it from `before` rows to
        `before + added` (numbers or arrays): the new rows sit in its dense tail before the step's
        flush turns whole groups of its oldest into quant blocks (allocated before the dense
        blocks they empty are freed)."""
        before, after = np.asarray(before), np.asarray(before) + np.asarray(added)
        n0, n1 = self.quant_groups(before, residual), self.quant_groups(after, residual)
        tail = self.dense_blocks(n0 * self.group, after)
        return n1 * self.quant_bytes(bits) + tail * self.dense_bytes

    def quant_stream_held(self, tokens, bits: int, residual: int):
        """Bytes a quant stream holds between steps with `tokens` rows."""
        n = self.quant_groups(tokens, residual)
        return n * self.quant_bytes(bits) + self.dense_blocks(n * self.group, tokens) * self.dense_bytes


def pooled_layers(plan, num_query_heads: int, num_kv_heads: int, group: int = QUANT_GROUP) -> list[bool]:
    """Which layers of `plan` (a `kvplan.plan.CompressionPlan`) keep their rows in the pool: full
    layers, eviction per KV head (GQA `mean`, or one query head a KV head), and KIVI at 2/4/8
    bits in groups of `group` rows, alone or under such an eviction. The rest are cache layers of
    their own (`executor.layers`): codebooks, merged pairs, offloaded copies, per-query-head
    eviction."""
    if plan.offload.enabled:
        return [False] * len(plan.layers)
    merged = {lp.merge.with_layer for lp in plan.layers if lp.merge is not None}
    out = []
    for i, lp in enumerate(plan.layers):
        ev, q = lp.eviction, lp.quant
        ok = lp.merge is None and i not in merged and lp.codebook is None
        ok = ok and (ev is None or ev.gqa_mode == "mean" or num_query_heads == num_kv_heads)
        ok = ok and (q is None or (q.bits in QUANT_BITS and q.group_size == group and q.residual >= 0))
        out.append(ok)
    return out
