"""The engine's KV memory: one arena allocated once from the KV budget, carved into chunks, each
chunk into blocks of one storage form (`kvcore.blocks.Layout`: dense fp16 rows, or quantized
groups at 2, 4 or 8 bits). Every byte a sequence's pooled layers hold is a block in use here,
so the bytes held are blocks in use × their form's bytes, counted as blocks come and go.

A form takes a free chunk when its blocks run out and gives back chunks none of whose blocks are
in use when another form needs one (`_chunk`). A form may hold one partly used chunk that no
other form can use, so the arena is the budget plus one chunk per form (and the pages a chunk
of some form cannot use): blocks worth the whole budget can always be handed out, whatever their
mix (`capacity` >= the budget). Admission reserves against the budget, so the blocks in use
never pass it.

Block ids are page numbers: a block of form f at page p holds bytes [p·page, p·page + bytes_f)
of the arena (`Layout.page_bytes`). Kernels read the arena through them."""
from __future__ import annotations

import numpy as np
import torch

from kvcore.blocks import Layout


class PoolExhausted(RuntimeError):
    """More blocks asked than the arena holds: the reservations that admitted the sequences
    under-counted (a defect of the cost model), never a normal condition."""


class KVPool:
    def __init__(self, layout: Layout, budget_bytes: int, device: torch.device | str = "cpu"):
        self.layout = layout
        page, chunk = layout.page_bytes, layout.chunk_pages
        self.chunks = -(-int(budget_bytes / (1 - layout.chunk_waste)) // (chunk * page)) + len(layout.form_bytes)
        self.arena = torch.empty(self.chunks * chunk * page, dtype=torch.uint8, device=device)   # [bytes]
        self.free_chunks: list[int] = list(range(self.chunks - 1, -1, -1))      # popped from the end: low first
        self.free: dict[str, list[int]] = {f: [] for f in layout.form_bytes}  # free block pages per form
        self.owner = np.full(self.chunks, "", dtype=object)                    # the form a chunk serves
        self.used_in = np.zeros(self.chunks, dtype=np.int64)                    # blocks in use per chunk
        self.used = {f: 0 for f in layout.form_bytes}                           # blocks in use per form
        self.peak_bytes = 0

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def arena_bytes(self) -> int:
        return self.arena.numel()

    @property
    def capacity(self) -> int:
        """Bytes of blocks the pool can always hand out, however they mix forms: the arena less
        one chunk per form (the partly used chunk a form may hold) and the pages chunks waste."""
        lay = self.layout
        return int((self.chunks - len(lay.form_bytes)) * lay.chunk_pages * lay.page_bytes * (1 - lay.chunk_waste))

    @property
    def bytes_in_use(self) -> int:
        return sum(n * self.layout.form_bytes[f] for f, n in self.used.items())

    # -- blocks ---------------------------------------------------------------------------------
    def alloc(self, form: str, n: int) -> torch.Tensor:
        """n blocks of `form` -> their pages [n] int32 (CPU)."""
        free = self.free[form]
        while len(free) < n:
            self._chunk(form)
        pages = free[len(free) - n:]
        del free[len(free) - n:]
        arr = np.asarray(pages, dtype=np.int64)
        np.add.at(self.used_in, arr // self.layout.chunk_pages, 1)
        self.used[form] += n
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
        return torch.from_numpy(arr.astype(np.int32))

    def release(self, form: str, pages: torch.Tensor | np.ndarray | list) -> None:
        """Give back blocks of `form` (their pages)."""
        arr = np.asarray(pages.cpu() if isinstance(pages, torch.Tensor) else pages, dtype=np.int64).reshape(-1)
        if not arr.size:
            return
        np.subtract.at(self.used_in, arr // self.layout.chunk_pages, 1)
        self.used[form] -= arr.size
        self.free[form].extend(arr.tolist())

    def _chunk(self, form: str) -> None:
        """One more chunk of blocks for `form`: a free chunk, else one whose blocks another form
        holds free."""
        if not self.free_chunks:
            self._reclaim(form)
        if not self.free_chunks:
            raise PoolExhausted(f"the KV pool is out of blocks for {form}: {self.bytes_in_use} of "
                                f"{self.arena_bytes} bytes in use")
        c = self.free_chunks.pop()
        self.owner[c] = form
        step = self.layout.form_pages[form]
        first = c * self.layout.chunk_pages
        self.free[form].extend(range(first + self.layout.chunk_pages - step, first - 1, -step))

    def _reclaim(self, asking: str) -> None:
        """Chunks of other forms with no block in use go back to the arena."""
        idle = [c for c in np.flatnonzero(self.used_in == 0) if self.owner[c] not in ("", asking)]
        for c in idle:
            form, lo = self.owner[c], c * self.layout.chunk_pages
            self.free[form] = [p for p in self.free[form] if not lo <= p < lo + self.layout.chunk_pages]
            self.owner[c] = ""
            self.free_chunks.append(int(c))

    # -- views ----------------------------------------------------------------------------------
    def rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The arena as rows of one head's K (or V): [bytes / row_bytes, D] in the storage dtype;
        a dense block at page p has K rows `first_row(p)` + [0, rows) and V rows after them."""
        return self.arena.view(dtype).view(-1, self.layout.head_dim)

    def groups(self, bits: int) -> torch.Tensor:
        """The arena as one quant group per page: [pages, bytes of a q{bits} block] (rows overlap:
        only the rows of pages where a group starts are groups)."""
        page, n = self.layout.page_bytes, self.layout.quant_bytes(bits)
        pages = self.arena_bytes // page
        return self.arena.as_strided((pages - ((n - 1) // page), n), (page, 1))
