"""Streams of every storage form in a paged pool, built through `BlockTables` as the engine builds
them, for the paged decode kernels' tests (`tests/kernels/test_paged_decode.py`, its interpreter
child and its CUDA runs): what each stream should hold is recorded beside it, so a test checks the
pool's rows against it independently of `kernels.paged_decode.stream_rows`.

A case is a head dim D, h query rows a stream, group_heads, and slots (each slot: 2 layers × 2 KV
heads = 4 streams a layer view), each slot one of:

    dense(rows)                              full rows
    quant(form, rows, residual, skip, coded) a quant form (any id of `Layout.quant_forms[1:]`), its
                                             tail dense; skip: some quant rows marked in a skip page;
                                             coded: that many exact rows beside (SpeCache's), some absent
    coded(rows, entries, dense)              codebook rows: refs into shared entries, magnitudes,
                                             keys pre-RoPE at positions, head masks, absent rows;
                                             then `dense` exact rows
    merged(rows, dense)                      layer 0 owns the entries, layer 1 reads them
                                             (`share_entries`) with coded rows of its own

then `decode_rows` steps of one new row a stream (extend, write, flush), so quant tails flush into
new pages. The arena is poisoned with NaN bytes before anything is written.

Shapes: L = 2 layers, H = 2 KV heads, D head dim, T RoPE positions."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor.engine.block_tables import BlockTables
from executor.engine.kv_pool import KVPool
from kernels.paged_decode import CodedRows
from kvcore.blocks import Layout

L, H = 2, 2
ROPE_T = 2048


def dense(rows: int):
    return ("dense", rows)


def quant(form: int, rows: int, residual: int, skip: bool = False, coded: int = 0):
    return ("quant", form, rows, residual, skip, coded)


def coded(rows: int, entries: int, dense_rows: int):
    return ("coded", rows, entries, dense_rows)


def merged(rows: int, dense_rows: int):
    return ("merged", rows, dense_rows)


# name: (D, h query rows a stream, group_heads, slots)
CASES = {
    # every quant form with its dense tail (tails crossing a page's rows during the decode rows), a
    # dense stream, an empty one; one query row per head
    "D64_h3_forms": (64, 3, 3, [dense(70), *[quant(f, 2 * g + r + g - 2, r) for f, g, r in (
        (1, 192, 4), (2, 96, 0), (3, 48, 7), (4, 24, 2), (5, 128, 1), (6, 128, 0), (7, 64, 3), (8, 64, 5))],
        dense(0)]),
    # three query rows of each of 3 heads (9 a stream): SpeCache's copies with skipped and exact rows,
    # codebook rows, a merged pair, a long dense stream (several split-K tasks), a coded-only stream
    "D64_h9_g3_mixed": (64, 9, 3, [quant(6, 300, 20, skip=True, coded=40), quant(7, 200, 9, skip=True, coded=17),
                                   coded(300, 50, 33), merged(70, 5), dense(600), coded(9, 4, 0),
                                   quant(1, 420, 1, skip=True, coded=3)]),
    # the pool's 4- and 8-bit forms (the 16-lane paths of an AVX-512 host) at 5 and 2 query rows a
    # stream: the kernel's chunks of 4 + 1 and of 2 rows
    "D64_h5_g5_pool": (64, 5, 5, [quant(3, 3 * 48 + 5, 5), quant(4, 5 * 24 + 3, 3)]),
    "D64_h2_g2_pool": (64, 2, 2, [quant(4, 2 * 24 + 1, 1), quant(3, 2 * 48, 0)]),
    # an odd number of heads, each its own group (7 a stream)
    "D64_h7_g7": (64, 7, 7, [quant(3, 150, 4, skip=True, coded=5), coded(40, 12, 3), dense(300),
                             quant(8, 100, 0)]),
    # a small head dim (the scalar paths): every form, 2 rows of each of 2 heads
    "D16_h4_g2": (16, 4, 2, [*[quant(f, 2 * g + 3, 1, skip=f % 2 == 1, coded=f) for f, g in (
        (1, 120), (2, 80), (3, 48), (4, 24), (5, 96), (6, 96), (7, 64), (8, 64))], coded(30, 7, 2), merged(25, 3),
        dense(33)]),
    # one query row a stream
    "D16_h1_g1": (16, 1, 1, [dense(5), coded(20, 20, 1), quant(4, 60, 3, skip=True, coded=2)]),
}


def rope_tables(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] fp32 (HF's layout: the frequencies twice)."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(ROPE_T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().float(), emb.sin().float()


def turn(x: torch.Tensor, pos: torch.Tensor, rope) -> torch.Tensor:
    """x [n, D] fp32 pre-RoPE rows at pos [n] -> post-RoPE (rotate_half), in float64 then fp32."""
    cos, sin = (t.double()[pos.long()] for t in rope)
    x = x.double()
    half = x.shape[-1] // 2
    return (x * cos + torch.cat([-x[:, half:], x[:, :half]], -1) * sin).float()


@dataclass
class Expected:
    """What one stream (layer, slot, head) should hold: its quant-or-dense rows in order (fp16
    values as stored), which of them the skip page marks, its coded rows as attention sees them."""
    rows_k: list = field(default_factory=list)       # [n, D] fp16 pieces
    rows_v: list = field(default_factory=list)
    skip: torch.Tensor | None = None                 # [quant rows at store] bool
    coded_k: torch.Tensor | None = None              # [c, D] fp32, live coded rows
    coded_v: torch.Tensor | None = None
    coded_heads: torch.Tensor | None = None          # [c] uint8


@dataclass
class Built:
    layout: Layout
    pool: KVPool
    tables: BlockTables
    slots: list
    expected: dict                                   # (layer, slot, head) -> Expected
    rope: tuple
    group_heads: int
    h: int

    def view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's eleven tables [G = slots·H, …] (`kernels.paged_decode.NAMES`)."""
        return self.tables.decode_view(self.slots, torch.device("cpu")).layer(layer)


