"""Prefetch staging: rows gathered ahead of a decode step, waiting for that step's Get.

Entries are keyed by (block, step). A Get of step s takes the entry (block, s) if it was
gathered for the same token indices, and drops every entry of that block for steps <= s:
earlier steps are stale, and the entry of step s is used at most once. Not thread-safe on
its own; `BlockStore` calls it under its lock.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cachestore.block import Rows
from cachestore.keys import BlockKey, JobKey


@dataclass(frozen=True)
class Staged:
    indices: torch.Tensor | None   # [N] int64 the rows were gathered for; None: all rows
    rows: Rows


def same_indices(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


class PrefetchStaging:
    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._entries: dict[BlockKey, dict[int, Staged]] = {}
        self._count = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self._count

    def stage(self, key: BlockKey, step: int, indices: torch.Tensor | None, rows: Rows) -> None:
        """Hold `rows` for the Get of (key, step); replaces an earlier entry of the same step."""
        steps = self._entries.setdefault(key, {})
        old = steps.pop(step, None)
        if old is not None:
            self._forget(old)
        steps[step] = Staged(indices, rows)
        self._count += 1
        self.nbytes += rows.nbytes
        while self._count > self.max_entries:
            self._drop_oldest()

    def take(self, key: BlockKey, step: int, indices: torch.Tensor | None) -> Rows | None:
        """The staged rows of (key, step) if gathered for `indices`; drops steps <= `step`."""
        steps = self._entries.get(key)
        if not steps:
            return None
        hit = None
        for s in [s for s in steps if s <= step]:
            entry = steps.pop(s)
            self._forget(entry)
            if s == step and same_indices(entry.indices, indices):
                hit = replace(entry.rows, staged=True)
        if not steps:
            del self._entries[key]
        return hit

    def drop_job(self, job: JobKey) -> None:
        for key in [k for k in self._entries if k.job == job]:
            for entry in self._entries.pop(key).values():
                self._forget(entry)

    def _forget(self, entry: Staged) -> None:
        self._count -= 1
        self.nbytes -= entry.rows.nbytes

    def _drop_oldest(self) -> None:
        key = next(iter(self._entries))
        steps = self._entries[key]
        self._forget(steps.pop(next(iter(steps))))
        if not steps:
            del self._entries[key]
