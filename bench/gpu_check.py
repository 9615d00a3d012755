"""The engine's correctness on a CUDA device, where the test suite cannot go: jobs of full, snapkv,
auto, specache and spindlekv, each planned for its own prompt by the planner's strategies, give the
same greedy tokens batched together as each alone, with CUDA graphs and without; and the decode
step's graph gives eager's tokens.

    python -m bench.gpu_check [--length 600] [--new-tokens 12] [--out OUT]

Exits non-zero on a mismatch, printing which job and where; writes JSON."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch

from executor.engine import KVBudget, LLMEngine, Sampling
from executor.prompt import Prompt
from executor.runner import Runner
from kvcore import model as models
from kvcore.config import ModelConfig, from_env
from planner.probe import Prober
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES

STRATEGY_NAMES = ("full", "snapkv", "auto", "specache", "spindlekv")


def jobs(lm, length: int, new: int) -> list[tuple[str, Prompt, object]]:
    shape = ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim)
    prober = Prober(lm=lm)
    out = []
    for i, name in enumerate(STRATEGY_NAMES):
        rng = random.Random(i)
        ids = [rng.randrange(100, 40000) for _ in range(length + 7 * i)]
        inp = PlanInput("t", name, len(ids), shape, reserve_ratio=0.5, new_tokens=new,
                        probe=lambda ids=ids, **kw: prober.probe(ids, **kw))
        out.append((name, Prompt(ids, []), STRATEGIES[name].plan(inp, f"t-{name}")))
    return out


def batched(lm, work, new: int) -> dict[str, list[int]]:
    engine = LLMEngine(lm, torch.float16, KVBudget(1 << 34), prefetch_wait_s=30.0)
    seqs = {name: engine.sequence(p, plan, Sampling(new, ignore_eos=True), ratio=0.5) for name, p, plan in work}
    for s in seqs.values():
        engine.add(s)
    engine.run_all()
    return {name: s.generated for name, s in seqs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--out", default="gpu-out/check")
    args = ap.parse_args(argv)
    lm = models.load(from_env(ModelConfig))
    work = jobs(lm, args.length, args.new_tokens)
    runner = Runner(lm, torch.float16, prefetch_wait_s=30.0)
    alone = {name: runner.run(p, plan, Sampling(args.new_tokens, ignore_eos=True), budget=0.5).token_ids
             for name, p, plan in work}
    rows, ok = [], True
    for graphs in (True, False):
        got = batched(dataclasses.replace(lm, cuda_graphs=graphs), work, args.new_tokens)
        for name in STRATEGY_NAMES:
            same = got[name] == alone[name]
            first = next((i for i, (a, b) in enumerate(zip(got[name], alone[name])) if a != b), None)
            rows.append(dict(strategy=name, graphs=graphs, same=same, first_difference=first))
            ok &= same
            print(f"[gpu_check] {name:10s} graphs={graphs!s:5s} batched == alone: {same}"
                  + ("" if same else f" (first difference at token {first})"), flush=True)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_check.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name() if lm.device.type == "cuda"
                                                         else "cpu", rows=rows, ok=ok), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
