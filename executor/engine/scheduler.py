"""Which rows the next step runs, and what the step's outputs do to each sequence.

schedule(): admit waiting sequences while the KV budget holds their reservations (and fewer than
`max_seqs` run) — in arrival order within a tenant, across tenants by deficit round robin over
their tokens (`executor.fairness`: one tenant's backlog does not keep another's job waiting); then every decoding sequence's rows (one; two for
SpeCache's speculative step), then prefill parts of admitted sequences in admission order while
the step's rows stay within `max_batched_tokens` — one part always goes, so a long prompt
prefills a chunk per step beside the decodes instead of freezing them for its whole prefill.

postprocess(): a prefill part done advances its sequence (after the context's last chunk the
reservation tightens to what the compressed cache can still grow to; after the prompt's last
part its first token is sampled); a decode appends its token; stop token, stop sequence,
max_new_tokens or a cancel finish a sequence and release its bytes. `blocked()`: the first waiting sequence waits for
bytes — what makes the executor shrink dense running jobs (`executor.engine.shrink`)."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from executor.engine.kv_budget import KVBudget
from executor.engine.sequence import Phase, Sequence, Status
from executor.fairness import FairQueue, Waiting

log = logging.getLogger("kvplan.executor.engine")


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a step: `ids` fed from position `start` under `phase`; the logits of
    its last `keep` rows come back; `sample`: the step samples its next token; `decode`: decode
    rows (else a prefill part)."""
    seq: Sequence
    ids: tuple[int, ...]
    start: int
    phase: Phase
    keep: int
    sample: bool
    decode: bool = False


@dataclass(frozen=True)
class Output:
    token: int | None        # sampled next token (segments that sample)
    guess: int | None        # SpeCache: the next speculative token ("predecode", "spec")
    logprob: tuple | None = None   # (its log-probability, top ids, their log-probabilities) when the job asked


