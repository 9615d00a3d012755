"""What every cache layer kind shares: the phase a forward runs under, the job's state the
cache's layers share, the per-layer context, the layer protocol the cache and the engine call,
and the error a plan the layers cannot hold raises. No layer imports another's module for these."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterator, Protocol

import torch


class UnsupportedPlan(ValueError):
    """A plan the cache's layers cannot hold (its kind, its stacking, its shape)."""


class Phase(StrEnum):
    """What a forward's rows are to the cache. A str enum: `Phase.AFTER == "after"`, so a caller
    may still set a phase by its name; `CacheState` turns a name into the member (an unknown one
    raises)."""
    CONTEXT = "context"        # prefilling the part of the prompt to compress
    COMPRESS = "compress"      # the context's last chunk: each layer's context ends after its attention
    STATS = "stats"            # the context's last chunk when the plan comes after it: layers gather the
                               # plan's statistics and keep their last queries (`PlannedCache.compress` later)
    AFTER = "after"            # the question and decode, over the compressed cache
    PREDECODE = "predecode"    # offload plans: a decode row that stores nothing and guesses the next token
    SPEC = "spec"              # offload plans: the row and its guess, with the prefetched rows

    @property
    def prefills_context(self) -> bool:
        """Rows of the context (before its compression)."""
        return self in (Phase.CONTEXT, Phase.COMPRESS, Phase.STATS)

    @property
    def speculative(self) -> bool:
        return self in (Phase.PREDECODE, Phase.SPEC)


@dataclass
class CacheState:
    """Where the job is, shared by the cache's layers. The phase is set for one forward and reset
    after it in one place (`running`); layers read it, never set it."""
    phase: Phase = Phase.CONTEXT
    context_tokens: int = 0
    step: int = 0                     # decode step of an offload plan (PREDECODE is 0)
    wait_s: float = 0.0               # how long an offload layer waits for a late prefetch
    recall: list | None = None        # offload layers append their prefetch recall here when set
    stats: object | None = None       # STATS: a `kvcore.statistics.LayerStatistics` each layer adds to
    queries: list | None = None       # STATS: each layer's last queries [H, W, D], kept to compress later

    def __setattr__(self, name: str, value) -> None:
        if name == "phase":
            value = Phase(value)
        super().__setattr__(name, value)

    @contextlib.contextmanager
    def running(self, phase: Phase | str, step: int | None = None) -> Iterator["CacheState"]:
        """One forward under `phase` (and offload decode `step` when given); AFTER once it ends,
        whatever happens: a context's last chunk, run or failed, never runs again."""
        self.phase = phase
        if step is not None:
            self.step = step
        try:
            yield self
        finally:
            self.phase = Phase.AFTER


@dataclass(frozen=True)
class LayerContext:
    storage_dtype: torch.dtype
    num_kv_heads: int
    num_query_heads: int
    head_dim: int
    rope: tuple[torch.Tensor, float]          # (inv_freq [D/2], attention_scaling)
    state: CacheState = field(default_factory=CacheState)
    offload: object | None = None             # the plan's OffloadPlan, fitted (offload layers)
    store: object | None = None               # cachestore.handle.JobHandle (offload layers)


class CacheLayer(Protocol):
    """What the cache, the attention function and the engine call on a layer of any kind
    (a transformers `DynamicLayer` besides). Shapes: B = 1 sequence, H query heads, H_kv KV
    heads, T tokens, D head dim."""
    kind: str                                 # its key in `executor.layers.LAYER_KINDS`
    seedable: bool                            # may start from a prefilled dense prefix
    tokens_seen: int

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [1, H_kv, T_new, D] (post-RoPE keys) -> what `attend` gets as k, v."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q [1, H, Tq, D] -> [1, Tq, H, D], under the state's phase."""

    def end_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None:
        """The context's last chunk has attended (phase COMPRESS): compress as the plan says."""

    def compress_now(self, q: torch.Tensor, scaling: float) -> None:
        """Compress later from the kept last queries q [H, W, D] (after phase STATS)."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds: what `kv_bytes` counts."""

    def kept_tokens(self) -> int: ...

    def bytes_bound(self, adds: list[int]) -> int:
        """Most bytes held at any step while `adds` rows join in turn (`kvcore.cost`)."""
