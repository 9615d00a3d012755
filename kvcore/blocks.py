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
    quant   KIVI rows, a page holding g of them (`QuantForm`): K codes per channel with an fp16
            scale and zero per channel and key group of g_k rows, V codes per row with a scale and
            zero per g_v channels. `auto`'s forms q1 … q8 fill a page with one key group of
            g = 192 / b rows (`quant_shape`); SpeCache's low-bit copies (q1s, q2s) keep key groups
            of 32 rows, several a page. A stream's oldest rows [0, n·g) in n pages, the newest
            (its tail) dense: rows [n·g, end)
    coded   rows as codebook entries times magnitudes (`coded` pages: per row a K entry, a V
            entry, a position and two magnitudes, and a byte of the query heads that see it;
            `entry` pages: 2·R entries of D fp16): SpindleKV's codebooks (keys pre-RoPE, turned
            by their position), MiniCache's merged directions (shared by a pair's layers), and
            rows kept exact beside a compressed form (per-query-head evictions' union, SpeCache's
            sinks and prefetched rows) as entries of their own
    skip    a bitmap page: 1 bit a quant row that attention skips (its exact row is coded)

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


@dataclass(frozen=True)
class QuantForm:
    """A quant page's layout: `rows` rows at `bits`, K scales per `key_group` rows and channel, V
    scales per `value_group` channels and row; `midpoint`: the 1-bit midpoint quantizer
    (SpeCache's), `refine`: least-squares refits of each key group (storage alike either way)."""
    bits: int
    rows: int
    key_group: int
    value_group: int
    midpoint: bool = False
    refine: int = 0


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
    def quant_forms(self) -> tuple[QuantForm, ...]:
        """Every quant page layout, its index the form id tables and kernels name: 0 is no form;
        1..4 `auto`'s (q1, q2, q4, q8: one key group a page); then SpeCache's low-bit copies at 1
        and 2 bits with key groups of 32 rows and value groups of 64 or 32 channels (as many key
        groups a page as fit)."""
        forms = [QuantForm(0, 0, 0, 0)]
        forms += [QuantForm(b, *quant_shape(b, self.head_dim)[:1] * 2, quant_shape(b, self.head_dim)[1])
                  for b in QUANT_BITS]
        for b in (1, 2):
            for gv in (64, 32):
                gv = min(gv, self.head_dim)
                per_row = 2 * self.head_dim * b // 8 + 2 * SCALE_BYTES * self.head_dim // gv
                groups = self.page_bytes // (32 * per_row + 2 * SCALE_BYTES * self.head_dim)
                forms.append(QuantForm(b, 32 * groups, 32, gv, midpoint=b == 1, refine=3))
        return tuple(forms)

    def form_id(self, bits: int, key_group: int | None = None, value_group: int | None = None) -> int:
        """The id of `auto`'s form at `bits` (key_group None), or of the low-bit copy with key
        groups of `key_group` rows and value groups of `value_group` channels."""
        for i, f in enumerate(self.quant_forms):
            if f.bits == bits and (key_group is None and f.key_group == f.rows or
                                   key_group == f.key_group != f.rows and value_group == f.value_group):
                return i
        raise ValueError(f"no quant form of {bits} bits, key group {key_group}, value group {value_group}")

    def form_parts(self, form: int) -> dict[str, tuple[int, int]]:
        """A quant page's parts -> (byte offset, bytes): K codes [D, g·b/8] (channel-major, 8/b
        codes a byte, low bits first), K scale and zero [g/g_k, D] fp16, V codes [g, D·b/8], V
        scale and zero [g, D/g_v] fp16."""
        f, d = self.quant_forms[form], self.head_dim
        n = f.rows // f.key_group
        sizes = [("kc", d * f.rows * f.bits // 8), ("ks", n * d * SCALE_BYTES), ("kz", n * d * SCALE_BYTES),
                 ("vc", f.rows * d * f.bits // 8), ("vs", f.rows * (d // f.value_group) * SCALE_BYTES),
                 ("vz", f.rows * (d // f.value_group) * SCALE_BYTES)]
        parts, at = {}, 0
        for name, size in sizes:
            parts[name] = (at, size)
            at += size
        return parts

    @property
    def coded_rows(self) -> int:
        """Rows a `coded` page describes: int32 K entry, V entry and position, fp16 K and V
        magnitudes and a byte of query heads (17 bytes), each field a run of its own."""
        return self.page_bytes // 32 * 32 // 17 // 8 * 8

    def coded_parts(self) -> dict[str, tuple[int, int]]:
        """A coded page's fields -> (byte offset, bytes): ref_k, ref_v, pos int32 [M]; mag_k,
        mag_v fp16 [M]; heads uint8 [M] (M = `coded_rows`)."""
        m, parts, at = self.coded_rows, {}, 0
        for name, size in (("ref_k", 4), ("ref_v", 4), ("pos", 4), ("mag_k", 2), ("mag_v", 2), ("heads", 1)):
            parts[name] = (at, m * size)
            at += m * size
        return parts

    @property
    def entry_rows(self) -> int:
        """Entries (rows of D in the storage dtype) an entry page holds: 2·R."""
        return self.page_bytes // self.row_bytes

    @property
    def skip_rows(self) -> int:
        """Quant rows one skip page covers (a bit each)."""
        return self.page_bytes * 8

    def first_row(self, page):
        """The arena row (of `row_bytes`) a dense page starts at: its first K row; its V rows start
        `rows` later."""
        return page * (self.page_bytes // self.row_bytes)

    # -- what streams cost ----------------------------------------------------------------------
    def dense_pages(self, start, end):
        """Dense pages a stream holding rows [start, end) has (numbers or arrays)."""
        return np.maximum(ceil_div(np.asarray(end), self.rows) - np.asarray(start) // self.rows, 0)

    def quant_pages_held(self, tokens, g: int, residual: int):
        """Pages a quant stream of g-row pages holds between steps with `tokens` rows: its whole
        quant pages and its dense tail."""
        n = np.maximum((np.asarray(tokens) - residual) // g, 0)
        return n + self.dense_pages(n * g, tokens)

    def quant_pages_during(self, before, added, g: int, residual: int):
        """Most pages a quant stream of g-row pages holds during a step that takes it from `before`
        rows to `before + added` (numbers or arrays): the new rows sit in its dense tail before the
        step's flush turns whole pages of its oldest into quant pages (allocated before the dense
        pages they empty are freed)."""
        before, after = np.asarray(before), np.asarray(before) + np.asarray(added)
        n0 = np.maximum((before - residual) // g, 0)
        n1 = np.maximum((after - residual) // g, 0)
        return n1 + self.dense_pages(n0 * g, after)

    def quant_groups(self, tokens, bits: int, residual: int):
        """Groups (pages) `auto`'s quant stream at `bits` holds with `tokens` rows after a step's flush."""
        return np.maximum((np.asarray(tokens) - residual) // self.group_rows(bits), 0)

    def dense_stream_bytes(self, tokens):
        return self.dense_pages(0, tokens) * self.page_bytes

    def quant_stream_bytes(self, before, added, bits: int, residual: int):
        """`quant_pages_during` of `auto`'s form at `bits`, in bytes."""
        return self.quant_pages_during(before, added, self.group_rows(bits), residual) * self.page_bytes

    def quant_stream_held(self, tokens, bits: int, residual: int):
        """Bytes `auto`'s quant stream at `bits` holds between steps with `tokens` rows."""
        return self.quant_pages_held(tokens, self.group_rows(bits), residual) * self.page_bytes
