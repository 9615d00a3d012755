"""Where every stream's rows are (`kvcore.blocks`): per layer, per sequence slot, per KV head, up to
three parts, each in pages of the pool, read by one attention call per layer:

    quant   n pages of KIVI rows at the layer's quant form: the stream's oldest rows; a skip page
            may mark rows attention leaves out (their exact rows are coded)
    coded   rows as entries × magnitudes (codebooks, merged directions, exact rows kept beside a
            compressed form): coded pages and entry pages (shared by a merged pair: the upper
            layer owns them)
    dense   fp16 rows [start, end): the rows fed since the layer was compressed (all of a full
            layer's), in pages of R

A sequence holds a slot, no tensors; its bytes are the pages these tables name.

    extend(slots, counts)  every stream of each slot takes `counts` new rows (`stored`: fewer of
                           them kept, SpeCache's guess); -> `Writes`, where each row goes
    write(w, layer, k, v)  one layer's new K/V rows into the arena
    flush(slots)           quant streams whose dense tail reached residual + g: their oldest g
                           rows into a quant page, the emptied dense pages freed
    pages_due(slots, counts)  the pages `extend` and the `flush` after it take
    store_dense / store_quant / store_coded   a layer's streams replaced by what compression kept
    decode_view(slots)     the tables of a step's decode streams, per layer views for
                           `kernels.paged_decode`
    close(slot)            every page of the slot back to the pool

Tables live on the CPU (int32), whatever the arena's device; `decode_view` moves a step's.

Shapes: L layers, S slots, H KV heads, MB table width, N rows of a step, D head dim, M coded rows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.engine.kv_pool import KVPool
from kernels import quantize_pack
from kernels.kv_write import write_kv
from kernels.paged_decode import CodedRows, stream_rows
from kvcore.blocks import ceil_div


@dataclass(frozen=True)
class Writes:
    """Where a step's N rows go: K rows of the arena [L, N, H] (V rows `R` after each);
    `valid` [N] which of them are stored (None: all)."""
    rows: torch.Tensor
    valid: torch.Tensor | None


TABLES = ("dtable", "dstart", "dend", "qtable", "qn", "qform", "ctable", "cn", "ektable", "evtable", "xpage")
WIDE = ("dtable", "qtable", "ctable", "ektable", "evtable")      # [L, S, H, MB]: mirrored slot by slot


@dataclass(frozen=True)
class StepTables:
    """The tables of a step's decode streams (sequence-major, then KV head), every field [L, S·H, …]
    on the arena's device, in `TABLES` order: what `kernels.paged_decode` reads."""
    dtable: torch.Tensor
    dstart: torch.Tensor
    dend: torch.Tensor
    qtable: torch.Tensor
    qn: torch.Tensor
    qform: torch.Tensor
    ctable: torch.Tensor
    cn: torch.Tensor
    ektable: torch.Tensor
    evtable: torch.Tensor
    xpage: torch.Tensor

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name)[i] for name in TABLES)


