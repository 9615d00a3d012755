"""Where every pooled stream's rows are: per layer, per sequence slot, per KV head, a dense page
table with the span of rows it holds and a table of quantized groups, one a page (`kvcore.blocks`).
A sequence holds a slot, no tensors; its pooled layers' bytes are the pages these tables name.

    extend(slots, counts)  every pooled stream of each slot takes `counts` new rows: pages are
                           allocated where they cross a page's end; -> `Writes`, where each of
                           the step's rows goes in the arena, for every layer at once
    write(w, layer, k, v)  one layer's new K/V rows into the arena (one index_copy each)
    flush(slots)           quant streams whose dense tail reached residual + g: their oldest g
                           rows into a group, the emptied dense pages freed
    pages_due(slots, counts)  the pages `extend` and the `flush` after it will take (the engine
                           checks them against the free pages before a step runs)
    store_dense / store_quant   a layer's streams replaced by the rows compression kept
    decode_view(slots)     the tables of a step's decode streams, once per step, per layer
                           views for `kernels.paged_decode`
    close(slot)            every page of the slot back to the pool

Tables live on the CPU (int32), whatever the arena's device; `decode_view` moves a step's.

Shapes: L layers, S slots, H KV heads, MB table width, N rows of a step, D head dim."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.engine.kv_pool import KVPool
from kernels import quantize_pack
from kernels.kv_write import write_kv
from kernels.paged_decode import dense_rows, dequantize_groups
from kvcore.blocks import QUANT_BITS, ceil_div


@dataclass(frozen=True)
class Writes:
    """Where a step's N rows go: K rows of the arena [L, N, H] (V rows `rows` after each);
    `valid` [L, N] which of them a layer stores here (None: all)."""
    rows: torch.Tensor
    valid: torch.Tensor | None


@dataclass(frozen=True)
class StepTables:
    """The tables of a step's decode streams (sequence-major, then KV head): [L, S·H, MB] and
    [L, S·H], on the arena's device; `paged` [L, S] whether the layer of each sequence is pooled."""
    dtable: torch.Tensor
    dstart: torch.Tensor
    dend: torch.Tensor
    qtable: torch.Tensor
    qn: torch.Tensor
    qbits: torch.Tensor
    paged: torch.Tensor
    all_paged: list[bool]          # [L] every sequence's layer is pooled

    def __post_init__(self):
        # per layer, the kernel's table arguments (dtable, dstart, dend, qtable, qn, qbits): views made once
        object.__setattr__(self, "layers", list(zip(*(t.unbind(0) for t in (
            self.dtable, self.dstart, self.dend, self.qtable, self.qn, self.qbits)))))


