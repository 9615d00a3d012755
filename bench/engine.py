"""The engine alone, in process: the serving bench's load without the services (no gRPC, no
Redis, no planner process) — N jobs of L prompt tokens, M new tokens each (generated whatever the
model says, as `vllm bench serve --ignore-eos`), all at once, under a KV budget of K full-KV
jobs, per strategy. Plans come as the executor gets them: `full` and the presets planned from
the job alone, `auto` from the statistics its own prefill gathers (`kvcore.statistics`).

    python -m bench.engine [--strategies full snapkv auto] [--ratio 0.2] [--requests 20]
                           [--lengths 3500] [--new-tokens 256] [--budget-jobs 4]
                           [--max-batched-tokens 4096] [--synthetic] [--out bench/results/engine]

Reported per strategy, ratios against `full` of the same run: decode tokens/s (tokens of the
steps that only decode over their seconds, as `bench.serve`), end-to-end output tokens/s, TTFT
p50/p99, the decode step's mean seconds, most sequences decoding at once, the pool's peak bytes
against the budget (`KVPool.peak_bytes`: pages in use), the reserve ratio measured, and the
answers right (the quality bench's cases; with `--synthetic`, random token ids and no answers:
a speed run, e.g. on a device with random weights of the same shape). Runs on whatever device
KVPLAN_DEVICE names. Writes <out>/engine.json and prints a markdown table."""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from executor.engine import KVBudget, LLMEngine, Sampling
from executor.prompt import Prompt
from kvcore import plan_cost
from kvcore.statistics import LayerStatistics
from kvcore import model as models
from kvcore.config import ModelConfig, from_env
from kvcore.plan import full_plan
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES

OUT = Path(__file__).parent / "results" / "engine"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def jobs(lm, args) -> list[tuple[Prompt, str]]:
    """(prompt, expected answer or "") per request: the serving bench's cases, or random ids."""
    if args.synthetic:
        rng = random.Random(0)
        return [(Prompt([rng.randrange(100, lm.tokenizer.vocab_size - 100) for _ in range(args.lengths[i % len(args.lengths)])],
                        []), "") for i in range(args.requests)]
    from bench import load
    from executor.prompt import build
    return [(build(lm.tokenizer, [{"role": "user", "content": c.context + "\n\n" + c.question}]), c.answer)
            for c in load.cases(lm.tokenizer, args.requests, args.lengths)]      # as `bench.load.run` sends them


def run_strategy(lm, args, strategy: str, budget: int, prompts: list[tuple[Prompt, str]]) -> dict:
    engine = LLMEngine(lm, torch.float16, KVBudget(budget), max_batched_tokens=args.max_batched_tokens,
                       max_seqs=args.max_seqs, prefill_chunk=args.max_batched_tokens)
    shape = ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim)
    strat = STRATEGIES[strategy]
    sampling = Sampling(args.new_tokens, ignore_eos=True)
    seqs = []
    for i, (prompt, _) in enumerate(prompts):
        inp = lambda probe=None, p=prompt: PlanInput(f"j{i}", strategy, p.num_tokens, shape,      # noqa: E731
                                                     reserve_ratio=None if strategy == "full" else args.ratio,
                                                     new_tokens=args.new_tokens, probe=probe)
        if strat.probe_mode:                                   # planned from its own prefill's statistics
            box = {}

            def on_context(kind, x, box=box, inp=inp):
                if kind == "context":
                    engine.apply_plan(box["seq"], strat.plan(inp(lambda **kw: x), "p"))
            box["seq"] = seq = engine.sequence(prompt, None, sampling, emit=on_context,
                                               statistics=LayerStatistics(strat.probe_mode, strat.probe_losses))
        else:
            plan = full_plan(lm.num_layers, "f") if strategy == "full" else strat.plan(inp(), "p")
            seq = engine.sequence(prompt, plan, sampling)
        seqs.append(seq)
    warm = engine.sequence(prompts[0][0], full_plan(lm.num_layers, "w"), Sampling(2, ignore_eos=True))
    engine.add(warm)
    engine.run_all()                                           # one-off costs (kernel builds, first allocations)
    engine.stats = type(engine.stats)()
    engine.runner.pool.peak_pages = engine.runner.pool.used_pages
    t0 = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    engine.run_all()
    makespan = time.perf_counter() - t0
    st = engine.stats
    generated = sum(len(s.generated) for s in seqs)
    ratios = [sum(x.kv_bytes for x in s.cache.layer_bytes()) / max(1, sum(x.full_kv_bytes for x in s.cache.layer_bytes()))
              for s in seqs]
    from bench.cases import is_correct
    return dict(strategy=strategy, ratio=1.0 if strategy == "full" else args.ratio, kv_budget_bytes=budget,
                decode_tps=st.tokens["decode"] / st.seconds["decode"] if st.seconds["decode"] else float("nan"),
                output_tps=generated / makespan, makespan_s=makespan, generated=generated,
                decode_step_s=st.seconds["decode"] / max(1, st.steps["decode"]),
                prefill_s=st.seconds["prefill"] + st.seconds["mixed"],
                ttft=[pct([s.t_tokens[0] - t0 for s in seqs if s.t_tokens], q) for q in (50, 99)],
                most_decoding=st.most_running, peak_pool_bytes=engine.runner.pool.peak_bytes,
                measured_ratio=sum(ratios) / len(ratios),
                correct=sum(bool(a) and is_correct(a, s.final_text) for s, (_, a) in zip(seqs, prompts)),
                answered=sum(bool(a) for _, a in prompts), requests=len(seqs))


