"""One job's state in the engine: its prompt split into prefill parts, its sampling, its plan and
the `SeqCache` shaped by it (its slot in the pool's tables), its cachestore handle, where it is
(position, status), what it generated, its incremental detokenizer, and what its compression keeps
between steps (H2O's accumulated attention, the statistics its plan comes from, SpeCache's guess
and prefetched rows).

A sequence moves WAITING -> PREFILL (admitted: its bytes reserved; prefill parts scheduled one
per step) -> DECODE (a row per step; an offload plan: one pre-decoding step, then two rows per
step, the real token and the guess) -> FINISHED. A dense running sequence may be shrunk to a
lower-ratio plan between steps (`executor.engine.shrink`); its status does not change. What a
part's rows are to the cache is its `Phase`."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from tokenizers.decoders import DecodeStream

from executor.engine.seq_cache import SeqCache
from executor.engine.sampler import generator
from executor.prompt import Prompt
from kvcore.plan import CompressionPlan


class Phase(enum.Enum):
    """What a part's rows are to the cache."""
    CONTEXT = "context"        # the part of the prompt to compress, prefilled dense
    COMPRESS = "compress"      # its last chunk: after its attention every layer compresses (`executor.presses`)
    STATS = "stats"            # its last chunk when the plan comes after it: statistics gathered, last queries kept
    AFTER = "after"            # the question and decode rows, over the compressed cache
    PREDECODE = "predecode"    # offload plans: a decode row that stores nothing and guesses the next token
    SPEC = "spec"              # offload plans: the row and its guess, over the prefetched rows

    @property
    def context(self) -> bool:
        """Rows of the context before its compression (dense)."""
        return self in (Phase.CONTEXT, Phase.COMPRESS, Phase.STATS)


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    PLANNING = "planning"        # its context prefilled dense, waiting for the plan its statistics ask for
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False          # generate max_new_tokens whatever the model says (benchmarks)
    stop: tuple[str, ...] = ()        # stop sequences: the text ends before the first one generated
    logprobs: int | None = None       # set: each token's log-probability and this many top tokens'
    min_tokens: int = 0               # an end-of-text token before this many generated goes on as ignore_eos
    forced: tuple[int, ...] = ()      # the tokens taken instead of the sampled ones (teacher forcing: benches)


@dataclass(frozen=True)
class Part:
    """A prefill chunk: ids fed at `start`, under `phase`."""
    ids: tuple[int, ...]
    start: int
    phase: Phase


def chunks(n: int, size: int, min_last: int) -> list[tuple[int, int]]:
    """[start, end) spans covering n tokens, `size` each, the last one at least `min_last` long
    (it holds the observation window the layers score the context with)."""
    bounds = list(range(0, n, size)) + [n]
    spans = list(zip(bounds[:-1], bounds[1:]))
    while len(spans) > 1 and spans[-1][1] - spans[-1][0] < min_last:
        spans[-2:] = [(spans[-2][0], spans[-1][1])]
    return spans


def generated_parts(prompt: Prompt, generated: list[int], chunk: int) -> list[Part]:
    """A preempted sequence's generated tokens but the last (the next one its decode feeds), fed
    again after its prompt when it is recomputed: `chunk`-token parts over the compressed cache."""
    fed, n = generated[:-1], prompt.num_tokens
    return [Part(tuple(fed[a:a + chunk]), n + a, Phase.AFTER) for a in range(0, len(fed), chunk)]


