"""Decode attention over the engine's paged pool: one query row per head, every stream of a layer
(each KV head of each sequence in the step) in one call, each over its quantized groups and its
dense fp16 rows in one softmax — a layer whose oldest rows are quantized and newest dense needs
no second pass and no merge outside the kernel.

A stream's storage (`kvcore.blocks`, `executor.engine.kv_pool`): groups 0..qn-1 at pages
qtable[i] (one KIVI group of g rows a page at qbits bits, g = `kvcore.blocks.quant_shape`: K codes
per channel, V codes per token, fp16 scales and zeros), then rows [dstart, dend) in dense pages of
R rows at pages dtable[r // R] (K rows [R, D] then V rows [R, D], fp16).

    kernels     C++ on the CPU (`kernels/cpu_decode.cpp`, `paged_decode`: split-K over runs of
                groups and of dense blocks, combined in a fixed order; AVX2 paths for the
                shapes kvplan runs) and Triton on CUDA (`_paged_decode_kernel`: one program per
                stream, online softmax over its groups then its dense blocks)
    launcher    `paged_decode`: checks shapes and dtypes, picks the kernel for the device
    reference   `paged_decode_reference`: the same math in plain torch, stream by stream

Shapes: G streams, h query heads per stream, D head dim, MB table widths."""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels._triton import HAS_TRITON, pow2_at_least, tl, triton
from kernels.quant import unpack_dequantize_reference
from kvcore.blocks import QUANT_BITS, Layout

TASK_ROWS = 256        # rows of one split-K task on the CPU
ENABLED = True         # False: the reference everywhere (benches compare both in one process)