class BlockTables:
    def __init__(self, pool: KVPool, num_layers: int, num_kv_heads: int, max_slots: int, max_rows: int):
        lay = pool.layout
        self.pool, self.layout = pool, lay
        self.L, self.S, self.H = num_layers, max_slots, num_kv_heads
        self.mbd = ceil_div(max_rows, lay.rows) + 1
        self.mbq = ceil_div(max_rows, min(f.rows for f in lay.quant_forms[1:])) + 1
        self.mbc = ceil_div(max_rows, lay.coded_rows) + 1
        self.mbe = ceil_div(max_rows, lay.entry_rows) + 1
        self.form_rows = torch.tensor([f.rows for f in lay.quant_forms], dtype=torch.int32)   # [F] rows a page
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32)       # noqa: E731
        self.dtable = z(self.L, self.S, self.H, self.mbd)   # dense pages; page i holds rows [i·R, (i+1)·R)
        self.dstart, self.dend = z(self.L, self.S, self.H), z(self.L, self.S, self.H)   # dense rows [start, end)
        self.qtable = z(self.L, self.S, self.H, self.mbq)   # quant pages, oldest first
        self.qn = z(self.L, self.S, self.H)                  # quant pages held
        self.qform = z(self.L, self.S)                       # the quant form (`Layout.quant_forms`); 0: none
        self.qres = z(self.L, self.S)                        # newest rows a quant layer keeps dense
        self.xpage = torch.full((self.L, self.S, self.H), -1, dtype=torch.int32)   # skip page of quant rows; -1: none
        self.ctable = z(self.L, self.S, self.H, self.mbc)   # coded pages
        self.cn = z(self.L, self.S, self.H)                  # coded rows
        self.ektable = z(self.L, self.S, self.H, self.mbe)  # K entry pages
        self.evtable = z(self.L, self.S, self.H, self.mbe)  # V entry pages
        self.ekn, self.evn = z(self.L, self.S, self.H), z(self.L, self.S, self.H)   # entries held
        self.eown = torch.ones(self.L, self.S, dtype=torch.bool)   # the entry pages are this layer's (not a partner's)
        self.free_slots = list(range(self.S - 1, -1, -1))
        self.dtype = torch.float16 if lay.itemsize == 2 else torch.float32
        self._mirror: dict[str, torch.Tensor] | None = None       # the tables on the arena's device (CUDA graphs)
        self._dirty: dict[str, set[int]] = {name: set() for name in WIDE}

    # -- slots ----------------------------------------------------------------------------------
    def open(self) -> int:
        """A slot for a new sequence, its streams empty."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.S} sequence slots are in use")
        return self.free_slots.pop()

    def close(self, slot: int) -> None:
        """Every page of the slot back to the pool; the slot free."""
        for layer in range(self.L):
            self.drop(layer, slot)
        self.free_slots.append(slot)

    def drop(self, layer: int, slot: int) -> None:
        """Free every page of a layer's streams (entry pages only where it owns them) and empty them."""
        lay, held = self.layout, []
        start, end = self.dstart[layer, slot].long(), self.dend[layer, slot].long()
        cols = torch.arange(self.mbd)
        held.append(self.dtable[layer, slot][(cols >= (start // lay.rows)[:, None]) & (cols < ceil_div(end, lay.rows)[:, None])])
        for table, n in ((self.qtable, self.qn), (self.ctable, self.cn)):
            count = n[layer, slot].long()
            if n is self.cn:
                count = ceil_div(count, lay.coded_rows)
            held.append(table[layer, slot][torch.arange(table.shape[-1]) < count[:, None]])
        if bool(self.eown[layer, slot]):
            for table, n in ((self.ektable, self.ekn), (self.evtable, self.evn)):
                pages = ceil_div(n[layer, slot].long(), lay.entry_rows)
                held.append(table[layer, slot][torch.arange(self.mbe) < pages[:, None]])
        x = self.xpage[layer, slot]
        held.append(x[x >= 0])
        self.pool.release(torch.cat(held))
        for t in (self.dstart, self.dend, self.qn, self.cn, self.ekn, self.evn):
            t[layer, slot] = 0
        self.qform[layer, slot] = self.qres[layer, slot] = 0
        self.xpage[layer, slot] = -1
        self.eown[layer, slot] = True
        self._touch(WIDE, [slot])

    # -- new rows -------------------------------------------------------------------------------
    def pages_due(self, slots: list[int], counts: list[int]) -> int:
        """Pages a step storing counts[i] rows in every stream of slots[i] takes: the dense pages
        `extend` allocates and the quant pages the `flush` after it allocates (before it frees the
        dense pages it empties)."""
        if not slots:
            return 0
        r = self.layout.rows
        sl = torch.tensor(slots, dtype=torch.long)
        m = torch.tensor(counts, dtype=torch.int64)
        start = self.dend.index_select(1, sl).long()                                    # [L, S', H]
        end = start + m[None, :, None]
        dense = int((ceil_div(end, r) - ceil_div(start, r)).sum())
        form = self.qform.index_select(1, sl).long()                                    # [L, S']
        grp = self.form_rows.long()[form][..., None]                                    # [L, S', 1]
        tail = end - self.dstart.index_select(1, sl).long()
        res = self.qres.index_select(1, sl).long()[..., None]
        due = torch.where(form[..., None] > 0, torch.div(tail - res, grp.clamp_min(1), rounding_mode="floor"), 0)
        return dense + int(due.clamp_min(0).sum())

    def extend(self, slots: list[int], counts: list[int], stored: list[int] | None = None) -> Writes:
        """Every stream of slots[i] takes counts[i] rows (the step's rows in this order), of which
        the first stored[i] are kept (default: all)."""
        lay, L, H = self.layout, self.L, self.H
        stored = counts if stored is None else stored
        sl = torch.tensor(slots, dtype=torch.long)
        m = torch.tensor(stored, dtype=torch.int32)
        start = self.dend.index_select(1, sl)                                           # [L, S', H]
        end = start + m[None, :, None]
        b0, b1 = ceil_div(start, lay.rows), ceil_div(end, lay.rows)
        need = (b1 - b0).flatten().long()
        total = int(need.sum())
        if total:
            pages = self.pool.alloc(total)
            owner = torch.repeat_interleave(torch.arange(need.numel()), need)          # stream of each new page
            blk = b0.flatten().long()[owner] + torch.arange(total) - torch.repeat_interleave(need.cumsum(0) - need, need)
            s_i = (owner // H) % len(slots)
            self.dtable[owner // (len(slots) * H), sl[s_i], owner % H, blk] = pages
            self._touch(("dtable",), sl[s_i].unique().tolist())
        self.dend[:, sl] = end
        c = torch.tensor(counts, dtype=torch.long)
        seg = torch.repeat_interleave(torch.arange(len(slots)), c)                       # [N] the segment of each row
        local = torch.arange(seg.numel()) - torch.repeat_interleave(c.cumsum(0) - c, c)
        valid = local < m.long()[seg]                                                     # [N]
        pos = start.long()[:, seg, :] + torch.minimum(local, (m.long()[seg] - 1).clamp_min(0))[None, :, None]
        flat = ((torch.arange(L)[:, None, None] * self.S + sl[seg][None, :, None]) * H
                + torch.arange(H)[None, None, :]) * self.mbd + pos // lay.rows
        page = self.dtable.view(-1)[flat].long()
        rows = lay.first_row(page) + pos % lay.rows
        return Writes(rows, None if bool(valid.all()) else valid)

    def write(self, w: Writes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, H, D] (any float dtype): the step's rows of `layer` into the arena."""
        rows = self.pool.rows(self.dtype)
        at = w.rows[layer]                                                               # [N, H]
        if w.valid is not None:
            keep = w.valid
            if not bool(keep.any()):
                return
            at, k, v = at[keep], k[keep.to(k.device)], v[keep.to(v.device)]
        at = at.reshape(-1)
        if at.device != rows.device:
            at = at.to(rows.device)
        write_kv(rows, at, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]), self.layout.rows)

    # -- quant pages ----------------------------------------------------------------------------
    def _quant_pages(self, k: torch.Tensor, v: torch.Tensor, form: int) -> torch.Tensor:
        """k, v [F, g, D] storage-dtype rows -> pages of F new quant pages of `form` holding them."""
        lay = self.layout
        f, g, d = k.shape
        qf = lay.quant_forms[form]
        n = g // qf.key_group
        kc, ks, kz = quantize_pack(k.view(f, n, qf.key_group, d).transpose(2, 3).reshape(f * n * d, qf.key_group),
                                   qf.bits, qf.key_group, midpoint=qf.midpoint, refine=qf.refine)   # per channel and key group
        vc, vs, vz = quantize_pack(v.reshape(f * g, d), qf.bits, qf.value_group, midpoint=qf.midpoint)  # per row
        kc = kc.view(f, n, d, -1).transpose(1, 2).reshape(f, d, -1)                       # [F, D, g·b/8] channel-major
        u8 = lambda x: x.contiguous().view(torch.uint8).reshape(f, -1)                  # noqa: E731
        raw = torch.cat([u8(kc), u8(ks), u8(kz), u8(vc), u8(vs), u8(vz)], dim=1)         # [F, form bytes]
        pages = self.pool.alloc(f)
        view = self.pool.page_view()
        view[pages.long().to(view.device), :raw.shape[1]] = raw.to(view.device)
        return pages

    def flush(self, slots: list[int]) -> None:
        """Quant streams of these slots whose dense tail holds residual + g rows or more: their
        oldest g dense rows become a quant page (allocated before the emptied dense pages are freed)."""
        lay = self.layout
        sl = torch.tensor(slots, dtype=torch.long)
        while True:
            form = self.qform.index_select(1, sl)[..., None]                              # [L, S', 1]
            grp = self.form_rows[form.long()]
            start, end = self.dstart.index_select(1, sl), self.dend.index_select(1, sl)
            due = (form > 0) & (end - start >= self.qres.index_select(1, sl)[..., None] + grp)
            if not bool(due.any()):
                return
            idx = due.nonzero()                                                           # [F, 3]: l, s', h
            forms = form[idx[:, 0], idx[:, 1], 0]
            for fid in forms.unique().tolist():
                g = lay.quant_forms[fid].rows
                sub = idx[forms == fid]
                l, s, h = sub[:, 0], sl[sub[:, 1]], sub[:, 2]
                first = self.dstart[l, s, h].long()                                       # [F]
                pos = first[:, None] + torch.arange(g)                                    # [F, g]
                page = self.dtable[l[:, None], s[:, None], h[:, None], pos // lay.rows].long()
                at = (lay.first_row(page) + pos % lay.rows).to(self.pool.arena.device)
                rows = self.pool.rows(self.dtype)
                pages = self._quant_pages(rows[at], rows[at + lay.rows], fid)
                n = self.qn[l, s, h].long()
                self.qtable[l, s, h, n] = pages
                self.qn[l, s, h] += 1
                self._touch(("qtable",), s.unique().tolist())
                b0, b1 = first // lay.rows, (first + g) // lay.rows                       # pages wholly below the new start
                cols = b0[:, None] + torch.arange(int((b1 - b0).max()))
                emptied = cols < b1[:, None]
                self.dstart[l, s, h] += g
                self.pool.release(self.dtable[l[:, None], s[:, None], h[:, None], cols.clamp_max(self.mbd - 1)][emptied])

    # -- compression ----------------------------------------------------------------------------
    def _place(self, layer: int, slot: int, start: int, end: int) -> torch.Tensor:
        """Dense pages for rows [start, end) of every head of an emptied layer -> the arena K rows
        of those rows [H, end - start]."""
        lay = self.layout
        b0 = start // lay.rows
        n = ceil_div(end, lay.rows) - b0
        pos = torch.arange(start, end)
        if n > 0:
            self.dtable[layer, slot, :, b0:b0 + n] = self.pool.alloc(n * self.H).view(self.H, n)
            self._touch(("dtable",), [slot])
        page = self.dtable[layer, slot][:, pos // lay.rows].long()                       # [H, T]
        self.dstart[layer, slot], self.dend[layer, slot] = start, end
        return lay.first_row(page) + pos % lay.rows

    def _dense_into(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [H, T, D]: the layer's dense rows [start, start + T) (its other parts kept)."""
        at = self._place(layer, slot, start, start + k.shape[1]).reshape(-1).to(self.pool.arena.device)
        rows = self.pool.rows(self.dtype)
        rows.index_copy_(0, at, k.reshape(-1, k.shape[-1]).to(self.dtype))
        rows.index_copy_(0, at + self.layout.rows, v.reshape(-1, v.shape[-1]).to(self.dtype))

    def store_dense(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's streams become k, v [H, U, D] (every head the same count of rows)."""
        self.drop(layer, slot)
        self._dense_into(layer, slot, 0, k, v)

    def store_quant(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, form: int, residual: int) -> None:
        """The layer's streams become k, v [H, U, D] in quant `form`: n = (U - residual) // g pages
        of the oldest rows, the rest dense."""
        g, (h, u, d) = self.layout.quant_forms[form].rows, k.shape
        self.drop(layer, slot)
        n = max(0, (u - residual) // g)
        k, v = k.to(self.dtype), v.to(self.dtype)           # quantized from the stored form, as a flush does
        if n:
            pages = self._quant_pages(k[:, :n * g].reshape(h * n, g, d), v[:, :n * g].reshape(h * n, g, d), form)
            self.qtable[layer, slot, :, :n] = pages.view(h, n)
            self._touch(("qtable",), [slot])
        self.qn[layer, slot], self.qform[layer, slot], self.qres[layer, slot] = n, form, residual
        self._dense_into(layer, slot, n * g, k[:, n * g:], v[:, n * g:])

    def store_coded(self, layer: int, slot: int, coded: CodedRows, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None, entries: bool = True, replace: bool = True) -> None:
        """The layer's streams become `coded` (every head the same count of rows and of entries),
        then dense rows k, v [H, T, D] when given (rows kept exact after the coded ones).
        entries=False: the coded rows only (their entries are another layer's: `share_entries`);
        replace=False: added beside the layer's quant and dense parts (SpeCache's exact rows)."""
        lay, h = self.layout, self.H
        if replace:
            self.drop(layer, slot)
        m = coded.ref_k.shape[1]
        pages = ceil_div(m, lay.coded_rows)
        if pages:
            p = self.pool.alloc(h * pages).view(h, pages)
            self.ctable[layer, slot, :, :pages] = p
            self.write_coded(layer, slot, 0, coded)
        self.cn[layer, slot] = m
        self._touch(WIDE, [slot])
        for table, count, rows in ((self.ektable, self.ekn, coded.k_entries), (self.evtable, self.evn, coded.v_entries)):
            n = rows.shape[1] if entries else 0
            pages = ceil_div(n, lay.entry_rows)
            if pages:
                p = self.pool.alloc(h * pages).view(h, pages)
                table[layer, slot, :, :pages] = p
                self._entries_into(table[layer, slot], 0, rows)
            count[layer, slot] = n
        if k is not None and k.shape[1]:
            self._dense_into(layer, slot, 0, k, v)

    def share_entries(self, layer: int, owner: int, slot: int) -> None:
        """`layer`'s streams read `owner`'s entry pages (a merged pair: the lower layer the upper's)."""
        self._touch(WIDE, [slot])
        for table, count in ((self.ektable, self.ekn), (self.evtable, self.evn)):
            table[layer, slot] = table[owner, slot]
            count[layer, slot] = count[owner, slot]
        self.eown[layer, slot] = False

    def _entries_into(self, table: torch.Tensor, first: int, entries: torch.Tensor) -> None:
        """entries [H, n, D] -> entry rows [first, first + n) of each head's entry pages `table` [H, MB]."""
        lay = self.layout
        h, n, d = entries.shape
        pos = torch.arange(first, first + n)
        at = lay.first_row(table[:, pos // lay.entry_rows].long()) + pos % lay.entry_rows        # [H, n]
        self.pool.rows(self.dtype).index_copy_(0, at.reshape(-1).to(self.pool.arena.device),
                                               entries.reshape(-1, d).to(self.dtype).to(self.pool.arena.device))

    def write_coded(self, layer: int, slot: int, first: int, coded: CodedRows, entries_at: int | None = None) -> None:
        """Coded rows [first, first + m) of every head := `coded`'s fields (its entries written at
        entry rows [entries_at, …) when given: SpeCache's prefetched rows replace their slots)."""
        lay = self.layout
        m = coded.ref_k.shape[1]
        pos = torch.arange(first, first + m)
        page = self.ctable[layer, slot][:, pos // lay.coded_rows].long()                     # [H, m]
        slot_in = pos % lay.coded_rows
        view = self.pool.page_view()
        for name, (off, size) in lay.coded_parts().items():
            x = getattr(coded, name)                                                          # [H, m]
            item = size // lay.coded_rows
            raw = x.contiguous().view(torch.uint8).view(*x.shape, item)                       # [H, m, item]
            cols = off + slot_in[None, :, None] * item + torch.arange(item)                   # [1, m, item]
            view[page[..., None].expand(-1, -1, item).to(view.device),
                 cols.expand(page.shape[0], -1, -1).to(view.device)] = raw.to(view.device)
        if entries_at is not None:
            self._entries_into(self.ektable[layer, slot], entries_at, coded.k_entries)
            self._entries_into(self.evtable[layer, slot], entries_at, coded.v_entries)

    def set_skip(self, layer: int, slot: int, rows: torch.Tensor | None) -> None:
        """rows [H, Q] bool over the quant rows (True: attention skips it), or None: none skipped."""
        if rows is not None:
            self.set_skips(layer, torch.tensor([slot]), rows[None])

    def set_skips(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Skip pages of several sequences in one write: slots [S], rows [S, H, Q] bool over each
        one's quant rows (True: attention skips it)."""
        lay, s = self.layout, len(slots)
        for slot in slots[self.xpage[layer].index_select(0, slots)[:, 0] < 0].tolist():
            self.xpage[layer, slot] = self.pool.alloc(self.H)
        view = self.pool.page_view()
        used = ceil_div(rows.shape[-1], 8)                                 # bytes the rows given take; the rest 0
        bits = torch.zeros(s, self.H, used * 8, dtype=torch.bool)
        bits[..., :rows.shape[-1]] = rows.cpu()
        packed = torch.zeros(s * self.H, lay.skip_rows // 8, dtype=torch.uint8)
        packed[:, :used] = (bits.view(s * self.H, used, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(
            -1, dtype=torch.uint8)
        view[self.xpage[layer].index_select(0, slots).reshape(-1).long().to(view.device)] = packed.to(view.device)

    def write_entries(self, layer: int, slots: torch.Tensor, first: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """Entry rows [first_s, first_s + n) of each sequence's heads := k, v [S, H, n, D], in one
        write for all (SpeCache's prefetched rows into their slots): slots, first [S]."""
        lay = self.layout
        s, h, n, d = k.shape
        pos = first[:, None].long() + torch.arange(n)                                          # [S, n]
        col = (pos // lay.entry_rows)[:, None, :].expand(s, h, n)
        rows, dev = self.pool.rows(self.dtype), self.pool.arena.device
        for table, x in ((self.ektable, k), (self.evtable, v)):
            page = table[layer].index_select(0, slots).gather(2, col).long()                   # [S, H, n]
            at = lay.first_row(page) + (pos % lay.entry_rows)[:, None, :]
            rows.index_copy_(0, at.reshape(-1).to(dev), x.reshape(-1, d).to(self.dtype).to(dev))

    # -- reading --------------------------------------------------------------------------------
    def quant_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [S] -> [S] int64: the rows each one's quant pages of `layer` hold (0: none)."""
        form = self.qform[layer].index_select(0, slots).long()
        return (self.qn[layer].index_select(0, slots)[:, 0] * self.form_rows[form]).long()

    def dense(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense layer's rows (every head the same span, no other part) -> K, V [H, T, D] stored dtype."""
        lay = self.layout
        start, end = int(self.dstart[layer, slot, 0]), int(self.dend[layer, slot, 0])
        pos = torch.arange(start, end)
        page = self.dtable[layer, slot][:, pos // lay.rows].long()
        at = (lay.first_row(page) + pos % lay.rows).to(self.pool.arena.device)
        rows = self.pool.rows(self.dtype)
        return rows[at], rows[at + lay.rows]

    def stream(self, layer: int, slot: int, head: int, rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One stream's rows as attention sees them (quant rows not skipped, coded rows, dense rows)
        -> K, V [U, D] fp32 and heads [U] uint8 (the query heads of the group that see each row)."""
        t = tuple(x[layer, slot, head] for x in (self.dtable, self.dstart, self.dend, self.qtable, self.qn))
        qform = self.qform[layer, slot]
        rest = tuple(x[layer, slot, head] for x in (self.ctable, self.cn, self.ektable, self.evtable, self.xpage))
        return stream_rows(self.pool.arena, *t, qform, *rest, self.layout, rope)

    def rows_held(self, slot: int) -> torch.Tensor:
        """[L, H] rows each stream holds (quantized, coded and dense)."""
        g = self.form_rows[self.qform[:, slot].long()][:, None]
        return self.qn[:, slot] * g + self.cn[:, slot] + self.dend[:, slot] - self.dstart[:, slot]

    def decode_view(self, slots: list[int], device: torch.device) -> StepTables:
        lay = self.layout
        sl = torch.tensor(slots, dtype=torch.long)
        s_h = len(slots) * self.H

        def put(t, width=None):
            t = t.index_select(1, sl)
            if width is not None:
                t = t[..., :max(int(width), 1)]
            return t.reshape(self.L, s_h, *t.shape[3:]).to(device, non_blocking=True)
        end = self.dend.index_select(1, sl)
        widths = dict(dtable=ceil_div(end.max(), lay.rows) if end.numel() else 1,
                      qtable=self.qn.index_select(1, sl).max() if end.numel() else 1,
                      ctable=ceil_div(self.cn.index_select(1, sl).max(), lay.coded_rows) if end.numel() else 1,
                      ektable=ceil_div(self.ekn.index_select(1, sl).max(), lay.entry_rows) if end.numel() else 1,
                      evtable=ceil_div(self.evn.index_select(1, sl).max(), lay.entry_rows) if end.numel() else 1)
        qform = self.qform[..., None].expand(-1, -1, self.H).contiguous()
        return StepTables(put(self.dtable, widths["dtable"]), put(self.dstart), put(self.dend),
                          put(self.qtable, widths["qtable"]), put(self.qn), put(qform),
                          put(self.ctable, widths["ctable"]), put(self.cn), put(self.ektable, widths["ektable"]),
                          put(self.evtable, widths["evtable"]), put(self.xpage))

    # -- the tables on the arena's device (CUDA graphs) -----------------------------------------
    def _touch(self, names, slots) -> None:
        if self._mirror is not None:
            for name in names:
                self._dirty[name].update(int(x) for x in slots)

    @property
    def empty_stream(self) -> int:
        """The mirrored tables' last stream: no rows (a graph's padding attends over it)."""
        return self.S * self.H

    @property
    def scratch_row(self) -> int:
        """An arena row of the pool's scratch page (a graph's padding rows write there)."""
        return int(self.layout.first_row(self.pool.scratch))

    def _flat(self, name: str) -> torch.Tensor:
        """A table as [L, S·H (, MB)] (qform expanded to every head)."""
        t = self.qform[..., None].expand(-1, -1, self.H) if name == "qform" else getattr(self, name)
        return t.reshape(self.L, self.S * self.H, *t.shape[3:])

    def device_tables(self) -> dict[str, torch.Tensor]:
        """Every table on the arena's device, [L, S·H + 1 (, MB)] (the last stream empty), kept in
        step with the CPU ones by `sync_device`."""
        if self._mirror is None:
            dev, m = self.pool.arena.device, {}
            for name in TABLES:
                flat = self._flat(name)
                pad = torch.full((self.L, 1, *flat.shape[2:]), -1 if name == "xpage" else 0, dtype=torch.int32)
                m[name] = torch.cat([flat, pad], dim=1).to(dev)
            self._mirror = m
        return self._mirror

    def sync_device(self) -> None:
        """Copy what changed since the last sync: the small tables whole, the wide ones slot by slot."""
        if self._mirror is None:
            return
        n = self.S * self.H
        for name in TABLES:
            if name in WIDE:
                slots = sorted(self._dirty[name])
                if not slots:
                    continue
                self._dirty[name].clear()
                sl = torch.tensor(slots)
                idx = (sl[:, None] * self.H + torch.arange(self.H)).reshape(-1)
                rows = self._flat(name).index_select(1, idx)
                self._mirror[name].index_copy_(1, idx.to(self._mirror[name].device),
                                               rows.to(self._mirror[name].device, non_blocking=True))
            else:
                self._mirror[name][:, :n].copy_(self._flat(name), non_blocking=True)

    # -- bytes ----------------------------------------------------------------------------------
    def layer_pages(self, slot: int) -> np.ndarray:
        """[L] pages the streams of each layer hold (entry pages where the layer owns them)."""
        lay = self.layout
        dense = (ceil_div(self.dend[:, slot], lay.rows) - self.dstart[:, slot] // lay.rows).clamp_min(0)
        coded = ceil_div(self.cn[:, slot], lay.coded_rows)
        entries = (ceil_div(self.ekn[:, slot], lay.entry_rows) + ceil_div(self.evn[:, slot], lay.entry_rows))
        entries = entries * self.eown[:, slot, None]
        skip = (self.xpage[:, slot] >= 0).int()
        return (dense + self.qn[:, slot] + coded + entries + skip).sum(1).numpy()

    def layer_bytes(self, slot: int) -> np.ndarray:
        """[L] bytes the pages of each layer's streams hold."""
        return self.layer_pages(slot) * self.layout.page_bytes
