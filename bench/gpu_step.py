"""A decode step on a CUDA device beside its memory floor: N sequences of a `--length`-token context
decoding together under a full plan, the mean step time with CUDA graphs and without (eager), and
the floor: the bytes a step must read (every sequence's fp16 KV and the weights once) over the
device's copy bandwidth, measured in the same run by a device-to-device copy.

    python -m bench.gpu_step [--seqs 4 16] [--length 3500] [--steps 30] [--out OUT]

Random token ids; any model folder (KVPLAN_MODEL): with random weights of SmolLM2's shape the bytes
and the kernels are the real model's. Writes JSON and prints a markdown table."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from executor.engine import KVBudget, LLMEngine, Sampling, Status
from executor.prompt import Prompt
from kvcore import model as models
from kvcore.config import ModelConfig, from_env
from kvcore.plan import full_plan


def copy_bandwidth(device) -> float:
    """Bytes a second a device-to-device copy moves, counting bytes read and written."""
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def measure(lm, n: int, length: int, steps: int, graphs: bool) -> dict:
    lm = dataclasses.replace(lm, cuda_graphs=graphs)
    engine = LLMEngine(lm, torch.float16, KVBudget(1 << 36), max_batched_tokens=8192, prefill_chunk=2048, max_seqs=n)
    rng = random.Random(n)
    seqs = [engine.sequence(Prompt([rng.randrange(100, 40000) for _ in range(length)], []),
                            full_plan(lm.num_layers, "f"), Sampling(2 * steps + 8, ignore_eos=True)) for _ in range(n)]
    for s in seqs:
        engine.add(s)
    while any(s.status is not Status.DECODE for s in seqs) or not engine.inbox.empty():
        engine.step()
    for _ in range(3):                                   # capture and warm up
        engine.step()
    torch.cuda.synchronize(lm.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize(lm.device)
    step = (time.perf_counter() - t0) / steps
    kv = sum(s.kv_bytes() for s in seqs)
    return dict(seqs=n, length=length, graphs=graphs, step_s=step, tok_s=n / step, kv_bytes=kv)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--length", type=int, default=3500)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="gpu-out/step")
    args = ap.parse_args(argv)
    lm = models.load(from_env(ModelConfig))
    if lm.device.type != "cuda":
        raise SystemExit("bench.gpu_step needs KVPLAN_DEVICE=cuda")
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    bw = copy_bandwidth(lm.device)
    rows = []
    for n in args.seqs:
        for graphs in (True, False):
            r = measure(lm, n, args.length, args.steps, graphs)
            r["floor_s"] = (r["kv_bytes"] + weights) / bw
            rows.append(r)
            print(f"[gpu_step] {n} seqs, graphs {graphs}: {1e3 * r['step_s']:.2f} ms (floor {1e3 * r['floor_s']:.3f} ms)",
                  flush=True)
    out = dict(bench="gpu_step", device=torch.cuda.get_device_name(), dtype=str(lm.model.dtype), weights_bytes=weights,
               copy_bytes_per_s=bw, rows=rows)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_step.json").write_text(json.dumps(out, indent=1))
    print("| sequences | context | graphs | step ms | floor ms | step / floor | tok/s |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seqs']} | {r['length']} | {'yes' if r['graphs'] else 'no'} | {1e3 * r['step_s']:.2f} | "
              f"{1e3 * r['floor_s']:.3f} | {r['step_s'] / r['floor_s']:.1f} | {r['tok_s']:.0f} |")


if __name__ == "__main__":
    main()
