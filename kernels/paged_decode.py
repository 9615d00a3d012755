"""Decode attention over the engine's paged pool: a few query rows per stream, every stream of a
layer (each KV head of each sequence in the step) in one call, whatever storage forms the streams
use — the forms are data the kernel reads (`kvcore.blocks`, `executor.engine.block_tables`):

    quant   qn pages of quant form qform (K per channel and key group, V per row and value group,
            fp16 scales and zeros) at qtable[i]: rows [0, qn·g); a skip page (xpage >= 0) marks
            rows left out (their exact rows are coded)
    coded   cn rows described in coded pages ctable[i] (per row: K entry, V entry, position, K and
            V magnitudes, the query heads that see it): k = mag_k · E_k[ref_k], turned by RoPE at
            `pos` when pos >= 0 (codebook keys are stored pre-RoPE), v = mag_v · E_v[ref_v];
            entries in entry pages ektable / evtable; ref_k < 0: no row
    dense   rows [dstart, dend) in dense pages dtable[r // R] (K rows [R, D], then V rows [R, D])

all in one softmax per query row: out [G, h, D] and its log-sum-exp [G, h] (a stream without a
row: zeros and -inf), so partial results merge (SpeCache's guess row adds its own row after).

    kernels     C++ on the CPU (`kernels/cpu_decode.cpp` `paged_decode`: split-K tasks over runs of
                pages, combined in a fixed order) and Triton on CUDA (`_paged_decode_kernel`)
    launcher    `paged_decode`: checks shapes and dtypes, picks the kernel for the device
    reference   `paged_decode_reference`: the same math in plain torch, stream by stream
                (`stream_rows` gives a stream's rows as attention sees them)

Shapes: G streams, h query rows per stream (a step's query heads of the KV head, times its rows),
D head dim, MB table widths, F quant forms, T positions of the RoPE tables."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import cpu_extension
from kernels._triton import HAS_TRITON, pow2_at_least, tl, triton
from kernels.backend import backend
from kernels.quant import unpack_dequantize_reference
from kvcore.blocks import Layout

TASK_ROWS = 256        # rows of one split-K task on the CPU
ALL_HEADS = 0xFF       # a row every query head of its group sees


@dataclass(frozen=True)
class CodedRows:
    """Coded rows of every KV head of a layer, what `BlockTables.store_coded` writes: per head M
    rows and n_k / n_v entries."""
    ref_k: torch.Tensor          # [H, M] int32: K entry (< 0: no row)
    ref_v: torch.Tensor          # [H, M] int32: V entry
    pos: torch.Tensor            # [H, M] int32: RoPE position of a pre-RoPE key entry; -1: stored post-RoPE
    mag_k: torch.Tensor          # [H, M] fp16
    mag_v: torch.Tensor          # [H, M] fp16
    heads: torch.Tensor          # [H, M] uint8: bit j, query head j of the group sees the row
    k_entries: torch.Tensor      # [H, n_k, D] storage dtype
    v_entries: torch.Tensor      # [H, n_v, D]

    @classmethod
    def exact(cls, k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None = None) -> "CodedRows":
        """Rows k, v [H, M, D] (post-RoPE) kept exact: each its own entry, magnitude 1."""
        h, m, _ = k.shape
        ref = torch.arange(m, dtype=torch.int32).expand(h, m).contiguous()
        one = torch.ones(h, m, dtype=torch.float16)
        return cls(ref, ref.clone(), torch.full((h, m), -1, dtype=torch.int32), one, one.clone(),
                   torch.full((h, m), ALL_HEADS, dtype=torch.uint8) if heads is None else heads.to(torch.uint8),
                   k, v)


@functools.lru_cache(maxsize=None)
def form_table(layout: Layout) -> torch.Tensor:
    """[F, 4] int32: each quant form's bits, rows, key group and value group (made once per layout;
    read only)."""
    return torch.tensor([[f.bits, f.rows, f.key_group, f.value_group] for f in layout.quant_forms], dtype=torch.int32)


def dequantize_pages(arena: torch.Tensor, pages: torch.Tensor, form: int, layout: Layout
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quant pages [n] of `form` -> their K, V rows [n·g, D] fp32, in order."""
    d, page = layout.head_dim, layout.page_bytes
    n = pages.numel()
    if n == 0 or form == 0:
        empty = torch.empty(0, d, dtype=torch.float32, device=arena.device)
        return empty, empty
    f = layout.quant_forms[form]
    g, kg, gv, bits = f.rows, f.key_group, f.value_group, f.bits
    parts = layout.form_parts(form)
    size = sum(x for _, x in parts.values())
    at = pages.to(arena.device).long()[:, None] * page + torch.arange(size, device=arena.device)   # [n, bytes]
    raw = arena[at]                                                                                # [n, bytes] u8
    part = {name: raw[:, a:a + m] for name, (a, m) in parts.items()}
    f16 = lambda x: x.contiguous().view(torch.float16)          # noqa: E731
    sub = g // kg
    codes = part["kc"].reshape(n, d, sub, kg * bits // 8).transpose(1, 2).reshape(n * sub * d, -1)
    k = unpack_dequantize_reference(codes, f16(part["ks"]).reshape(n * sub * d, 1),
                                    f16(part["kz"]).reshape(n * sub * d, 1), bits, kg)            # [n·sub·D, kg]
    k = k.view(n, sub, d, kg).transpose(2, 3).reshape(n * g, d)
    v = unpack_dequantize_reference(part["vc"].reshape(n * g, -1), f16(part["vs"]).reshape(n * g, -1),
                                    f16(part["vz"]).reshape(n * g, -1), bits, gv)                 # [n·g, D]
    return k, v


def dense_rows(arena: torch.Tensor, table: torch.Tensor, start: int, end: int, layout: Layout
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [start, end) of a stream whose dense table is `table` [MB] -> K, V [end - start, D]
    in the storage dtype (fp16, or fp32 where the layout stores 4 bytes)."""
    rows = arena.view(torch.float16 if layout.itemsize == 2 else torch.float32).view(-1, layout.head_dim)
    r = torch.arange(start, end, device=table.device)
    at = (layout.first_row(table.long()[r // layout.rows]) + r % layout.rows).to(arena.device)
    return rows[at], rows[at + layout.rows]


def coded_fields(arena: torch.Tensor, table: torch.Tensor, n: int, layout: Layout) -> dict[str, torch.Tensor]:
    """The first n rows of a stream's coded pages `table` [MB] -> each field [n]."""
    m = layout.coded_rows
    r = torch.arange(n)
    page, at = table.long()[r // m].to(arena.device), (r % m).to(arena.device)
    out = {}
    for name, (off, size) in layout.coded_parts().items():
        item = size // m
        idx = page[:, None] * layout.page_bytes + off + at[:, None] * item + torch.arange(item, device=arena.device)
        raw = arena[idx].contiguous()                                                       # [n, item]
        dtype = {4: torch.int32, 2: torch.float16, 1: torch.uint8}[item]
        out[name] = raw.view(dtype).view(n)
    return out


def entry_rows(arena: torch.Tensor, table: torch.Tensor, refs: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Entries `refs` [n] of a stream's entry pages `table` [MB] -> [n, D] in the storage dtype."""
    rows = arena.view(torch.float16 if layout.itemsize == 2 else torch.float32).view(-1, layout.head_dim)
    e = layout.entry_rows
    r = refs.long().cpu()
    at = layout.first_row(table.long()[r // e]) + r % e
    return rows[at.to(arena.device)]


def rotate(x: torch.Tensor, pos: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [n, D] fp32 pre-RoPE rows at positions pos [n] -> post-RoPE (HF's rotate_half); rope: the
    (cos, sin) tables [T, D]."""
    cos, sin = rope[0][pos.long().to(rope[0].device)].to(x.device), rope[1][pos.long().to(rope[1].device)].to(x.device)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[:, half:], x[:, :half]), dim=-1) * sin


def skipped(arena: torch.Tensor, page: int, n: int, layout: Layout) -> torch.Tensor:
    """[n] bool: the quant rows a skip page marks (all False without one)."""
    if page < 0 or n == 0:
        return torch.zeros(n, dtype=torch.bool)
    raw = arena[page * layout.page_bytes:page * layout.page_bytes + (n + 7) // 8].cpu()
    bits = (raw[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(-1)[:n].bool()


def stream_rows(arena, dtable, dstart, dend, qtable, qn, qform, ctable, cn, ektable, evtable, xpage,
                layout: Layout, rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stream's rows as attention sees them: its quant rows not skipped, its coded rows, its
    dense rows -> K, V [U, D] fp32 and heads [U] uint8 (the group's query heads seeing each)."""
    n, form = int(qn), int(qform)
    kq, vq = dequantize_pages(arena, qtable[:n], form, layout)
    keep = ~skipped(arena, int(xpage), kq.shape[0], layout).to(kq.device)
    kq, vq = kq[keep], vq[keep]
    c = int(cn)
    f = coded_fields(arena, ctable, c, layout) if c else None
    if f is not None and c:
        live = f["ref_k"] >= 0
        f = {name: x[live] for name, x in f.items()}
        kc = entry_rows(arena, ektable, f["ref_k"], layout).float() * f["mag_k"].float()[:, None]
        vc = entry_rows(arena, evtable, f["ref_v"], layout).float() * f["mag_v"].float()[:, None]
        turned = f["pos"] >= 0
        if bool(turned.any()):
            if rope is None:
                raise ValueError("coded keys stored pre-RoPE need the RoPE tables")
            kc[turned] = rotate(kc[turned], f["pos"][turned], rope)
        hc = f["heads"]
    else:
        kc = vc = torch.empty(0, layout.head_dim, device=arena.device)
        hc = torch.empty(0, dtype=torch.uint8, device=arena.device)
    kd, vd = dense_rows(arena, dtable, int(dstart), int(dend), layout)
    k = torch.cat([kq, kc, kd.float()])
    v = torch.cat([vq, vc, vd.float()])
    heads = torch.cat([torch.full((kq.shape[0],), ALL_HEADS, dtype=torch.uint8, device=arena.device), hc,
                       torch.full((kd.shape[0],), ALL_HEADS, dtype=torch.uint8, device=arena.device)])
    return k, v, heads


def paged_decode_reference(q: torch.Tensor, arena: torch.Tensor, dtable, dstart, dend, qtable, qn, qform, ctable, cn,
                           ektable, evtable, xpage, layout: Layout, scaling: float, rope=None,
                           group_heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [G, h, D] -> out [G, h, D] fp32, lse [G, h] fp32: each stream's softmax(q·kᵀ·scaling)·v over
    its rows (`stream_rows`); query row j sees a coded row when bit j % group_heads of its heads is
    set (group_heads: the group's query heads; default h)."""
    g, h, d = q.shape
    hn = group_heads or h
    out = torch.zeros(g, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((g, h), float("-inf"), dtype=torch.float32, device=q.device)
    bit = (1 << (torch.arange(h) % hn)).to(torch.uint8)
    for i in range(g):
        k, v, heads = stream_rows(arena, dtable[i], dstart[i], dend[i], qtable[i], qn[i], qform[i], ctable[i], cn[i],
                                  ektable[i], evtable[i], xpage[i], layout, rope)
        if not k.shape[0]:
            continue
        s = q[i].float() @ k.T.to(q.device) * scaling                                     # [h, U]
        seen = (heads.to(q.device)[None, :] & bit.to(q.device)[:, None]) > 0
        s = s.masked_fill(~seen, float("-inf"))
        lse[i] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[i][:, None]).nan_to_num(0.0)
        out[i] = p @ v.to(q.device)
    return out, lse


NAMES = ("dtable", "dstart", "dend", "qtable", "qn", "qform", "ctable", "cn", "ektable", "evtable", "xpage")


def _check(q, arena, tables) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [G, h, D], got {list(q.shape)}")
    g = q.shape[0]
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise ValueError(f"arena must be uint8 [bytes], got {arena.dtype} {list(arena.shape)}")
    for name, t in zip(NAMES, tables):
        two = name.endswith("table")
        if t.dtype != torch.int32 or t.dim() != (2 if two else 1) or t.shape[0] != g:
            raise ValueError(f"{name} must be int32 [{g}{', MB' if two else ''}], got {t.dtype} {list(t.shape)}")


def paged_decode(q: torch.Tensor, arena: torch.Tensor, dtable, dstart, dend, qtable, qn, qform, ctable, cn, ektable,
                 evtable, xpage, layout: Layout, scaling: float, rope=None,
                 group_heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [G, h, D]; arena [bytes] u8; the streams' tables (`NAMES`; int32, [G, MB] or [G], on the
    arena's device for CUDA, the CPU otherwise); rope: (cos, sin) [T, D] fp32 for pre-RoPE coded
    keys -> out [G, h, D] fp32, lse [G, h] fp32."""
    tables = (dtable, dstart, dend, qtable, qn, qform, ctable, cn, ektable, evtable, xpage)
    _check(q, arena, tables)
    kind = backend(arena.device)                                  # `kernels.backend` decides
    if kind == "triton" and hasattr(_kernels, "paged_decode_triton"):
        return _kernels.paged_decode_triton(q, arena, *tables, layout, scaling, rope, group_heads)
    mod = cpu_extension.module() if kind == "cpp" and layout.itemsize == 2 else None   # the C++ reads fp16 pages
    if mod is not None and hasattr(mod, "paged_decode_mixed"):
        cos, sin = rope if rope is not None else (torch.zeros(1, layout.head_dim), torch.zeros(1, layout.head_dim))
        out, lse = mod.paged_decode_mixed(q.float().contiguous(), arena, *(t.contiguous() for t in tables),
                                          form_table(layout), cos.float().contiguous(), sin.float().contiguous(),
                                          layout.page_bytes, layout.rows, layout.coded_rows, layout.entry_rows,
                                          int(group_heads or q.shape[1]), float(scaling), TASK_ROWS)
        return out, lse
    return paged_decode_reference(q, arena, *tables, layout, scaling, rope, group_heads)


class _kernels:
    """The device kernels, where they are built (`paged_decode_triton` below, with Triton)."""


# ---- the Triton kernels (CUDA; anywhere under TRITON_INTERPRET=1) ---------------------------------
# Flash-decoding: a grid of (streams × splits × chunks of 8 query rows), split s of a stream taking the
# s-th share of each of its parts (quant pages, coded rows, dense pages) in an online softmax, its
# partial (m, l, acc) kept per query row; a second kernel merges a stream's partials by log-sum-exp.
# The split count comes from the table widths alone, so nothing is read back to the host and the only
# allocations are the outputs and the partials: a CUDA graph can hold the call.

SPLIT_PAGES = 16       # pages (at the tables' widths) a split takes at most
MAX_SPLITS = 64
ROW_CHUNK = 8          # query rows a program takes at most (more rows: more programs over the same pages).
                       # On an H100 (Triton 3.6), a program of 16 rows went wrong: its p·v, a sum over
                       # the middle axis of [16, T, D] products, came out 7e-4 off at T = 16 (like a
                       # TF32 product) and wholly wrong at T = 8; at 8 rows it is exact (1e-7)
_DEVICE_CONSTANTS: dict = {}


def triton_splits(dtable: torch.Tensor, qtable: torch.Tensor, ctable: torch.Tensor) -> int:
    """Splits of every stream, from the tables' widths [G, MB] alone: enough for the widest part
    at SPLIT_PAGES pages a split. A split's share of a stream is fixed (its s-th run of SPLIT_PAGES
    pages of each part), so a stream's result does not depend on what else is in the call."""
    return max(1, min(MAX_SPLITS, max(-(-t.shape[1] // SPLIT_PAGES) for t in (dtable, qtable, ctable))))


def _constants(layout: Layout, device: torch.device, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The form table [F, 4] on the device (made once per layout and device) and the RoPE tables
    (cos, sin [T, D] fp32; without rope, a dummy row and T = 0: no coded key is turned)."""
    key = (layout, str(device))
    if key not in _DEVICE_CONSTANTS:
        _DEVICE_CONSTANTS[key] = (form_table(layout).to(device),
                                  torch.zeros(1, layout.head_dim, dtype=torch.float32, device=device))
    forms, dummy = _DEVICE_CONSTANTS[key]
    if rope is None:
        return forms, dummy, dummy, 0
    cos, sin = (x.to(device=device, dtype=torch.float32).contiguous() for x in rope)
    return forms, cos, sin, cos.shape[0]


if HAS_TRITON:

    @triton.jit
    def _online(m_i, l_i, acc, sc, v):
        """One tile into a running softmax: sc [HC, T] scores (-inf: unseen), v [T, D] fp32."""
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)         # a row that saw nothing yet
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(sc - m_use[:, None])
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_split(
        q_ptr,                    # [G, H, D] fp32 contiguous
        arena_ptr,                # [bytes] uint8
        m_ptr, l_ptr, acc_ptr,    # partials [G, S, HP], [G, S, HP], [G, S, HP, D] fp32
        dt_ptr, ds_ptr, de_ptr,   # [G, MBD], [G], [G] int32
        qt_ptr, qn_ptr, qf_ptr,   # [G, MBQ], [G], [G]
        ct_ptr, cn_ptr,           # [G, MBC], [G]
        ekt_ptr, evt_ptr,         # [G, MBK], [G, MBV]
        xp_ptr,                   # [G]
        form_ptr,                 # [F, 4] int32: bits, rows, key group, value group
        cos_ptr, sin_ptr, T,      # [T, D] fp32 (T = 0: no RoPE tables)
        MBD, MBQ, MBC, MBK, MBV, PAGE, S, GH, scaling,
        H: tl.constexpr,          # query rows a stream
        HC: tl.constexpr,         # query rows a program takes (a power of two, 8 at most)
        HP: tl.constexpr,         # the partials' rows a stream: H rounded up to a multiple of HC
        D: tl.constexpr,
        R: tl.constexpr,          # dense rows a page
        M: tl.constexpr,          # coded rows a page
        E: tl.constexpr,          # entries an entry page
        TQ: tl.constexpr,         # rows of a tile (quant, coded, dense; TQ <= R, a power of two)
        SP: tl.constexpr,         # pages a split takes (SPLIT_PAGES; coded: SP pages' worth of coded rows)
    ):
        sid = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        hh = tl.program_id(2) * HC + tl.arange(0, HC)         # this program's query rows
        d = tl.arange(0, D)
        tt = tl.arange(0, TQ)
        hmask = hh < H
        q = tl.load(q_ptr + (sid * H + hh[:, None]) * D + d[None, :], mask=hmask[:, None], other=0.0) * scaling
        m_i = tl.full([HC], float("-inf"), tl.float32)
        l_i = tl.zeros([HC], tl.float32)
        acc = tl.zeros([HC, D], tl.float32)
        half_ptr = arena_ptr.to(tl.pointer_type(tl.float16))
        word_ptr = arena_ptr.to(tl.pointer_type(tl.int32))

        # quant pages of the stream's form: this split's share of them, in tiles of TQ rows
        form = tl.load(qf_ptr + sid)
        pages = tl.where(form > 0, tl.load(qn_ptr + sid), 0)
        bits = tl.maximum(tl.load(form_ptr + form * 4), 1)
        g = tl.maximum(tl.load(form_ptr + form * 4 + 1), 1)
        kg = tl.maximum(tl.load(form_ptr + form * 4 + 2), 1)
        gv = tl.maximum(tl.load(form_ptr + form * 4 + 3), 1)
        per = 8 // bits
        levels = (1 << bits) - 1
        cst = g * bits // 8                                   # a channel's code bytes
        off_ks = D * cst
        off_kz = off_ks + (g // kg) * D * 2
        off_vc = off_kz + (g // kg) * D * 2
        off_vs = off_vc + g * (D * bits // 8)
        off_vz = off_vs + g * (D // gv) * 2
        skip = tl.load(xp_ptr + sid).to(tl.int64)
        tiles = (g + TQ - 1) // TQ
        share = tl.maximum(SP, (pages + S - 1) // S)          # SPLIT_PAGES, unless the widest part passes the grid
        p0 = split * share
        p1 = tl.minimum(pages, p0 + share)
        for it in range(p0 * tiles, p1 * tiles):
            j = it // tiles
            t = (it % tiles) * TQ + tt                        # rows of the page
            valid = t < g
            base = tl.load(qt_ptr + sid * MBQ + j).to(tl.int64) * PAGE
            kbyte = tl.load(arena_ptr + base + d[None, :] * cst + t[:, None] // per, mask=valid[:, None],
                            other=0).to(tl.int32)
            kcode = (kbyte >> ((t[:, None] % per) * bits)) & levels
            grp = (t // kg)[:, None] * D + d[None, :]          # the row's key group, per channel
            ks = tl.load(half_ptr + (base + off_ks) // 2 + grp, mask=valid[:, None], other=0.0).to(tl.float32)
            kz = tl.load(half_ptr + (base + off_kz) // 2 + grp, mask=valid[:, None], other=0.0).to(tl.float32)
            k = kcode.to(tl.float32) * ks + kz                                              # [TQ, D]
            vbyte = tl.load(arena_ptr + base + off_vc + t[:, None] * (D * bits // 8) + d[None, :] // per,
                            mask=valid[:, None], other=0).to(tl.int32)
            vcode = (vbyte >> ((d[None, :] % per) * bits)) & levels
            run = t[:, None] * (D // gv) + d[None, :] // gv
            vs = tl.load(half_ptr + (base + off_vs) // 2 + run, mask=valid[:, None], other=0.0).to(tl.float32)
            vz = tl.load(half_ptr + (base + off_vz) // 2 + run, mask=valid[:, None], other=0.0).to(tl.float32)
            v = vcode.to(tl.float32) * vs + vz                                              # [TQ, D]
            r = j * g + t                                     # the stream's quant row
            xmask = valid & ((r * 0 + skip) >= 0)             # [TQ] (a scalar's compare broadcast first)
            xbyte = tl.load(arena_ptr + tl.maximum(skip, 0) * PAGE + r // 8, mask=xmask, other=0).to(tl.int32)
            keep = valid & (((xbyte >> (r % 8)) & 1) == 0)
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                              # [HC, TQ]
            sc = tl.where(keep[None, :], sc, float("-inf"))
            m_i, l_i, acc = _online(m_i, l_i, acc, sc, v)

        # coded rows: this split's share of them, in tiles of TQ rows
        rows = tl.load(cn_ptr + sid)
        cshare = tl.maximum(SP * M, ((rows + S - 1) // S + TQ - 1) // TQ * TQ)
        r0 = split * cshare
        r1 = tl.minimum(rows, r0 + cshare)
        half = (d + D // 2) % D                               # rotate_half's source channel
        for r in range(r0, r1, TQ):
            rr = r + tt
            valid = rr < r1
            fb = tl.load(ct_ptr + sid * MBC + rr // M, mask=valid, other=0).to(tl.int64) * PAGE
            slot = rr % M
            ref_k = tl.load(word_ptr + fb // 4 + slot, mask=valid, other=-1)
            ref_v = tl.load(word_ptr + fb // 4 + M + slot, mask=valid, other=0)
            pos = tl.load(word_ptr + fb // 4 + 2 * M + slot, mask=valid, other=-1)
            mag_k = tl.load(half_ptr + fb // 2 + 6 * M + slot, mask=valid, other=0.0).to(tl.float32)
            mag_v = tl.load(half_ptr + fb // 2 + 7 * M + slot, mask=valid, other=0.0).to(tl.float32)
            heads = tl.load(arena_ptr + fb + 16 * M + slot, mask=valid, other=0).to(tl.int32)
            live = valid & (ref_k >= 0)
            ref_k = tl.maximum(ref_k, 0)
            ref_v = tl.maximum(ref_v, 0)
            kp = tl.load(ekt_ptr + sid * MBK + ref_k // E, mask=live, other=0).to(tl.int64)
            krow = kp * (PAGE // 2) + (ref_k % E) * D                                        # in fp16 elements
            x = tl.load(half_ptr + krow[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            xr = tl.load(half_ptr + krow[:, None] + half[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            xr = tl.where(d[None, :] < D // 2, -xr, xr)
            turned = live & (pos >= 0) & (pos < T)
            at = tl.where(turned, pos, 0).to(tl.int64)[:, None] * D + d[None, :]
            cs = tl.load(cos_ptr + at, mask=turned[:, None], other=1.0)
            sn = tl.load(sin_ptr + at, mask=turned[:, None], other=0.0)
            k = (x * cs + xr * sn) * mag_k[:, None]                                          # [TQ, D]
            vp = tl.load(evt_ptr + sid * MBV + ref_v // E, mask=live, other=0).to(tl.int64)
            v = tl.load(half_ptr + vp[:, None] * (PAGE // 2) + (ref_v % E)[:, None] * D + d[None, :],
                        mask=live[:, None], other=0.0).to(tl.float32) * mag_v[:, None]
            seen = ((heads[None, :] >> (hh[:, None] % GH)) & 1) != 0                         # [HC, TQ]
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            sc = tl.where(live[None, :] & seen, sc, float("-inf"))
            m_i, l_i, acc = _online(m_i, l_i, acc, sc, v)

        # dense rows [start, end): this split's share of the pages, in tiles of TQ rows
        start = tl.load(ds_ptr + sid)
        end = tl.load(de_ptr + sid)
        b0 = start // R
        b1 = tl.where(end > start, (end + R - 1) // R, b0)
        dshare = tl.maximum(SP, (b1 - b0 + S - 1) // S)
        q0 = b0 + split * dshare
        q1 = tl.minimum(b1, q0 + dshare)
        for it in range(q0 * (R // TQ), q1 * (R // TQ)):
            blk = it // (R // TQ)
            t = (it % (R // TQ)) * TQ + tt                    # rows of the page
            row = blk * R + t
            valid = (row >= start) & (row < end)
            first = tl.load(dt_ptr + sid * MBD + blk).to(tl.int64) * (PAGE // 2)            # in fp16 elements
            k = tl.load(half_ptr + first + t[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(half_ptr + first + (R + t[:, None]) * D + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_i, l_i, acc = _online(m_i, l_i, acc, sc, v)

        o = sid * S + split
        tl.store(m_ptr + o * HP + hh, m_i)
        tl.store(l_ptr + o * HP + hh, l_i)
        tl.store(acc_ptr + (o * HP + hh[:, None]) * D + d[None, :], acc)

    @triton.jit
    def _paged_decode_merge(
        m_ptr, l_ptr, acc_ptr,    # partials [G, S, HP], [G, S, HP], [G, S, HP, D] fp32
        out_ptr, lse_ptr,         # [G, H, D], [G, H] fp32
        S,
        H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
        SP: tl.constexpr,         # S rounded up to a power of two
    ):
        sid = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        sp = tl.arange(0, SP)
        d = tl.arange(0, D)
        at = (sid * S + sp) * HP + j
        live = sp < S
        m = tl.load(m_ptr + at, mask=live, other=float("-inf"))
        l_s = tl.load(l_ptr + at, mask=live, other=0.0)
        a = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=live[:, None], other=0.0)     # [SP, D]
        top = tl.max(m, axis=0)
        top_use = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m - top_use)
        total = tl.sum(w * l_s, axis=0)
        o = tl.sum(w[:, None] * a, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + (sid * H + j) * D + d, o)
        tl.store(lse_ptr + sid * H + j, tl.where(total > 0, top_use + tl.log(total), float("-inf")))


def paged_decode_triton(q, arena, dtable, dstart, dend, qtable, qn, qform, ctable, cn, ektable, evtable, xpage,
                        layout: Layout, scaling: float, rope=None, group_heads: int | None = None,
                        splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels (CUDA, or anywhere under TRITON_INTERPRET=1): `paged_decode`'s arguments,
    every table on the arena's device -> out [G, h, D] fp32, lse [G, h] fp32. splits: the splits of
    each stream (default `triton_splits`, from the table widths). A coded key stored pre-RoPE is
    read unturned when rope is None (the reference refuses it)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    d = layout.head_dim
    if layout.itemsize != 2 or d & (d - 1) or d < 2:
        raise ValueError("the Triton paged kernel needs fp16 rows and a power-of-two head dim")
    g, h, _ = q.shape
    hn = int(group_heads or h)
    if not 1 <= hn <= 8:
        raise ValueError(f"group_heads must be 1..8 (a byte of heads a coded row), got {hn}")
    dev = arena.device
    out = torch.empty(g, h, d, dtype=torch.float32, device=dev)
    lse = torch.empty(g, h, dtype=torch.float32, device=dev)
    if g == 0 or h == 0:
        return out, lse
    q = q.to(device=dev, dtype=torch.float32).contiguous()
    t = [x.contiguous() for x in (dtable, dstart, dend, qtable, qn, qform, ctable, cn, ektable, evtable, xpage)]
    forms, cos, sin, rows = _constants(layout, dev, rope)
    s = int(splits or triton_splits(t[0], t[3], t[6]))
    hc = min(pow2_at_least(h), ROW_CHUNK)
    chunks = -(-h // hc)
    hp = chunks * hc
    tile = min(layout.rows, max(8, 8192 // (hc * d)))            # a tile's [HC, TQ, D] products: 8k at most
    m = torch.empty(g, s, hp, dtype=torch.float32, device=dev)
    l_s = torch.empty(g, s, hp, dtype=torch.float32, device=dev)
    acc = torch.empty(g, s, hp, d, dtype=torch.float32, device=dev)
    _paged_decode_split[(g, s, chunks)](
        q, arena, m, l_s, acc, *t, forms, cos, sin, rows,
        t[0].shape[1], t[3].shape[1], t[6].shape[1], t[8].shape[1], t[9].shape[1], layout.page_bytes, s, hn,
        float(scaling), H=h, HC=hc, HP=hp, D=d, R=layout.rows, M=layout.coded_rows, E=layout.entry_rows, TQ=tile, SP=SPLIT_PAGES)
    _paged_decode_merge[(g, h)](m, l_s, acc, out, lse, s, H=h, HP=hp, D=d, SP=pow2_at_least(s))
    return out, lse


if HAS_TRITON:
    _kernels.paged_decode_triton = staticmethod(paged_decode_triton)
