"""What a finished sequence reports: its text and tokens, its timings, the bytes each layer's
tensors hold against the full fp16 cache, and what an offload plan transferred."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from executor.engine.seq_cache import LayerBytes
from executor.engine.sequence import Sequence


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
    queue_s: float = 0.0              # added -> admitted (waiting for KV budget)
    ttft_s: float = 0.0               # added -> first token
    itl_s: list[float] = field(default_factory=list)    # gaps between consecutive tokens

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


def run_result(seq: Sequence) -> RunResult:
    admitted = seq.t_admitted or seq.t_finished
    prefilled = seq.t_prefilled or seq.t_finished
    times = seq.t_tokens
    return RunResult(seq.final_text, list(seq.generated), seq.prompt.num_tokens, prefilled - admitted,
                     seq.t_finished - prefilled, seq.steps, seq.finish_reason, seq.cache.layer_bytes(),
                     offload_report(seq) if seq.offload else None, queue_s=admitted - seq.t_added,
                     ttft_s=(times[0] if times else seq.t_finished) - seq.t_added,
                     itl_s=[b - a for a, b in zip(times, times[1:])])


def offload_report(seq: Sequence) -> dict:
    store, recall = seq.store, seq.recall
    return {"transport": store.transport, "failed": store.failed, "error": store.error,
            "part": dataclasses.asdict(seq.plan.offload), "stats": dataclasses.asdict(store.stats),
            "recall": sum(r for r, _ in recall) / len(recall) if recall else None,
            "mass_recall": sum(m for _, m in recall) / len(recall) if recall else None}
