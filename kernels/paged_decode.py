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

from dataclasses import dataclass

import torch

from kernels import cpu_extension
from kernels._triton import HAS_TRITON, pow2_at_least, tl, triton
from kernels.quant import unpack_dequantize_reference
from kvcore.blocks import Layout

TASK_ROWS = 256        # rows of one split-K task on the CPU
ENABLED = True         # False: the reference everywhere (benches compare both in one process)
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


def form_table(layout: Layout) -> torch.Tensor:
    """[F, 4] int32: each quant form's bits, rows, key group and value group."""
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
    mod = cpu_extension.module() if ENABLED and not arena.is_cuda and layout.itemsize == 2 else None
    if ENABLED and arena.is_cuda and HAS_TRITON and hasattr(_kernels, "paged_decode_triton"):
        return _kernels.paged_decode_triton(q, arena, *tables, layout, scaling, rope, group_heads)
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
