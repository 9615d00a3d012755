"""A decode step's cost against how many sequences it holds: the engine stepping N sequences of a
1-token context (so the KV read is nothing and what is left is the weights and the engine's own
work), and where a step's time goes — the weight products (oneDNN / BLAS calls), the kernels
(paged attention, the decoder's fused ops, the pool writes), and everything else (Python, small
torch ops): what the engine itself spends per step.

    python -m bench.speed --steps [--seqs 4 16] [--reps 30]

The step time is measured without a profiler; the products' and kernels' times with Python's
profiler in a second pass (their C calls' own time, which the profiler does not inflate); the
share outside them is 1 - (products + kernels) / step. Reported beside each other in one run."""
from __future__ import annotations

import cProfile
import pstats
import random
import time

import torch

from executor.engine import KVBudget, LLMEngine, Sampling, Status
from executor.prompt import Prompt
from kvcore.plan import full_plan

GEMMS = ("_linear_pointwise", "linear", "addmm", "mm", "matmul", "bmm")
KERNELS = ("kvplan_cpu_decode",)


def _engine(lm, n: int, steps: int) -> LLMEngine:
    """n sequences decoding, each with room for `steps` more tokens: its reservation (context +
    max_new_tokens rows) small enough that all n are admitted at once from the pool."""
    engine = LLMEngine(lm, torch.float16, KVBudget(1 << 34), max_batched_tokens=4096, prefill_chunk=512)
    rng = random.Random(n)
    seqs = [engine.sequence(Prompt([rng.randrange(100, 40000)], []), full_plan(lm.num_layers, "f"),
                            Sampling(steps + 16, ignore_eos=True)) for _ in range(n)]
    for s in seqs:
        engine.add(s)
    while any(s.status is not Status.DECODE for s in seqs) or not engine.inbox.empty():
        engine.step()
        assert not any(s.status is Status.FINISHED for s in seqs), "a sequence ended before all decode"
    for _ in range(3):
        engine.step()
    return engine


def measure(lm, n: int, reps: int) -> dict:
    engine = _engine(lm, n, 2 * reps)
    t0 = time.perf_counter()
    for _ in range(reps):
        engine.step()
    step = (time.perf_counter() - t0) / reps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        engine.step()
    prof.disable()
    gemm = kern = 0.0
    for (path, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        if path == "~" and any(name.endswith(f".{g}>") or name.endswith(f" {g}>") for g in GEMMS):
            gemm += tottime
        elif path == "~" and any(k in name for k in KERNELS):
            kern += tottime
    gemm, kern = gemm / reps, kern / reps
    return dict(seqs=n, step_s=step, tok_s=n / step, gemm_s=gemm, kernels_s=kern,
                outside_s=max(0.0, step - gemm - kern), outside_share=max(0.0, step - gemm - kern) / step)


def table(rows: list[dict]) -> str:
    lines = ["| sequences | step ms | tok/s | weight products ms | kernels ms | outside ms | outside share |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seqs']} | {1e3 * r['step_s']:.1f} | {r['tok_s']:.1f} | {1e3 * r['gemm_s']:.1f} | "
                     f"{1e3 * r['kernels_s']:.1f} | {1e3 * r['outside_s']:.1f} | {100 * r['outside_share']:.0f}% |")
    return "\n".join(lines)