def dequantize_groups(arena: torch.Tensor, pages: torch.Tensor, bits: int, layout: Layout
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups at `pages` [n] -> their K, V rows [n·g, D] fp32, in order."""
    d, page = layout.head_dim, layout.page_bytes
    n = pages.numel()
    if n == 0:
        empty = torch.empty(0, d, dtype=torch.float32, device=arena.device)
        return empty, empty
    g, gv = layout.group_rows(bits), layout.value_group(bits)
    gb = layout.quant_bytes(bits)
    at = pages.to(arena.device).long()[:, None] * page + torch.arange(gb, device=arena.device)   # [n, gb]
    raw = arena[at]                                                                               # [n, gb] u8
    part = {name: raw[:, a:a + m] for name, (a, m) in layout.quant_parts(bits).items()}
    f16 = lambda x: x.contiguous().view(torch.float16)          # noqa: E731
    k = unpack_dequantize_reference(part["kc"].reshape(n * d, -1), f16(part["ks"]).reshape(n * d, 1),
                                    f16(part["kz"]).reshape(n * d, 1), bits, g)                   # [n·D, g]
    k = k.view(n, d, g).transpose(1, 2).reshape(n * g, d)
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


def widths(layout: Layout) -> tuple[list[int], list[int]]:
    """A group's rows and a value scale's channels at each width 0..8 (0 where there is none)."""
    rows, chans = [0] * 9, [0] * 9
    for b in QUANT_BITS:
        rows[b], chans[b] = layout.group_rows(b), layout.value_group(b)
    return rows, chans


def paged_decode_reference(q: torch.Tensor, arena: torch.Tensor, dtable: torch.Tensor, dstart: torch.Tensor,
                           dend: torch.Tensor, qtable: torch.Tensor, qn: torch.Tensor, qbits: torch.Tensor,
                           layout: Layout, scaling: float) -> torch.Tensor:
    """q [G, h, D] -> [G, h, D] fp32: each stream's softmax(q·kᵀ·scaling)·v over its groups' and
    dense rows (zeros for a stream with no row)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(q.shape[0]):
        n, bits = int(qn[i]), int(qbits[i])
        kq, vq = dequantize_groups(arena, qtable[i, :n], bits, layout) if n and bits else (None, None)
        kd, vd = dense_rows(arena, dtable[i], int(dstart[i]), int(dend[i]), layout)
        k = torch.cat([x for x in (kq, kd.float()) if x is not None])
        v = torch.cat([x for x in (vq, vd.float()) if x is not None])
        if k.shape[0]:
            out[i] = torch.softmax(q[i].float() @ k.T.to(q.device) * scaling, dim=-1) @ v.to(q.device)
    return out


def _check(q, arena, dtable, dstart, dend, qtable, qn, qbits) -> None:
    g = q.shape[0] if q.dim() == 3 else -1
    if q.dim() != 3:
        raise ValueError(f"q must be [G, h, D], got {list(q.shape)}")
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise ValueError(f"arena must be uint8 [bytes], got {arena.dtype} {list(arena.shape)}")
    for name, t in (("dtable", dtable), ("qtable", qtable)):
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != g:
            raise ValueError(f"{name} must be int32 [{g}, MB], got {t.dtype} {list(t.shape)}")
    for name, t in (("dstart", dstart), ("dend", dend), ("qn", qn), ("qbits", qbits)):
        if t.dtype != torch.int32 or tuple(t.shape) != (g,):
            raise ValueError(f"{name} must be int32 [{g}], got {t.dtype} {list(t.shape)}")


def paged_decode(q: torch.Tensor, arena: torch.Tensor, dtable: torch.Tensor, dstart: torch.Tensor,
                 dend: torch.Tensor, qtable: torch.Tensor, qn: torch.Tensor, qbits: torch.Tensor, layout: Layout,
                 scaling: float) -> torch.Tensor:
    """q [G, h, D]; arena [bytes] u8; dtable [G, MBd], dstart, dend [G]; qtable [G, MBq], qn,
    qbits [G] (all int32, on the arena's device for CUDA, the CPU otherwise) -> [G, h, D] fp32."""
    _check(q, arena, dtable, dstart, dend, qtable, qn, qbits)
    if ENABLED and arena.is_cuda and HAS_TRITON:
        return paged_decode_triton(q, arena, dtable, dstart, dend, qtable, qn, qbits, layout, scaling)
    if ENABLED and not arena.is_cuda and layout.itemsize == 2 and cpu_extension.module() is not None:
        return cpu_extension.module().paged_decode(
            q.float().contiguous(), arena, dtable.contiguous(), dstart.contiguous(), dend.contiguous(),
            qtable.contiguous(), qn.contiguous(), qbits.contiguous(), layout.page_bytes, layout.rows,
            *widths(layout), float(scaling), TASK_ROWS)
    return paged_decode_reference(q, arena, dtable, dstart, dend, qtable, qn, qbits, layout, scaling)


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,        # [G, h, D] fp32 contiguous
        arena_ptr,    # [bytes] uint8
        out_ptr,      # [G, h, D] fp32 contiguous
        dt_ptr, ds_ptr, de_ptr,       # [G, MBd] int32, [G], [G]
        qt_ptr, qn_ptr, qb_ptr,       # [G, MBq] int32, [G], [G]
        gr_ptr, gvp_ptr,              # [9] int32: a group's rows, a value scale's channels, per width
        MBD, MBQ, PAGE, scaling,
        H: tl.constexpr,              # query heads per stream
        HP: tl.constexpr,             # H rounded up to a power of two
        D: tl.constexpr,
        R: tl.constexpr,              # rows of a dense block
        TQ: tl.constexpr,             # rows of a quant tile (a group is 1..6 tiles)
    ):
        s = tl.program_id(0).to(tl.int64)
        hh = tl.arange(0, HP)
        d = tl.arange(0, D)
        hmask = hh < H
        q = tl.load(q_ptr + (s * H + hh[:, None]) * D + d[None, :], mask=hmask[:, None], other=0.0) * scaling
        m_i = tl.full([HP], float("-inf"), tl.float32)
        l_i = tl.zeros([HP], tl.float32)
        acc = tl.zeros([HP, D], tl.float32)
        half_ptr = arena_ptr.to(tl.pointer_type(tl.float16))
        # quantized groups: g rows each (g = 192 / bits, or the small-head layout's), in tiles of TQ rows
        n_groups = tl.load(qn_ptr + s)
        bits = tl.load(qb_ptr + s)
        n_groups = tl.where(bits > 0, n_groups, 0)
        bits = tl.maximum(bits, 1)
        g = tl.load(gr_ptr + bits)
        gv = tl.load(gvp_ptr + bits)
        per = 8 // bits
        levels_mask = (1 << bits) - 1
        tt = tl.arange(0, TQ)
        off_ks = D * g * bits // 8
        off_kz = off_ks + D * 2
        off_vc = off_kz + D * 2
        off_vs = off_vc + g * D * bits // 8
        off_vz = off_vs + g * (D // gv) * 2
        tiles = (g + TQ - 1) // TQ
        for jt in range(0, n_groups * tiles):
            j = jt // tiles
            t = (jt % tiles) * TQ + tt
            valid = t < g
            base = tl.load(qt_ptr + s * MBQ + j).to(tl.int64) * PAGE
            # keys [TQ, D]: channel e's codes are bytes base + e * (g*bits/8) ..., token t in byte t // per
            kbyte = tl.load(arena_ptr + base + d[None, :] * (g * bits // 8) + t[:, None] // per,
                            mask=valid[:, None], other=0).to(tl.int32)
            kcode = (kbyte >> ((t[:, None] % per) * bits)) & levels_mask
            ks = tl.load(half_ptr + (base + off_ks) // 2 + d).to(tl.float32)
            kz = tl.load(half_ptr + (base + off_kz) // 2 + d).to(tl.float32)
            k = kcode.to(tl.float32) * ks[None, :] + kz[None, :]                          # [TQ, D]
            vbyte = tl.load(arena_ptr + base + off_vc + t[:, None] * (D * bits // 8) + d[None, :] // per,
                            mask=valid[:, None], other=0).to(tl.int32)
            vcode = (vbyte >> ((d[None, :] % per) * bits)) & levels_mask
            vs = tl.load(half_ptr + (base + off_vs) // 2 + t[:, None] * (D // gv) + d[None, :] // gv,
                         mask=valid[:, None], other=0.0).to(tl.float32)
            vz = tl.load(half_ptr + (base + off_vz) // 2 + t[:, None] * (D // gv) + d[None, :] // gv,
                         mask=valid[:, None], other=0.0).to(tl.float32)
            v = vcode.to(tl.float32) * vs + vz                                             # [TQ, D]
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                             # [HP, TQ]
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        # dense rows [start, end)
        start = tl.load(ds_ptr + s)
        end = tl.load(de_ptr + s)
        r = tl.arange(0, R)
        for blk in range(start // R, (end + R - 1) // R):
            page = tl.load(dt_ptr + s * MBD + blk).to(tl.int64)
            rows = blk * R + r
            valid = (rows < end) & (rows >= start)
            first = page * PAGE // 2                                                      # in fp16 elements
            k = tl.load(half_ptr + first + r[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(half_ptr + first + (R + r[:, None]) * D + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                             # [HP, R]
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (s * H + hh[:, None]) * D + d[None, :], out, mask=hmask[:, None])


def paged_decode_triton(q, arena, dtable, dstart, dend, qtable, qn, qbits, layout: Layout,
                        scaling: float) -> torch.Tensor:
    """The Triton kernel (CUDA, or anywhere under TRITON_INTERPRET=1): one program per stream."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if layout.itemsize != 2 or layout.head_dim & (layout.head_dim - 1):
        raise ValueError("the Triton paged kernel needs fp16 rows and a power-of-two head dim")
    g, h, d = q.shape
    q = q.float().contiguous()
    out = torch.empty(g, h, d, dtype=torch.float32, device=q.device)
    if g == 0:
        return out
    dev = arena.device
    dtable, qtable = dtable.to(dev).contiguous(), qtable.to(dev).contiguous()
    rows, chans = (torch.tensor(x, dtype=torch.int32, device=dev) for x in widths(layout))
    _paged_decode_kernel[(g,)](
        q, arena, out, dtable, dstart.to(dev).contiguous(), dend.to(dev).contiguous(),
        qtable, qn.to(dev).contiguous(), qbits.to(dev).contiguous(), rows, chans,
        dtable.shape[1], qtable.shape[1], layout.page_bytes, float(scaling),
        H=h, HP=pow2_at_least(h), D=d, R=layout.rows, TQ=32)
    return out