class BlockTables:
    def __init__(self, pool: KVPool, num_layers: int, num_kv_heads: int, max_slots: int, max_rows: int):
        lay = pool.layout
        self.pool, self.layout = pool, lay
        self.L, self.S, self.H = num_layers, max_slots, num_kv_heads
        self.mbd = ceil_div(max_rows, lay.rows) + 1
        self.mbq = ceil_div(max_rows, min(lay.group_rows(b) for b in QUANT_BITS)) + 1
        self.g_of = torch.zeros(9, dtype=torch.int32)       # rows of a group at each width (0: none)
        for b in QUANT_BITS:
            self.g_of[b] = lay.group_rows(b)
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32)       # noqa: E731
        self.dtable = z(self.L, self.S, self.H, self.mbd)   # dense pages; page i holds rows [i·R, (i+1)·R)
        self.dstart, self.dend = z(self.L, self.S, self.H), z(self.L, self.S, self.H)   # dense rows [start, end)
        self.qtable = z(self.L, self.S, self.H, self.mbq)   # quant group pages, oldest first (g rows each)
        self.qn = z(self.L, self.S, self.H)                  # groups held
        self.qbits = z(self.L, self.S)                       # 0: no groups (dense only)
        self.qres = z(self.L, self.S)                        # newest rows a quant layer keeps dense
        self.paged = torch.zeros(self.L, self.S, dtype=torch.bool)   # the layer's rows live here
        self.free_slots = list(range(self.S - 1, -1, -1))
        self.dtype = torch.float16 if lay.itemsize == 2 else torch.float32

    # -- slots ----------------------------------------------------------------------------------
    def open(self, paged: list[bool]) -> int:
        """A slot for a new sequence whose layers `paged[l]` keep their rows here."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.S} sequence slots are in use")
        s = self.free_slots.pop()
        self.paged[:, s] = torch.tensor(paged, dtype=torch.bool)
        return s

    def close(self, slot: int) -> None:
        """Every page of the slot back to the pool; the slot free."""
        for layer in range(self.L):
            self.drop(layer, slot)
        self.paged[:, slot] = False
        self.free_slots.append(slot)

    def drop(self, layer: int, slot: int) -> None:
        """Free every page of a layer's streams and empty them."""
        lay = self.layout
        start, end, n = self.dstart[layer, slot].long(), self.dend[layer, slot].long(), self.qn[layer, slot].long()
        cols = torch.arange(self.mbd)
        held = (cols[None] >= (start // lay.rows)[:, None]) & (cols[None] < ceil_div(end, lay.rows)[:, None])   # [H, MB]
        self.pool.release(self.dtable[layer, slot][held])
        bits = int(self.qbits[layer, slot])
        if bits and int(n.sum()):
            qheld = torch.arange(self.mbq)[None] < n[:, None]
            self.pool.release(self.qtable[layer, slot][qheld])
        self.dstart[layer, slot] = self.dend[layer, slot] = self.qn[layer, slot] = 0
        self.qbits[layer, slot] = self.qres[layer, slot] = 0

    # -- new rows -------------------------------------------------------------------------------
    def pages_due(self, slots: list[int], counts: list[int]) -> int:
        """Pages a step feeding counts[i] rows to the pooled streams of slots[i] takes: the dense
        pages `extend` allocates and the quant pages the `flush` after it allocates (before it frees
        the dense pages it empties)."""
        if not slots:
            return 0
        lay, g = self.layout, self.layout.rows
        sl = torch.tensor(slots, dtype=torch.long)
        m = torch.tensor(counts, dtype=torch.int64)
        paged = self.paged.index_select(1, sl)                                          # [L, S']
        start = self.dend.index_select(1, sl).long()                                    # [L, S', H]
        end = start + m[None, :, None] * paged[..., None]
        dense = int((ceil_div(end, g) - ceil_div(start, g)).sum())
        bits = self.qbits.index_select(1, sl).long()                                    # [L, S']
        grp = self.g_of.long()[bits][..., None]                                         # [L, S', 1]
        tail = end - self.dstart.index_select(1, sl).long()
        res = self.qres.index_select(1, sl).long()[..., None]
        due = torch.where(bits[..., None] > 0, torch.div(tail - res, grp.clamp_min(1), rounding_mode="floor"), 0)
        return dense + int(due.clamp_min(0).sum())

    def extend(self, slots: list[int], counts: list[int]) -> Writes:
        """Every pooled stream of slots[i] takes counts[i] rows (the step's rows in this order)."""
        lay, L, H = self.layout, self.L, self.H
        sl = torch.tensor(slots, dtype=torch.long)
        m = torch.tensor(counts, dtype=torch.int32)
        paged = self.paged.index_select(1, sl)                                          # [L, S']
        start = self.dend.index_select(1, sl)                                           # [L, S', H]
        end = start + (m[None, :, None] * paged[..., None])
        b0, b1 = ceil_div(start, lay.rows), ceil_div(end, lay.rows)
        need = (b1 - b0).flatten().long()
        total = int(need.sum())
        if total:
            pages = self.pool.alloc(total)
            owner = torch.repeat_interleave(torch.arange(need.numel()), need)          # stream of each new block
            blk = b0.flatten().long()[owner] + torch.arange(total) - torch.repeat_interleave(need.cumsum(0) - need, need)
            s_i = (owner // H) % len(slots)
            self.dtable[owner // (len(slots) * H), sl[s_i], owner % H, blk] = pages
        self.dend[:, sl] = end
        seg = torch.repeat_interleave(torch.arange(len(slots)), m.long())                # [N] the segment of each row
        local = torch.arange(seg.numel()) - torch.repeat_interleave(m.long().cumsum(0) - m.long(), m.long())
        pos = start.long()[:, seg, :] + local[None, :, None]                            # [L, N, H]
        flat = ((torch.arange(L)[:, None, None] * self.S + sl[seg][None, :, None]) * H
                + torch.arange(H)[None, None, :]) * self.mbd + pos // lay.rows
        page = self.dtable.view(-1)[flat].long()
        rows = lay.first_row(page) + pos % lay.rows
        valid = paged[:, seg]
        return Writes(rows, None if bool(valid.all()) else valid)

    def write(self, w: Writes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, H, D] (any float dtype): the step's rows of `layer` into the arena."""
        rows = self.pool.rows(self.dtype)
        at = w.rows[layer]                                                               # [N, H]
        if w.valid is not None:
            keep = w.valid[layer]
            if not bool(keep.any()):
                return
            at, k, v = at[keep], k[keep.to(k.device)], v[keep.to(v.device)]
        at = at.reshape(-1)
        if at.device != rows.device:
            at = at.to(rows.device)
        write_kv(rows, at, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]), self.layout.rows)

    # -- quantized groups -----------------------------------------------------------------------
    def _groups(self, k: torch.Tensor, v: torch.Tensor, bits: int) -> torch.Tensor:
        """k, v [F, g, D] storage-dtype rows -> pages of F new q{bits} groups holding them."""
        lay = self.layout
        f, g, d = k.shape
        kc, ks, kz = quantize_pack(k.transpose(1, 2).reshape(f * d, g), bits, g)      # per channel
        vc, vs, vz = quantize_pack(v.reshape(f * g, d), bits, lay.value_group(bits))  # per row
        u8 = lambda x: x.contiguous().view(torch.uint8).reshape(f, -1)                # noqa: E731
        raw = torch.cat([u8(kc), u8(ks), u8(kz), u8(vc), u8(vs), u8(vz)], dim=1)       # [F, q{bits} bytes]
        pages = self.pool.alloc(f)
        view = self.pool.page_view()
        view[pages.long().to(view.device), :raw.shape[1]] = raw.to(view.device)
        return pages

    def flush(self, slots: list[int]) -> None:
        """Quant streams of these slots whose dense tail holds residual + g rows or more: their
        oldest g dense rows become a group (allocated before the emptied dense pages are freed)."""
        lay = self.layout
        sl = torch.tensor(slots, dtype=torch.long)
        while True:
            bits = self.qbits.index_select(1, sl)[..., None]                              # [L, S', 1]
            grp = self.g_of[bits.long()]                                                  # [L, S', 1]
            start, end = self.dstart.index_select(1, sl), self.dend.index_select(1, sl)
            due = (bits > 0) & (end - start >= self.qres.index_select(1, sl)[..., None] + grp)
            if not bool(due.any()):
                return
            idx = due.nonzero()                                                           # [F, 3]: l, s', h
            widths = bits[idx[:, 0], idx[:, 1], 0]
            for b in widths.unique().tolist():
                g = lay.group_rows(b)
                sub = idx[widths == b]
                l, s, h = sub[:, 0], sl[sub[:, 1]], sub[:, 2]
                first = self.dstart[l, s, h].long()                                       # [F]
                pos = first[:, None] + torch.arange(g)                                    # [F, g]
                page = self.dtable[l[:, None], s[:, None], h[:, None], pos // lay.rows].long()
                at = (lay.first_row(page) + pos % lay.rows).to(self.pool.arena.device)
                rows = self.pool.rows(self.dtype)
                pages = self._groups(rows[at], rows[at + lay.rows], b)
                n = self.qn[l, s, h].long()
                self.qtable[l, s, h, n] = pages
                self.qn[l, s, h] += 1
                b0, b1 = first // lay.rows, (first + g) // lay.rows                       # pages wholly below the new start
                span = torch.arange(int((b1 - b0).max()) if len(b0) else 0)
                cols = b0[:, None] + span
                emptied = cols < b1[:, None]
                self.dstart[l, s, h] += g
                self.pool.release(self.dtable[l[:, None], s[:, None], h[:, None], cols.clamp_max(self.mbd - 1)][emptied])

    # -- compression ----------------------------------------------------------------------------
    def _place(self, layer: int, slot: int, start: int, end: int) -> torch.Tensor:
        """Dense pages for rows [start, end) of every head of a (just emptied) layer -> the arena K
        rows of those rows [H, end - start]."""
        lay = self.layout
        b0 = start // lay.rows
        n = ceil_div(end, lay.rows) - b0
        pos = torch.arange(start, end)
        if n > 0:
            pages = self.pool.alloc(n * self.H).view(self.H, n)
            self.dtable[layer, slot, :, b0:b0 + n] = pages
        page = self.dtable[layer, slot][:, pos // lay.rows].long()                       # [H, T]
        self.dstart[layer, slot], self.dend[layer, slot] = start, end
        return lay.first_row(page) + pos % lay.rows

    def store_dense(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's streams become k, v [H, U, D] (every head the same count of rows)."""
        self.drop(layer, slot)
        at = self._place(layer, slot, 0, k.shape[1]).reshape(-1).to(self.pool.arena.device)
        rows = self.pool.rows(self.dtype)
        rows.index_copy_(0, at, k.reshape(-1, k.shape[-1]).to(self.dtype))
        rows.index_copy_(0, at + self.layout.rows, v.reshape(-1, v.shape[-1]).to(self.dtype))

    def store_quant(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, bits: int, residual: int) -> None:
        """The layer's streams become k, v [H, U, D] at `bits`: n = (U - residual) // g groups of
        the oldest rows, the rest dense."""
        g, (h, u, d) = self.layout.group_rows(bits), k.shape
        self.drop(layer, slot)
        n = max(0, (u - residual) // g)
        k, v = k.to(self.dtype), v.to(self.dtype)           # quantized from the stored form, as a flush does
        if n:
            pages = self._groups(k[:, :n * g].reshape(h * n, g, d), v[:, :n * g].reshape(h * n, g, d), bits)
            self.qtable[layer, slot, :, :n] = pages.view(h, n)
        self.qn[layer, slot], self.qbits[layer, slot], self.qres[layer, slot] = n, bits, residual
        at = self._place(layer, slot, n * g, u).reshape(-1).to(self.pool.arena.device)
        rows = self.pool.rows(self.dtype)
        rows.index_copy_(0, at, k[:, n * g:].reshape(-1, d))
        rows.index_copy_(0, at + self.layout.rows, v[:, n * g:].reshape(-1, d))

    # -- reading --------------------------------------------------------------------------------
    def dense(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense layer's rows (every head the same span, no groups) -> K, V [H, T, D] stored dtype."""
        lay = self.layout
        start, end = int(self.dstart[layer, slot, 0]), int(self.dend[layer, slot, 0])
        pos = torch.arange(start, end)
        page = self.dtable[layer, slot][:, pos // lay.rows].long()
        at = (lay.first_row(page) + pos % lay.rows).to(self.pool.arena.device)
        rows = self.pool.rows(self.dtype)
        return rows[at], rows[at + lay.rows]

    def stream(self, layer: int, slot: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One stream's rows in order, groups dequantized -> K, V [U, D] fp32."""
        n, bits = int(self.qn[layer, slot, head]), int(self.qbits[layer, slot])
        arena = self.pool.arena
        kq, vq = dequantize_groups(arena, self.qtable[layer, slot, head, :n], bits, self.layout)
        kd, vd = dense_rows(arena, self.dtable[layer, slot, head], int(self.dstart[layer, slot, head]),
                            int(self.dend[layer, slot, head]), self.layout)
        return torch.cat([kq, kd.float()]), torch.cat([vq, vd.float()])

    def rows_held(self, slot: int) -> torch.Tensor:
        """[L, H] rows each stream holds (quantized and dense)."""
        g = self.g_of[self.qbits[:, slot].long()][:, None]
        return self.qn[:, slot] * g + self.dend[:, slot] - self.dstart[:, slot]

    def decode_view(self, slots: list[int], device: torch.device) -> StepTables:
        lay = self.layout
        sl = torch.tensor(slots, dtype=torch.long)
        end = self.dend.index_select(1, sl)
        mbd = max(int(ceil_div(end.max(), lay.rows)) if end.numel() else 0, 1)
        mbq = max(int(self.qn.index_select(1, sl).max()) if end.numel() else 0, 1)
        s_h = len(slots) * self.H
        put = lambda t: t.reshape(self.L, s_h, *t.shape[3:]).to(device, non_blocking=True)   # noqa: E731
        paged = self.paged.index_select(1, sl)
        return StepTables(put(self.dtable[..., :mbd].index_select(1, sl)), put(self.dstart.index_select(1, sl)),
                          put(end), put(self.qtable[..., :mbq].index_select(1, sl)), put(self.qn.index_select(1, sl)),
                          put(self.qbits.index_select(1, sl)[..., None].expand(-1, -1, self.H).contiguous()),
                          paged, paged.all(dim=1).tolist())

    # -- bytes ----------------------------------------------------------------------------------
    def layer_pages(self, slot: int) -> np.ndarray:
        """[L] pages the streams of each layer hold."""
        lay = self.layout
        dense = (ceil_div(self.dend[:, slot], lay.rows) - self.dstart[:, slot] // lay.rows).clamp_min(0).sum(1)
        return (dense + self.qn[:, slot].sum(1)).numpy()

    def layer_bytes(self, slot: int) -> np.ndarray:
        """[L] bytes the pages of each layer's streams hold."""
        return self.layer_pages(slot) * self.layout.page_bytes