def _codebook(g: torch.Generator, m: int, entries: int, d: int, absent: bool = True, pre_rope: bool = True,
              masks: bool = True, k_entries: torch.Tensor | None = None, v_entries: torch.Tensor | None = None
              ) -> CodedRows:
    """Coded rows of every head: refs into `entries` entries, magnitudes, positions (-1 for some),
    random head bytes, some rows absent (ref_k -1)."""
    ref_k = torch.randint(0, entries, (H, m), generator=g, dtype=torch.int32)
    ref_v = torch.randint(0, entries, (H, m), generator=g, dtype=torch.int32)
    pos = torch.randint(0, ROPE_T, (H, m), generator=g, dtype=torch.int32) if pre_rope else torch.full((H, m), -1)
    pos = torch.where(torch.rand(H, m, generator=g) < 0.2, -1, pos).int()           # some stored post-RoPE
    if absent:
        ref_k = torch.where(torch.rand(H, m, generator=g) < 0.15, -1, ref_k).int()
    heads = torch.randint(1, 256, (H, m), generator=g).to(torch.uint8) if masks else torch.full((H, m), 255,
                                                                                                 dtype=torch.uint8)
    mag_k = (0.5 + torch.rand(H, m, generator=g)).half()
    mag_v = (0.5 + torch.rand(H, m, generator=g)).half()
    ke = torch.randn(H, entries, d, generator=g).half() if k_entries is None else k_entries
    ve = torch.randn(H, entries, d, generator=g).half() if v_entries is None else v_entries
    return CodedRows(ref_k, ref_v, pos, mag_k, mag_v, heads, ke, ve)


def _expect_coded(e: Expected, c: CodedRows, head: int, rope) -> None:
    live = c.ref_k[head] >= 0
    rk, rv = c.ref_k[head][live].long(), c.ref_v[head][live].long()
    k = c.k_entries[head].half().float()[rk] * c.mag_k[head][live].float()[:, None]
    pos = c.pos[head][live]
    if bool((pos >= 0).any()):
        k[pos >= 0] = turn(k[pos >= 0], pos[pos >= 0], rope)
    e.coded_k = k
    e.coded_v = c.v_entries[head].half().float()[rv] * c.mag_v[head][live].float()[:, None]
    e.coded_heads = c.heads[head][live]


