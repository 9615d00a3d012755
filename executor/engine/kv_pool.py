"""The engine's KV memory: one arena of equal pages allocated once from the KV budget, and one free
list of them. Every storage form's block is one page (`kvcore.blocks`: forms differ in the rows a
page holds), so any free page serves any form, in any order of allocations and frees: nothing
fragments, and the pool can always hand out as many pages as it holds. Admission reserves pages
against the budget (`executor.engine.kv_budget`), so the pages in use never pass it.

Every byte a sequence holds is a page in use here: bytes held = pages in use × page bytes.
Page p holds bytes [p·P, (p + 1)·P) of the arena; kernels read the arena through page numbers."""
from __future__ import annotations

import numpy as np
import torch

from kvcore.blocks import Layout


class PoolExhausted(RuntimeError):
    """More pages asked than are free: the reservations that admitted the sequences under-counted
    (a defect of the cost model), never a normal condition. The engine preempts a sequence rather
    than fail a step for it (`executor.engine.scheduler`)."""


class KVPool:
    def __init__(self, layout: Layout, budget_bytes: int, device: torch.device | str = "cpu"):
        self.layout = layout
        self.pages = max(int(budget_bytes) // layout.page_bytes, 1)
        self.scratch = self.pages               # one page past the pool: where padding rows of a CUDA graph write
        self.arena = torch.empty((self.pages + 1) * layout.page_bytes, dtype=torch.uint8, device=device)   # [bytes]
        self._free = np.arange(self.pages - 1, -1, -1, dtype=np.int64)   # a stack: popped from the end, low first
        self._top = self.pages                                            # free pages: _free[:_top]
        self.peak_pages = 0

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def capacity(self) -> int:
        """Bytes of pages the pool can always hand out, whatever their forms: all of them."""
        return self.pages * self.layout.page_bytes

    @property
    def free_pages(self) -> int:
        return self._top

    @property
    def used_pages(self) -> int:
        return self.pages - self._top

    @property
    def bytes_in_use(self) -> int:
        return self.used_pages * self.layout.page_bytes

    @property
    def peak_bytes(self) -> int:
        return self.peak_pages * self.layout.page_bytes

    # -- pages ----------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor:
        """n pages -> their numbers [n] int32 (CPU)."""
        if n > self._top:
            raise PoolExhausted(f"the KV pool has {self._top} free pages of {self.pages}, {n} asked "
                                f"({self.bytes_in_use} of {self.capacity} bytes in use)")
        self._top -= n
        out = torch.from_numpy(self._free[self._top:self._top + n][::-1].astype(np.int32))
        self.peak_pages = max(self.peak_pages, self.used_pages)
        return out

    def release(self, pages: torch.Tensor | np.ndarray | list) -> None:
        """Give back pages (their numbers)."""
        arr = np.asarray(pages.cpu() if isinstance(pages, torch.Tensor) else pages, dtype=np.int64).reshape(-1)
        if not arr.size:
            return
        if self._top + arr.size > self.pages:
            raise RuntimeError(f"{arr.size} pages given back to a pool with {self.pages - self._top} in use")
        self._free[self._top:self._top + arr.size] = arr[::-1]
        self._top += arr.size

    # -- views ----------------------------------------------------------------------------------
    def rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The arena as rows of one head's K (or V): [bytes / row_bytes, D] in the storage dtype;
        a dense page p has K rows `first_row(p)` + [0, R) and V rows R after them."""
        return self.arena.view(dtype).view(-1, self.layout.head_dim)

    def page_view(self) -> torch.Tensor:
        """The arena as pages: [pages + 1, page bytes] uint8 (the last the scratch page)."""
        return self.arena.view(self.pages + 1, self.layout.page_bytes)
