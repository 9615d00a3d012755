"""The single-job runner: one job through the engine alone (benches and tests), plus the pieces
benches use to drive a cache by hand (`new_cache`, `decode_step`) and to prefill a prompt's
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
from executor.engine.sequence import Sampling, chunks, prefill_parts
from executor.prompt import Prompt
from cachestore.handle import JobHandle
from kvplan.model import LoadedModel
from kvplan.plan import CompressionPlan, full_plan

__all__ = ["Cancelled", "Prefix", "Runner", "RunResult", "Sampling"]

UNLIMITED = 1 << 62          # a lone job's KV budget: whatever it holds


class Cancelled(Exception):
    pass


@dataclass(frozen=True)
class Prefix:
    """Dense K/V of a prompt's leading context chunks, prefilled once under a full plan: every
    layer holds dense K/V until the context's last chunk (`CacheState` phase "context"), so runs
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
        return same_chunks and all(layer.seedable for layer in cache.layers)


class Runner:
    def __init__(self, lm: LoadedModel, storage_dtype: torch.dtype, prefill_chunk: int = 512,
                 prefetch_wait_s: float = 0.0):
        """prefetch_wait_s: how long an offload layer waits for a late prefetch before it attends
        over its low-bit rows alone (0: never waits)."""
        self.lm, self.storage_dtype, self.prefill_chunk = lm, storage_dtype, prefill_chunk
        self.engine = LLMEngine(lm, storage_dtype, KVBudget(UNLIMITED), max_batched_tokens=prefill_chunk, max_seqs=1,
                                prefill_chunk=prefill_chunk, prefetch_wait_s=prefetch_wait_s)
        self.stop_ids = self.engine.scheduler.stop_ids

    def new_cache(self, plan: CompressionPlan, store: JobHandle | None = None) -> SeqCache:
        """A cache driven by hand (`prefill`, `decode_step`), holding its slot until `close()`."""
        cache = self.engine.runner.new_cache(plan, store)
        cache.open()
        return cache

    def fit(self, plan: CompressionPlan, prompt: Prompt, sampling: Sampling, budget: float | None) -> CompressionPlan:
        return self.engine.fit(plan, prompt, sampling, budget)

    @torch.inference_mode()
    def run(self, prompt: Prompt, plan: CompressionPlan, sampling: Sampling,
            emit: Callable[[str, object], None] = lambda kind, x: None,
            cancelled: Callable[[], bool] = lambda: False, prefix: Prefix | None = None,
            store: JobHandle | None = None, budget: float | None = None, measure_recall: bool = False) -> RunResult:
        """emit("progress", (done, total)) per prefill part; emit("delta", (text, ids, logprobs)) per token.
        `prefix`: this prompt's leading chunks already prefilled (`prefix_of`), used when it seeds.
        Offload plans: `store` is the job's cachestore handle (the caller releases it; None: an
        in-process one, released when the job ends), `budget` the job's reserve ratio the offload
        part is fitted to, `measure_recall` checks every prefetch against the oracle top-k (slow).
        Raises `Cancelled` when cancelled before its first token."""
        seq = self.engine.sequence(prompt, plan, sampling, emit=emit, cancelled=cancelled, store=store, ratio=budget,
                                   prefix=prefix, measure_recall=measure_recall)
        self.engine.add(seq)
        self.engine.run_all()
        if seq.finish_reason == "cancelled" and seq.t_prefilled is None:
            raise Cancelled()
        return run_result(seq)

    @torch.inference_mode()
    def prefix_of(self, prompt: Prompt, max_window: int = 32) -> Prefix:
        """Prefill every context chunk but the last (as plans whose windows are <= max_window
        chunk it) with dense K/V, once, for runs that start from it."""
        spans = chunks(len(prompt.context_ids), self.engine.chunk, max_window)[:-1]
        cache = self.new_cache(full_plan(self.lm.num_layers, "prefix"))
        try:
            for a, b in spans:
                self.forward(prompt.context_ids[a:b], a, cache, "context")
            rows = [cache.tables.dense(i, cache.slot) for i in range(self.lm.num_layers)] if spans else []
        finally:
            cache.close()
        return Prefix(tuple(spans), tuple(k[None] for k, _ in rows), tuple(v[None] for _, v in rows))

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, cache: SeqCache) -> torch.Tensor:
        """Prefill `prompt` into `cache` as a job's sequence would -> the last token's logits [V]."""
        cache.state.context_tokens = len(prompt.context_ids)
        logits = None
        for part in prefill_parts(prompt, self.engine.chunk, cache.max_window):
            logits = self.forward(list(part.ids), part.start, cache, part.phase)
        return logits[-1]

    @torch.inference_mode()
    def decode_step(self, tok: int, pos: int, cache: SeqCache, step: int, guess: int | None
                    ) -> tuple[torch.Tensor, int | None]:
        """Feed `tok` at `pos` (decode step `step`, from 1) -> (next-token logits [V], the next
        guess). Offload plans decode speculatively (the first step starts the guess chain with
        SpeCache's pre-decoding pass); other plans one token at a time (the guess stays None)."""
        if not cache.plan.offload.enabled:
            return self.forward([tok], pos, cache, "after")[-1], None
        if guess is None:
            guess = int(self.forward([tok], pos, cache, "predecode", steps=step - 1)[-1].argmax())
        logits = self.forward([tok, guess], pos, cache, "spec", keep=2, steps=step - 1)         # [2, V]
        return logits[0], int(logits[1].argmax())

    def forward(self, ids: list[int], start: int, cache: SeqCache, phase: str, keep: int = 1,
                steps: int = 0) -> torch.Tensor:
        """ids at positions start.. through `cache` under `phase` -> logits of the last `keep` [keep, V]."""
        seq = types.SimpleNamespace(cache=cache, steps=steps)
        decode = phase == "after" and len(ids) == 1
        return self.engine.runner.forward([Segment(seq, tuple(ids), start, phase, keep, False, decode)])