def build(name: str, decode_rows: int = 3) -> Built:
    d, h, gh, specs = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    lay = Layout(d)
    pool = KVPool(lay, 6 << 20)
    pool.arena.fill_(0xFF)                                   # NaN in fp16: any byte read unwritten shows
    tables = BlockTables(pool, L, H, len(specs), 2048)
    rope = rope_tables(d)
    exp: dict = {}
    slots = []
    for spec in specs:
        s = tables.open()
        slots.append(s)
        for layer in range(L):
            es = [Expected() for _ in range(H)]
            kind = spec[0]
            if kind == "dense":
                k, v = torch.randn(H, spec[1], d, generator=g).half(), torch.randn(H, spec[1], d, generator=g).half()
                tables.store_dense(layer, s, k, v)
                for i, e in enumerate(es):
                    e.rows_k.append(k[i]), e.rows_v.append(v[i])
            elif kind == "quant":
                _, form, rows, residual, skip, n_coded = spec
                k, v = torch.randn(H, rows, d, generator=g).half(), torch.randn(H, rows, d, generator=g).half()
                tables.store_quant(layer, s, k, v, form, residual)
                for i, e in enumerate(es):
                    e.rows_k.append(k[i]), e.rows_v.append(v[i])
                if n_coded:                              # exact rows beside the quant ones (SpeCache's)
                    ck = torch.randn(H, n_coded, d, generator=g).half()
                    cv = torch.randn(H, n_coded, d, generator=g).half()
                    c = CodedRows.exact(ck, cv)
                    if n_coded > 2:                      # a slot not filled yet: absent
                        ref_k = c.ref_k.clone()
                        ref_k[:, 1] = -1
                        c = CodedRows(ref_k, c.ref_v, c.pos, c.mag_k, c.mag_v, c.heads, ck, cv)
                    tables.store_coded(layer, s, c, replace=False)
                    for i, e in enumerate(es):
                        _expect_coded(e, c, i, rope)
                if skip:
                    nq = int(tables.qn[layer, s, 0]) * lay.quant_forms[form].rows
                    mask = torch.rand(H, nq, generator=g) < 0.3
                    tables.set_skip(layer, s, mask)
                    for i, e in enumerate(es):
                        e.skip = mask[i]
            elif kind == "coded":
                _, m, n_e, n_d = spec
                c = _codebook(g, m, n_e, d)
                k, v = torch.randn(H, n_d, d, generator=g).half(), torch.randn(H, n_d, d, generator=g).half()
                tables.store_coded(layer, s, c, k, v)
                for i, e in enumerate(es):
                    _expect_coded(e, c, i, rope)
                    e.rows_k.append(k[i]), e.rows_v.append(v[i])
            elif kind == "merged":
                _, m, n_d = spec
                if layer == 0:
                    owner = _codebook(g, m, m, d, absent=False, masks=False, pre_rope=False)
                    c = owner
                else:                                    # the lower layer: its own rows, the upper's entries
                    c = _codebook(g, m, m, d, absent=False, masks=False, pre_rope=False,
                                  k_entries=owner.k_entries, v_entries=owner.v_entries)
                k, v = torch.randn(H, n_d, d, generator=g).half(), torch.randn(H, n_d, d, generator=g).half()
                if layer == 0:
                    tables.store_coded(layer, s, c, k, v)
                else:
                    tables.store_coded(layer, s, c, k, v, entries=False)
                    tables.share_entries(layer, 0, s)
                for i, e in enumerate(es):
                    _expect_coded(e, c, i, rope)
                    e.rows_k.append(k[i]), e.rows_v.append(v[i])
            for i, e in enumerate(es):
                exp[(layer, s, i)] = e
    for _ in range(decode_rows):                         # decode steps: one row a stream, tails flush
        w = tables.extend(slots, [1] * len(slots))
        for layer in range(L):
            k = torch.randn(len(slots), H, d, generator=g).half()
            v = torch.randn(len(slots), H, d, generator=g).half()
            tables.write(w, layer, k, v)
            for j, s in enumerate(slots):
                for i in range(H):
                    exp[(layer, s, i)].rows_k.append(k[j, i:i + 1])
                    exp[(layer, s, i)].rows_v.append(v[j, i:i + 1])
        tables.flush(slots)
    return Built(lay, pool, tables, slots, exp, rope, gh, h)


def queries(built: Built, layer: int) -> torch.Tensor:
    """q [G, h, D] for a layer's view."""
    g = torch.Generator().manual_seed(1000 + layer)
    return torch.randn(len(built.slots) * H, built.h, built.layout.head_dim, generator=g)


def kernel_args(built: Built, layer: int) -> tuple:
    """(q, arena, *tables, layout, scaling) of a layer's view; rope and group_heads go by keyword."""
    return (queries(built, layer), built.pool.arena, *built.view(layer), built.layout,
            built.layout.head_dim ** -0.5)
