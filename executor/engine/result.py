"""What a finished sequence reports: its text and tokens, its timings, the bytes each layer's
tensors hold against the full fp16 cache, what an offload plan transferred, and whether its
compression put the answer at risk (`executor.engine.risk`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from executor.engine import risk
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
    kv_risk: float = 0.0              # share of the answer not copied from the prompt (`risk.kv_risk`)
    kv_at_risk: bool = False          # compressed and kv_risk above `risk.THRESHOLD`

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
    kv_risk = risk.kv_risk(list(seq.prompt.context_ids) + list(seq.prompt.question_ids), seq.generated)
    return RunResult(seq.final_text, list(seq.generated), seq.prompt.num_tokens, prefilled - admitted,
                     seq.t_finished - prefilled, seq.steps, seq.finish_reason, seq.cache.layer_bytes(),
                     offload_report(seq) if seq.offload else None, queue_s=admitted - seq.t_added,
                     ttft_s=(times[0] if times else seq.t_finished) - seq.t_added,
                     itl_s=[b - a for a, b in zip(times, times[1:])], kv_risk=kv_risk,
                     kv_at_risk=risk.at_risk(kv_risk, seq.plan))


def offload_report(seq: Sequence) -> dict:
    store, recall = seq.store, seq.recall
    return {"transport": store.transport, "failed": store.failed, "error": store.error,
            "part": dataclasses.asdict(seq.plan.offload), "stats": dataclasses.asdict(store.stats),
            "recall": sum(r for r, _ in recall) / len(recall) if recall else None,
            "mass_recall": sum(m for _, m in recall) / len(recall) if recall else None}