class Scheduler:
    def __init__(self, budget: KVBudget, max_batched_tokens: int, max_seqs: int, stop_ids: set[int],
                 tenant_weight=None):
        self.budget, self.max_batched_tokens, self.max_seqs = budget, max_batched_tokens, max_seqs
        self.fair = FairQueue(tenant_weight)
        self._admitting = threading.Lock()             # `blocked` asks from the worker's thread
        self.stop_ids = stop_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []          # ended outside a step's outputs (cancelled)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # -- schedule -------------------------------------------------------------------------------
    def schedule(self) -> list[Segment]:
        self._drop_cancelled()
        with self._admitting:
            while self.waiting and len(self.running) < self.max_seqs:
                seq = self._next(self.fair.pick)
                if not self.budget.can_reserve(seq.reserved):
                    if not seq.preemptions:
                        self.fair.unpick(self._waiting(seq))     # it goes first once room is made
                    break
                self.waiting.remove(seq)
                self.budget.reserve(seq.seq_id, seq.reserved)
                seq.cache.open()                               # its slot in the block tables
                seq.status, seq.t_admitted = Status.PREFILL, time.perf_counter()
                self.running.append(seq)
        segments, rows, prefills = [], 0, 0
        for seq in self.running:
            if seq.status is Status.DECODE:
                ids, phase = seq.decode_rows()
                segments.append(Segment(seq, tuple(ids), seq.pos, phase, len(ids), phase is not Phase.PREDECODE, True))
                rows += len(ids)
        for seq in self.running:
            if seq.status is not Status.PREFILL:
                continue
            part = seq.parts[0]
            if prefills and rows + len(part.ids) > self.max_batched_tokens:
                break
            sample = len(seq.parts) == 1 and not seq.generated      # recomputed: its next token is sampled already
            segments.append(Segment(seq, part.ids, part.start, part.phase, 1 if sample else 0, sample))
            rows, prefills = rows + len(part.ids), prefills + 1
        return segments

    @staticmethod
    def _waiting(seq: Sequence) -> Waiting:
        return Waiting(str(seq.seq_id), seq.tenant, seq.prompt.num_tokens + seq.sampling.max_new_tokens)

    def _next(self, pick) -> Sequence:
        """The waiting sequence admission offers next: a preempted one first (it was running), else
        `pick` (`FairQueue.pick` or `.peek`) over them."""
        for s in self.waiting:
            if s.preemptions:
                return s
        by_key = {str(s.seq_id): s for s in self.waiting}
        return by_key[pick([self._waiting(s) for s in self.waiting]).key]

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancelled()]:
            self.waiting.remove(seq)
            seq.finish("cancelled")
            seq.cache.close()
            self.finished.append(seq)
        for seq in [s for s in self.running if s.cancelled()]:
            self.abort(seq, "cancelled")

    # -- postprocess ----------------------------------------------------------------------------
    def postprocess(self, segments: list[Segment], outputs: list[Output]) -> list[Sequence]:
        """-> the sequences that finished in this step (and any cancelled since the last)."""
        done, self.finished = self.finished, []
        for seg, out in zip(segments, outputs):
            seq = seg.seq
            if seq.status is Status.PREFILL:
                seq.parts.pop(0)
                seq.done_tokens += len(seg.ids)
                seq.emit("progress", (seq.done_tokens, seq.prompt.num_tokens))
                if seg.phase is Phase.COMPRESS:
                    self._tighten(seq)
                if seg.phase is Phase.STATS:          # the plan comes now: it waits for it
                    seq.status = Status.PLANNING
                    seq.emit("context", seq.stats.result())
                    if seq.parts:
                        continue
                    seq.t_prefilled = time.perf_counter()      # its first token does not wait for the plan
                elif seq.parts:
                    continue
                else:
                    seq.status = Status.DECODE
                    seq.t_prefilled = seq.t_prefilled or time.perf_counter()
                    if seq.generated:                  # recomputed after a preemption: it decodes on from here
                        continue
            else:
                seq.guess = out.guess
                if seg.phase is Phase.PREDECODE:
                    continue
                seq.steps += 1
            self._take(seq, out.token, out.logprob)
            if seq.status is Status.FINISHED:
                self._end(seq, seq.finish_reason)
                done.append(seq)
        return done

    def _take(self, seq: Sequence, tok: int, logprob: tuple | None = None) -> None:
        forced = seq.sampling.forced
        if len(seq.generated) < len(forced):
            tok = forced[len(seq.generated)]
        if tok in self.stop_ids and not seq.sampling.ignore_eos and len(seq.generated) >= seq.sampling.min_tokens:
            seq.finish("eos")
            return
        seq.append(tok, logprob)
        if seq.stopped:                                    # its text reached one of its stop sequences
            seq.finish("stop")
        elif len(seq.generated) >= seq.sampling.max_new_tokens:
            seq.finish("length")

    def planned(self, seq: Sequence) -> None:
        """A sequence's plan came and its cache is compressed: tighten its reservation, go on."""
        self._tighten(seq)
        if seq.status is Status.PLANNING:
            seq.status = Status.PREFILL if seq.parts else Status.DECODE

    def blocked(self) -> bool:
        """Whether the sequence admission offers next waits for bytes (not for a free seat)."""
        with self._admitting:
            if not self.waiting or len(self.running) >= self.max_seqs:
                return False
            return not self.budget.can_reserve(self._next(self.fair.peek).reserved)

    def shrunk(self, seq: Sequence) -> None:
        """A running sequence's cache was rebuilt under a lower plan: reserve what it can still grow to."""
        self._tighten(seq)

    def _tighten(self, seq: Sequence) -> None:
        """The context is compressed (or the cache shrunk later): reserve what the cache holds plus
        the most it can grow to over the question's parts left and the generated rows still to be
        fed back (every sampled token but the last; the first is sampled at the prompt's end)."""
        fed = max(len(seq.generated), 1)
        adds = [len(p.ids) for p in seq.parts] + [1] * max(seq.sampling.max_new_tokens - fed, 0)
        need = seq.cache.bytes_bound(adds)
        if self.budget.resize(seq.seq_id, need):
            seq.reserved = need
        else:
            log.error("job %s: its compressed cache may grow to %d bytes, past the %d reserved before its prefill "
                      "and more than the budget has free", seq.job_id, need, seq.reserved)

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence out of the step loop to recompute it later: its pages and its
        reservation back, it first in the waiting line (the engine gives it a new cache and parts)."""
        seq.cache.close()
        self.budget.release(seq.seq_id)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def newest(self) -> Sequence | None:
        """The running sequence admitted last that can be recomputed (prefilling or decoding, not
        waiting for its plan; an offload plan's only when nothing else can)."""
        movable = [s for s in self.running if s.status in (Status.PREFILL, Status.DECODE)]
        plain = [s for s in movable if not s.offload] or movable
        return max(plain, key=lambda s: (s.t_admitted or 0.0, s.seq_id), default=None)

    def abort(self, seq: Sequence, reason: str) -> None:
        """End an admitted sequence outside a step's outputs (cancelled, or its step failed);
        the next `postprocess` returns it."""
        self._end(seq, reason)
        self.finished.append(seq)

    def _end(self, seq: Sequence, reason: str) -> None:
        seq.finish(reason)
        seq.cache.close()                                  # its blocks back to the pool
        self.budget.release(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
