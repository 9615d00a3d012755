"""The model runner: prefill a prompt under a plan, then decode token by token.

Runs synchronously (the worker calls it in a thread); reports progress and token deltas
through `emit`, and stops early when `cancelled()` turns true.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from executor import attention, offload_budget
from executor.cache import LayerBytes, PlannedCache
from executor.prompt import Prompt
from executor.sampler import Sampler
from cachestore.handle import JobHandle, LocalHandle
from kvplan.model import LoadedModel
from kvplan.plan import CompressionPlan, full_plan


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class RunResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int                 # forward passes after prefill
    finish_reason: str                # "eos" | "length" | "cancelled"
    layers: list[LayerBytes] = field(default_factory=list)
    offload: dict | None = None       # offload plans: transport, fitted part, transfer stats, recall

    @property
    def degraded(self) -> bool:
        """The cachestore failed during the job: it finished on its low-bit copy."""
        return bool(self.offload and self.offload["failed"])

    @property
    def kv_bytes(self) -> int:
        return sum(x.kv_bytes for x in self.layers)

    @property
    def full_kv_bytes(self) -> int:
        return sum(x.full_kv_bytes for x in self.layers)


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

    def seeds(self, cache: PlannedCache, spans: list[tuple[int, int]]) -> bool:
        """Whether a run over `spans` (its context chunks) under `cache`'s plan can start here."""
        same_chunks = tuple(spans[:len(self.parts)]) == self.parts and len(spans) > len(self.parts)
        return same_chunks and all(layer.seedable for layer in cache.layers)


