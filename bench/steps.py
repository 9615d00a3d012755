"""A decode step's cost against how many sequences it holds: the engine stepping N sequences of a
1-token context (so the KV read is nothing and what is left is the weights and the engine's own
work), and where a step's time goes — the weight products (oneDNN / BLAS calls), the kernels
(paged attention, the decoder's fused ops, the pool writes), and everything else (Python, small
torch ops): what the engine itself spends per step.

    python -m bench.speed --steps [--seqs 4 16] [--reps 30]

The step time is measured without a profiler; the products' and kernels' times with Python's
profiler in a second pass (their C calls' own time, which the profiler does not inflate); the
share outside them is 1 - (products + kernels) / step. With the layers in one C++ call
(`kernels.decode_layers`, KVPLAN_DECODE_LAYERS) their products are inside that kernel's time and
the products column is the LM head's. Reported beside each other in one run,
with the step's floor: the bytes a step must read (every weight once: the decoder's and the LM
head's; the KV of a 1-token context is nothing) over the host's read bandwidth, measured in the
same run (`bandwidth`: torch summing a 512 MiB tensor on the step's threads)."""
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


def weight_bytes(lm) -> int:
    """Bytes of every weight a decode step reads once: the decoder's parameters and buffers (packed
    linears hold theirs as buffers or plain tensors) and the LM head, the embeddings only for the
    step's rows (not counted)."""
    model, seen, total = lm.model, set(), 0
    embed = model.get_input_embeddings().weight
    for mod in model.model.layers.modules():
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)) + \
                [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total + embed.numel() * embed.element_size()           # the LM head (tied or not: its size)


def bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes per second this host reads: torch summing a `mib` MiB tensor (the best of `reps`)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def measure(lm, n: int, reps: int, floor_s: float | None = None) -> dict:
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
                outside_s=max(0.0, step - gemm - kern), outside_share=max(0.0, step - gemm - kern) / step,
                floor_s=floor_s, over_floor=step / floor_s if floor_s else None)


def table(rows: list[dict]) -> str:
    lines = ["| sequences | step ms | floor ms | step / floor | tok/s | weight products ms | kernels ms | outside ms | "
             "outside share |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        floor = f"{1e3 * r['floor_s']:.1f} | {r['over_floor']:.2f}x" if r.get("floor_s") else "- | -"
        lines.append(f"| {r['seqs']} | {1e3 * r['step_s']:.1f} | {floor} | {r['tok_s']:.1f} | {1e3 * r['gemm_s']:.1f} | "
                     f"{1e3 * r['kernels_s']:.1f} | {1e3 * r['outside_s']:.1f} | {100 * r['outside_share']:.0f}% |")
    return "\n".join(lines)
