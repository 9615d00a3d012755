"""The load a serving bench sends, like `vllm bench serve`: requests drawn deterministically from
the quality bench's case families, each sent at its arrival time (all at once, or a Poisson
process at a rate) over the executor's gRPC API, its token events timed as they stream in."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from bench.cases import Case, generate, is_correct
from kvplan.client import ExecutorClient, request
from protos import executor_pb2 as pb


@dataclass
class Item:
    case: Case
    strategy: str
    ratio: float | None
    new_tokens: int
    at_s: float                                  # arrival, seconds after the load starts
    profile: str = ""                            # jobs of one profile may share a plan (the planner's sample)
    ignore_eos: bool = False                     # generate new_tokens whatever the model says
    adaptive: bool = False                       # an adaptive budget (ratio unset): the load decides


@dataclass
class Sent:
    item: Item
    t_submit: float = 0.0
    t_tokens: list[float] = field(default_factory=list)     # when each token's event arrived
    t_done: float = 0.0
    result: pb.JobResult | None = None
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.t_tokens[0] - self.t_submit if self.t_tokens else float("nan")

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.t_tokens, self.t_tokens[1:])]

    @property
    def tpot_s(self) -> float:
        n = len(self.t_tokens)
        return (self.t_tokens[-1] - self.t_tokens[0]) / (n - 1) if n > 1 else float("nan")

    @property
    def correct(self) -> bool:
        return self.result is not None and is_correct(self.item.case.answer, self.result.text)


def cases(tokenizer, n: int, lengths: list[int]) -> list[Case]:
    """n cases, needle and multi-key in turn over the lengths and depths (deterministic)."""
    families = [generate(f, tokenizer, lengths=tuple(lengths)) for f in ("niah", "multikey")]
    pool = [c for pair in zip(*families) for c in pair]
    return [pool[i % len(pool)] for i in range(n)]


def arrivals(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """All at 0 (rate None), or a Poisson process of `rate` requests per second."""
    if not rate:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run(address: str, items: list[Item], timeout_s: float = 7200.0) -> list[Sent]:
    """Send every item at its time, each over its own streaming Generate -> what came back."""
    sent = [Sent(it) for it in items]
    t0 = time.perf_counter()

    def one(s: Sent) -> None:
        time.sleep(max(0.0, s.item.at_s - (time.perf_counter() - t0)))
        it = s.item
        req = request(it.case.context + "\n\n" + it.case.question, max_new_tokens=it.new_tokens, strategy=it.strategy,
                      reserve_ratio=it.ratio, profile=it.profile, ignore_eos=it.ignore_eos, adaptive=it.adaptive)
        s.t_submit = time.perf_counter()
        try:
            with ExecutorClient(address, timeout_s=timeout_s) as client:
                for ev in client.generate(req):
                    kind = ev.WhichOneof("kind")
                    if kind == "delta":
                        s.t_tokens += [time.perf_counter()] * len(ev.delta.token_ids)
                    elif kind == "result":
                        s.result = ev.result
                    elif kind == "status" and ev.status.state in (pb.FAILED, pb.CANCELLED):
                        s.error = ev.status.error or pb.JobState.Name(ev.status.state)
        except Exception as e:          # a failed request is reported, not fatal to the bench
            s.error = f"{type(e).__name__}: {e}"
        s.t_done = time.perf_counter()

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in sent]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent
