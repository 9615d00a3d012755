"""The single-job runner: one job through the engine alone (benches and tests), plus the pieces
benches use to drive a cache by hand (`new_cache`, `prefill`, `forward`) and to prefill a prompt's
leading chunks once for many plans (`prefix_of`).

The serving path is `executor.engine` (many jobs at once); a job run here does exactly the
arithmetic it does there, since a sequence's prefill parts and decode rows never depend on
what it is batched with."""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

from executor.engine.seq_cache import SeqCache
from executor.engine import KVBudget, LLMEngine
from executor.engine.result import RunResult, run_result
from executor.engine.scheduler import Segment
from executor.engine.sequence import Phase, Sampling, chunks, prefill_parts
from executor.prompt import Prompt
from cachestore.handle import JobHandle
from kvcore.model import LoadedModel
from kvcore.plan import CompressionPlan, full_plan

__all__ = ["Cancelled", "Prefix", "Runner", "RunResult", "Sampling"]

UNLIMITED = 1 << 62          # a lone job's KV budget: whatever it holds


class Cancelled(Exception):
    pass


@dataclass(frozen=True)
class Prefix:
    """Dense K/V of a prompt's leading context chunks, prefilled once under a full plan: every
    layer holds dense K/V until the context's last chunk (phase CONTEXT), so runs
    of the same prompt under plans that chunk it alike can start from here (the benches run one
    prompt under many plans). Not for layers that keep more than K/V while the context is
    prefilled (`seedable`: H2O's accumulated attention): `seeds` says so."""
    parts: tuple[tuple[int, int], ...]            # the context spans prefilled
    keys: tuple[torch.Tensor, ...]                # per layer [1, H_kv, T, D], storage dtype
    values: tuple[torch.Tensor, ...]

    @property
    def tokens(self) -> int:
        return self.parts[-1][1] if self.parts else 0

    def seeds(self, cache: SeqCache, spans: list[tuple[int, int]]) -> bool:
        """Whether a run over `spans` (its context chunks) under `cache`'s plan can start here."""
        same_chunks = tuple(spans[:len(self.parts)]) == self.parts and len(spans) > len(self.parts)
        return same_chunks and cache.seedable


class Runner:
    def __init__(self, lm: LoadedModel, storage_dtype: torch.dtype, prefill_chunk: int = 512,
                 prefetch_wait_s: float = 0.0):
        """prefetch_wait_s: how long an offload layer waits for a late prefetch before it attends
        over its low-bit rows alone (0: never waits)."""
        self.lm, self.storage_dtype, self.prefill_chunk = lm, storage_dtype, prefill_chunk
        self.engine = LLMEngine(lm, storage_dtype, KVBudget(UNLIMITED), max_batched_tokens=prefill_chunk, max_seqs=1,
                                prefill_chunk=prefill_chunk, prefetch_wait_s=prefetch_wait_s)
        self.stop_ids = self.engine.scheduler.stop_ids

    def new_cache(self, plan: CompressionPlan) -> SeqCache:
        """A cache driven by hand (`prefill`, `forward`), holding its slot until `close()`."""
        cache = self.engine.runner.new_cache(plan)
        cache.open()
        return cache

    def fit(self, plan: CompressionPlan, prompt: Prompt, sampling: Sampling, budget: float | None) -> CompressionPlan:
        return self.engine.fit(plan, prompt, sampling, budget)

    @torch.inference_mode()
    def run(self, prompt: Prompt, plan: CompressionPlan, sampling: Sampling,
            emit: Callable[[str, object], None] = lambda kind, x: None,
            cancelled: Callable[[], bool] = lambda: False, prefix: Prefix | None = None,
            store: JobHandle | None = None, budget: float | None = None, measure_recall: bool = False,
            record_logits: bool = False):
        """emit("progress", (done, total)) per prefill part; emit("delta", (text, ids, logprobs)) per token.
        `prefix`: this prompt's leading chunks already prefilled (`prefix_of`), used when it seeds.
        `record_logits`: -> (the result, each sampled row's next-token logits [V]) (teacher forcing).
        Offload plans: `store` is the job's cachestore handle (the caller releases it; None: an
        in-process one, released when the job ends), `budget` the job's reserve ratio the offload
        part is fitted to, `measure_recall` checks every prefetch against the oracle top-k (slow).
        Raises `Cancelled` when cancelled before its first token."""
        seq = self.engine.sequence(prompt, plan, sampling, emit=emit, cancelled=cancelled, store=store, ratio=budget,
                                   prefix=prefix, measure_recall=measure_recall)
        seq.step_logits = [] if record_logits else None
        self.engine.add(seq)
        self.engine.run_all()
        if seq.finish_reason == "cancelled" and seq.t_prefilled is None:
            raise Cancelled()
        return (run_result(seq), seq.step_logits) if record_logits else run_result(seq)

    @torch.inference_mode()
    def prefix_of(self, prompt: Prompt, max_window: int = 32) -> Prefix:
        """Prefill every context chunk but the last (as plans whose windows are <= max_window
        chunk it) with dense K/V, once, for runs that start from it."""
        spans = chunks(len(prompt.context_ids), self.engine.chunk, max_window)[:-1]
        cache = self.new_cache(full_plan(self.lm.num_layers, "prefix"))
        try:
            for a, b in spans:
                self.forward(prompt.context_ids[a:b], a, cache, Phase.CONTEXT)
            rows = [cache.tables.dense(i, cache.slot) for i in range(self.lm.num_layers)] if spans else []
        finally:
            cache.close()
        return Prefix(tuple(spans), tuple(k[None] for k, _ in rows), tuple(v[None] for _, v in rows))

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, cache: SeqCache) -> torch.Tensor:
        """Prefill `prompt` into `cache` as a job's sequence would (no offload plan) -> the last
        token's logits [V]."""
        logits = None
        for part in prefill_parts(prompt, self.engine.chunk, cache.max_window):
            logits = self.forward(list(part.ids), part.start, cache, part.phase, context=len(prompt.context_ids))
        return logits[-1]

    def forward(self, ids: list[int], start: int, cache: SeqCache, phase: Phase, keep: int = 1,
                context: int = 0) -> torch.Tensor:
        """ids at positions start.. through `cache` under `phase` -> logits of the last `keep` [keep, V].
        (A cache driven by hand: no offload plan, no statistics.)"""
        seq = types.SimpleNamespace(cache=cache, steps=0, acc={}, context_tokens=context, offload=False, store=None)
        decode = phase is Phase.AFTER and len(ids) == 1
        return self.engine.runner.forward([Segment(seq, tuple(ids), start, phase, keep, False, decode)])