HEADER = ("| strategy | ratio | decode tok/s | × full | out tok/s | × full | decode step s | TTFT p50/p99 s | "
          "most decoding | peak pool / budget | measured | correct |")


def row(r: dict, runs: list[dict]) -> str:
    base = next((x for x in runs if x["strategy"] == "full"), None)
    x = lambda k: f"{r[k] / base[k]:.2f}×" if base else "—"                    # noqa: E731
    right = f"{r['correct']}/{r['answered']}" if r["answered"] else "—"
    return (f"| {r['strategy']} | {r['ratio']:g} | {r['decode_tps']:.1f} | {x('decode_tps')} | {r['output_tps']:.2f} | "
            f"{x('output_tps')} | {r['decode_step_s']:.3f} | {r['ttft'][0]:.1f}/{r['ttft'][1]:.1f} | "
            f"{r['most_decoding']} | {r['peak_pool_bytes'] / r['kv_budget_bytes']:.3f} | {r['measured_ratio']:.3f} | "
            f"{right} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", nargs="+", default=["full", "snapkv", "auto"])
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--lengths", type=int, nargs="+", default=[3500])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget-jobs", type=float, default=4.0)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--synthetic", action="store_true", help="random prompt ids (no answers): a speed run")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; known: {sorted(STRATEGIES)}")
    lm = models.load(from_env(ModelConfig))
    full_job = plan_cost.plan_bytes(full_plan(lm.num_layers, "sizing"), lm.num_kv_heads, lm.num_query_heads, lm.head_dim,
                                    max(args.lengths) + 64, 0, args.new_tokens, 2, args.max_batched_tokens)
    budget = int(args.budget_jobs * full_job)            # K full-KV jobs, as `bench.serve.jobs_budget`
    prompts = jobs(lm, args)
    runs = []
    for strategy in args.strategies:
        print(f"[engine] {strategy} under {budget / 2**20:.0f} MiB on {lm.device} ...", flush=True)
        runs.append(run_strategy(lm, args, strategy, budget, prompts))
        print(row(runs[-1], runs), flush=True)
    dev = torch.cuda.get_device_name() if lm.device.type == "cuda" else platform.processor() or platform.machine()
    out = dict(bench="engine", device=dev, torch=torch.__version__, dtype=str(lm.model.dtype),
               requests=args.requests, lengths=args.lengths, new_tokens=args.new_tokens, synthetic=args.synthetic,
               max_batched_tokens=args.max_batched_tokens, runs=runs, when=time.strftime("%Y-%m-%d %H:%M"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine.json").write_text(json.dumps(out, indent=1))
    print("\n" + "\n".join([HEADER, "|" + "---|" * (HEADER.count("|") - 1)] + [row(r, runs) for r in runs]))


if __name__ == "__main__":
    main()
