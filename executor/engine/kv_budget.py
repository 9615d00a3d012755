"""The engine's KV memory budget, in bytes: admission reserves a sequence's bytes, the
reservation tightens once its context is compressed, and the bytes the caches' tensors really
hold are checked against it after every step.

    before its prefill   max(what the prefill holds at its peak: the dense context of every
                         layer; the plan's worst step over the job)   `kvcore.plan_cost`
    after compression    the bytes its cache holds plus the most each layer can still grow
                         over the question and max_new_tokens rows (`PlannedCache.bytes_bound`)

A sequence whose bytes could pass its reservation is a defect of the cost model: `check`
reports it (and the engine logs it) rather than letting the budget be silently exceeded."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil

log = logging.getLogger("kvplan.executor.engine")

DEFAULT_SHARE = 0.5        # of the memory available at start, when no budget is set


class OverBudget(Exception):
    """A job whose reservation exceeds the whole budget: it could never run here."""

    def __init__(self, need: int, budget: int):
        super().__init__(f"the job needs {need} bytes of KV cache (its plan's worst step and its prefill), more than "
                         f"this executor's whole KV budget of {budget} bytes (KVPLAN_KV_BUDGET_BYTES)")
        self.need, self.budget = need, budget


def default_budget(share: float = DEFAULT_SHARE) -> int:
    """A share of the memory available now (the model already loaded)."""
    return int(share * psutil.virtual_memory().available)


@dataclass
class Usage:
    reserved: int
    measured: int
    budget: int


class KVBudget:
    def __init__(self, total: int):
        if total <= 0:
            raise ValueError(f"the KV budget must be > 0 bytes, got {total}")
        self.total = total
        self._held: dict[int, int] = {}       # seq_id -> bytes reserved
        self.peak_measured = 0

    @property
    def reserved(self) -> int:
        return sum(list(self._held.values()))      # a snapshot: other threads read it while the engine steps

    @property
    def free(self) -> int:
        return self.total - self.reserved

    def check_fits_at_all(self, need: int) -> None:
        if need > self.total:
            raise OverBudget(need, self.total)

    def can_reserve(self, need: int) -> bool:
        return need <= self.free

    def reserve(self, seq_id: int, need: int) -> None:
        assert seq_id not in self._held and need <= self.free, "reserve only what can_reserve allowed"
        self._held[seq_id] = need

    def resize(self, seq_id: int, need: int) -> bool:
        """Set a sequence's reservation; growing it only when the budget has room (False: kept)."""
        have = self._held[seq_id]
        if need > have and need - have > self.free:
            return False
        self._held[seq_id] = need
        return True

    def held(self, seq_id: int) -> int:
        return self._held.get(seq_id, 0)

    def release(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)

    def observe(self, measured: int) -> Usage:
        """The bytes the running sequences' tensors hold now: kept as the peak, and checked."""
        self.peak_measured = max(self.peak_measured, measured)
        if measured > self.total:
            log.error("KV bytes held %d exceed the budget %d", measured, self.total)
        return Usage(self.reserved, measured, self.total)