def _stop_ids(lm: LoadedModel) -> set[int]:
    ids = {lm.tokenizer.eos_token_id}
    gen = getattr(lm.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {i for i in ids if i is not None}


class Runner:
    def __init__(self, lm: LoadedModel, storage_dtype: torch.dtype, prefill_chunk: int = 512,
                 prefetch_wait_s: float = 0.0):
        """prefetch_wait_s: how long an offload layer waits for a late prefetch before it attends
        over its low-bit rows alone (0: never waits)."""
        self.lm = lm
        self.prefetch_wait_s = prefetch_wait_s
        self.storage_dtype = storage_dtype
        self.prefill_chunk = prefill_chunk
        self.stop_ids = _stop_ids(lm)
        lm.model.set_attn_implementation(attention.register())     # every layer attends through its cache

    def new_cache(self, plan: CompressionPlan, store: JobHandle | None = None) -> PlannedCache:
        lm = self.lm
        rotary = lm.model.model.rotary_emb
        return PlannedCache(plan, lm.num_layers, lm.num_kv_heads, lm.head_dim, self.storage_dtype,
                            lm.num_query_heads, (rotary.inv_freq.float(), float(rotary.attention_scaling)), store)

    def fit(self, plan: CompressionPlan, prompt: Prompt, sampling: Sampling, budget: float | None) -> CompressionPlan:
        """An offload plan's part fitted to the job's reserve ratio (`executor.offload_budget`)."""
        if not plan.offload.enabled:
            return plan
        off = offload_budget.fit(plan.offload, budget, prompt.num_tokens, sampling.max_new_tokens,
                                 self.lm.head_dim, self.storage_dtype.itemsize)
        return dataclasses.replace(plan, offload=off)

    @torch.inference_mode()
    def run(self, prompt: Prompt, plan: CompressionPlan, sampling: Sampling,
            emit: Callable[[str, object], None] = lambda kind, x: None,
            cancelled: Callable[[], bool] = lambda: False, prefix: Prefix | None = None,
            store: JobHandle | None = None, budget: float | None = None, measure_recall: bool = False) -> RunResult:
        """emit("progress", (done, total)) during prefill; emit("delta", (text, ids)) per token.
        `prefix`: this prompt's leading chunks already prefilled (`prefix_of`), used when it seeds.
        Offload plans: `store` is the job's cachestore handle (the caller releases it; None: an
        in-process one, released here), `budget` the job's reserve ratio the offload part is
        fitted to, `measure_recall` checks every prefetch against the oracle top-k (slow)."""
        plan = self.fit(plan, prompt, sampling, budget)
        own = store is None and plan.offload.enabled
        store = LocalHandle() if own else store
        try:
            return self._run(prompt, plan, sampling, emit, cancelled, prefix, store, measure_recall)
        finally:
            if own:
                store.release()

    def _run(self, prompt, plan, sampling, emit, cancelled, prefix, store, measure_recall) -> RunResult:
        cache = self.new_cache(plan, store)
        offload = plan.offload.enabled
        cache.state.wait_s = self.prefetch_wait_s
        cache.state.recall = [] if offload and measure_recall else None
        sampler = Sampler(sampling.temperature, sampling.top_p, sampling.seed)
        t0 = time.perf_counter()
        logits = self._prefill(prompt, cache, emit, cancelled, prefix)
        prefill_s = time.perf_counter() - t0

        generated: list[int] = []
        text, finish, steps = "", "length", 0
        pos, guess = prompt.num_tokens, None
        t1 = time.perf_counter()
        while True:
            tok = sampler(logits)
            if tok in self.stop_ids:
                finish = "eos"
                break
            generated.append(tok)
            new_text = self.lm.tokenizer.decode(generated, skip_special_tokens=True)
            if not new_text.endswith("\ufffd"):          # wait for a whole UTF-8 character
                emit("delta", (new_text[len(text):], [tok]))
                text = new_text
            if len(generated) >= sampling.max_new_tokens:
                break
            if cancelled():
                finish = "cancelled"
                break
            logits, guess = self.decode_step(tok, pos, cache, steps + 1, guess)
            pos += 1
            steps += 1
        decode_s = time.perf_counter() - t1
        text = self.lm.tokenizer.decode(generated, skip_special_tokens=True)
        return RunResult(text, generated, prompt.num_tokens, prefill_s, decode_s, steps, finish, cache.layer_bytes(),
                         _offload_report(plan, store, cache) if offload else None)

    @torch.inference_mode()
    def prefix_of(self, prompt: Prompt, max_window: int = 32) -> Prefix:
        """Prefill every context chunk but the last (as plans whose windows are <= max_window
        chunk it) with dense K/V, once, for runs that start from it."""
        spans = _chunks(len(prompt.context_ids), self.prefill_chunk, max_window)[:-1]
        cache = self.new_cache(full_plan(self.lm.num_layers, "prefix"))
        for a, b in spans:
            self._forward(prompt.context_ids[a:b], a, cache)
        layers = cache.layers if spans else []
        return Prefix(tuple(spans), tuple(x.keys for x in layers), tuple(x.values for x in layers))

    def _prefill(self, prompt: Prompt, cache: PlannedCache, emit, cancelled, prefix: Prefix | None = None) -> torch.Tensor:
        """The context in chunks; layers compress right after the attention of its last chunk
        (which holds at least the observation window); then the question, over the compressed
        cache."""
        total, done, logits = prompt.num_tokens, 0, None
        cache.state.context_tokens = len(prompt.context_ids)
        chunks = _chunks(len(prompt.context_ids), self.prefill_chunk, cache.max_window)
        if prefix is not None and prefix.parts and prefix.seeds(cache, chunks):
            for layer, k, v in zip(cache.layers, prefix.keys, prefix.values):
                layer.seed(k, v, self.lm.model.dtype)   # never written in place: shared safely
            chunks, done = chunks[len(prefix.parts):], prefix.tokens
        parts = [(prompt.context_ids[a:b], "compress" if b == len(prompt.context_ids) else "context") for a, b in chunks]
        parts += [(prompt.question_ids[a:a + self.prefill_chunk], "after")
                  for a in range(0, len(prompt.question_ids), self.prefill_chunk)]
        for ids, phase in parts:
            if cancelled():
                raise Cancelled()
            cache.state.phase = phase
            logits = self._forward(ids, done, cache)
            done += len(ids)
            emit("progress", (done, total))
        cache.state.phase = "after"
        return logits

    def decode_step(self, tok: int, pos: int, cache: PlannedCache, step: int, guess: int | None
                    ) -> tuple[torch.Tensor, int | None]:
        """Feed `tok` at `pos` (decode step `step`, from 1) -> (next-token logits [V], the next
        guess). Offload plans decode speculatively (the first step starts the guess chain with
        SpeCache's pre-decoding pass); other plans one token at a time (the guess stays None)."""
        if not cache.plan.offload.enabled:
            return self._forward([tok], pos, cache), None
        if guess is None:
            guess = self._predecode(tok, pos, cache)
        return self._speculative_step(tok, guess, pos, cache, step)

    def _predecode(self, tok: int, pos: int, cache: PlannedCache) -> int:
        """SpeCache's pre-decoding: `tok` at `pos` over the low-bit copies, storing nothing; its
        attention prefetches step 1's rows and its prediction is the first guess."""
        cache.state.phase, cache.state.step = "predecode", 0
        logits = self._forward([tok], pos, cache)
        cache.state.phase = "after"
        return int(logits.argmax())

    def _speculative_step(self, tok: int, guess: int, pos: int, cache: PlannedCache, step: int) -> tuple[torch.Tensor, int]:
        """The real token at `pos` and the guess at pos + 1 in one forward -> (logits of the
        real one [V], the next guess: the guess row's argmax)."""
        cache.state.phase, cache.state.step = "spec", step
        logits = self._forward([tok, guess], pos, cache, keep=2)                  # [2, V]
        cache.state.phase = "after"
        return logits[0], int(logits[1].argmax())

    def _forward(self, ids: list[int], start: int, cache: PlannedCache, keep: int = 1) -> torch.Tensor:
        """ids: the new tokens at positions start.. -> logits of the last one, [V] ([keep, V]
        of the last `keep` when keep > 1)."""
        input_ids = torch.tensor([ids], dtype=torch.long)                      # [1, T_new]
        position_ids = torch.arange(start, start + len(ids)).unsqueeze(0)       # [1, T_new]
        with attention.using(cache):
            out = self.lm.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                                use_cache=True, logits_to_keep=keep)
        return out.logits[0, -1] if keep == 1 else out.logits[0, -keep:]


def _offload_report(plan: CompressionPlan, store: JobHandle, cache: PlannedCache) -> dict:
    recall = cache.state.recall
    return {"transport": store.transport, "failed": store.failed, "error": store.error,
            "part": dataclasses.asdict(plan.offload), "stats": dataclasses.asdict(store.stats),
            "recall": sum(r for r, _ in recall) / len(recall) if recall else None,
            "mass_recall": sum(m for _, m in recall) / len(recall) if recall else None}


def _chunks(n: int, size: int, min_last: int) -> list[tuple[int, int]]:
    """[start, end) spans covering n tokens, `size` each, the last one at least `min_last` long."""
    bounds = list(range(0, n, size)) + [n]
    spans = list(zip(bounds[:-1], bounds[1:]))
    while len(spans) > 1 and spans[-1][1] - spans[-1][0] < min_last:
        spans[-2:] = [(spans[-2][0], spans[-1][1])]
    return spans