def prefill_parts(prompt: Prompt, chunk: int, min_last: int, skip: int = 0, last: Phase = Phase.COMPRESS) -> list[Part]:
    """The prompt's prefill as parts: the context in `chunk`-token spans (the last one holding at
    least `min_last`, under phase `last`), then the question in `chunk`-token spans. Fixed per
    sequence, whatever it is batched with, so a job's arithmetic is the same alone or batched.
    `skip`: context spans already prefilled (a seeded prefix)."""
    ctx, n = prompt.context_ids, len(prompt.context_ids)
    parts = [Part(tuple(ctx[a:b]), a, last if b == n else Phase.CONTEXT)
             for a, b in chunks(n, chunk, min_last)[skip:]]
    q = prompt.question_ids
    parts += [Part(tuple(q[a:a + chunk]), n + a, Phase.AFTER) for a in range(0, len(q), chunk)]
    return parts


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt: Prompt
    plan: CompressionPlan
    sampling: Sampling
    cache: SeqCache
    parts: list[Part]                                  # prefill parts not yet run, in order
    tokenizer: object                                  # a transformers fast tokenizer
    emit: Callable[[str, object], None] = lambda kind, x: None    # ("progress", (done, total)) |
                                                                   # ("delta", (text, ids, logprobs))
    cancelled: Callable[[], bool] = lambda: False
    store: object | None = None                        # cachestore.handle.JobHandle (offload plans)
    job_id: str = ""
    tenant: str = ""                                   # whose job: admission is fair across tenants
    planned_after: bool = False                        # its plan comes after the context (statistics sent)
    own_store: bool = False                            # the engine releases the store when it ends
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    reserved: int = 0                                  # bytes the KV budget holds for it
    done_tokens: int = 0                               # prompt tokens prefilled
    generated: list[int] = field(default_factory=list)
    last_token: int | None = None                      # sampled, to be fed next
    guess: int | None = None                           # SpeCache: the speculative next token
    steps: int = 0                                     # decode forwards after the prefill
    finish_reason: str = ""                            # "eos" | "length" | "stop" | "cancelled"
    text: str = ""                                     # detokenized so far (cut at a stop sequence)
    shown: int = 0                                     # characters of `text` streamed (the rest held back)
    stopped: bool = False                              # `text` reached one of its stop sequences
    logprobs: list = field(default_factory=list)       # per generated token, when asked: `Output.logprob`
    t_added: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_prefilled: float | None = None
    t_finished: float | None = None
    t_tokens: list[float] = field(default_factory=list)   # when each generated token was sampled
    queries: list | None = None                        # [m] of [H, W, D]: the context's last queries, kept while
                                                       # its cache is dense (a shrink compresses with them)
    shrinks: list = field(default_factory=list)        # `executor.engine.shrink.Shrink`, each time it was shrunk
    preemptions: int = 0                               # times the engine gave back its pages to recompute it later
    step_logits: list | None = None                    # set: each sampled row's next-token logits [V] (benches)
    stats: object | None = None                        # `kvcore.statistics.LayerStatistics` its STATS chunk adds to
    acc: dict = field(default_factory=dict)            # H2O: attention accumulated per layer [H, T] (prefill only)
    offload_state: dict = field(default_factory=dict)  # SpeCache per layer: its sinks, the rows prefetched now
    recall: list | None = None                         # SpeCache: each prefetch's recall, when measured
    prefetch_wait_s: float = 0.0                       # SpeCache: how long a layer waits for a late prefetch

    def __post_init__(self):
        self.detok = DecodeStream(skip_special_tokens=True)
        self.gen = generator(self.sampling.seed) if self.sampling.temperature > 0 else None

    # -- what the next step feeds -------------------------------------------------------------
    @property
    def offload(self) -> bool:
        return self.plan.offload.enabled

    @property
    def pos(self) -> int:
        """Position of the next token fed (the prompt's, then one per fed generated token)."""
        return self.prompt.num_tokens + self.steps

    @property
    def context_tokens(self) -> int:
        return len(self.prompt.context_ids)

    def decode_rows(self) -> tuple[list[int], Phase]:
        """The rows of this sequence's next decode step and their phase: the sampled token; an
        offload plan first pre-decodes it (stores nothing, guesses the next), then feeds it with
        the guess (SPEC)."""
        if not self.offload:
            return [self.last_token], Phase.AFTER
        if self.guess is None:
            return [self.last_token], Phase.PREDECODE
        return [self.last_token, self.guess], Phase.SPEC

    # -- bookkeeping --------------------------------------------------------------------------
    def append(self, tok: int, logprob: tuple | None = None) -> None:
        """A sampled token (and its log-probabilities, when asked): kept and its text streamed."""
        self.t_tokens.append(time.perf_counter())
        self.generated.append(tok)
        self.last_token = tok
        piece = self.detok.step(self.tokenizer._tokenizer, tok)
        if piece is not None:                     # None: an incomplete UTF-8 character so far
            self.text += piece
        if logprob is not None:
            self.logprobs.append(logprob)
        self.emit("delta", (self._release(), [tok], [logprob] if logprob is not None else []))

    def _release(self) -> str:
        """The text to stream now. With stop sequences the first one generated ends the text
        (`stopped`), and the last characters that could still begin one are held back, as vLLM
        holds them: a client never sees text the stop takes back. The result's text has the rest."""
        stops, end = self.sampling.stop, len(self.text)
        if stops:
            hits = [i for i in (self.text.find(s, self.shown) for s in stops) if i >= 0]
            if hits:
                end = min(hits)
                self.text, self.stopped = self.text[:end], True
            else:
                end = max(self.shown, end - max(map(len, stops)) + 1)
        out, self.shown = self.text[self.shown:end], end
        return out

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason
        self.t_finished = time.perf_counter()

    @property
    def final_text(self) -> str:
        if self.stopped:                          # cut where its stop sequence began
            return self.text
        return self.tokenizer.decode(self.generated, skip_special_tokens=True)

    def kv_bytes(self) -> int:
        """Bytes the tensors of this sequence's cache hold now."""
        return self.cache.kv_bytes()
