"""Serving under one KV budget: many jobs at once through the real services, per strategy.

    python -m bench.serve [--strategies full auto adaptive specache snapkv spindlekv] [--ratio 0.2]
                          [--requests 20] [--lengths 3500] [--new-tokens 256]
                          [--budget-jobs 4 | --kv-budget-bytes N] [--rate R] [--scenario throughput|itl]
                          [--out bench/results/serve]

For each KV budget and strategy a fresh planner, cachestore and executor (processes, the
executor's KV budget set) serve N requests (`adaptive`: `auto` under an adaptive budget, the
ratio chosen per job from the load) drawn deterministically from the quality bench's
needle and multi-key cases (query in the prompt), sent at once or as a Poisson process.
`--budget-jobs K` sets the budget to what K full-KV jobs of the longest length reserve.

Reported per strategy: decode tokens/s (generated tokens over the time of the steps in which
sequences decode and none prefills; with the steps beside a prefill chunk too), end-to-end
output tokens/s and requests/s (prefill included), TTFT / TPOT / ITL / end-to-end p50, p90,
p99, peak measured KV bytes against the budget, most sequences decoding at once, answers
correct, and the measured reserve ratio. Ratios against `full` are taken in the same run.

`--scenario itl`: `--requests` jobs decode; one prompt of `--long` tokens arrives once they
all decode; their inter-token gaps while it prefills are reported against one prefill chunk
alone plus one decode step, both measured by the engine in the same run.
`--scenario batching`: `--requests` full-KV jobs one at a time, then all at once, on one
executor: decode tokens/s of each and whether every answer is the same (`bench.scenarios`).
`--scenario burst`: under a budget of `--budget-jobs` K full-KV jobs, quiet (jobs one after
another) -> a burst of 3K jobs at once -> quiet, for `full`, `auto` at `--ratio` and an adaptive
budget (`auto`): ratio chosen, answers and TTFT per phase, decode tokens/s in the burst.

Writes <out>/serve.json (and the budget plot), prints markdown tables."""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench import load
from bench.stack import Stack
from bench.summary import full_job_bytes, jobs_budget, model_shape, summarize  # noqa: F401 (re-exported)

_shape = model_shape      # the peers' export script (../shared/peers/vllm/export_jobs.py) imports these three from here
from kvcore import model as models
from kvcore.config import ModelConfig, from_env
from kvcore.host import host
from planner.strategies import STRATEGIES

OUT = Path(__file__).parent / "results" / "serve"


def serve_once(args, strategy: str, budget: int, items: list[load.Item], tag: str) -> tuple[dict, list[load.Sent]]:
    env = {"KVPLAN_KV_BUDGET_BYTES": str(budget), "KVPLAN_MAX_BATCHED_TOKENS": str(args.max_batched_tokens),
           "KVPLAN_PREFILL_CHUNK": str(args.max_batched_tokens), "KVPLAN_MAX_SEQS": str(args.max_seqs),
           "KVPLAN_DEFAULT_MAX_NEW_TOKENS": str(args.new_tokens)}
    with Stack(env, args.out / "logs" / tag) as stack:
        warm = load.Item(items[0].case, strategy, items[0].ratio, 2, 0.0, items[0].profile)
        load.run(stack.executor_addr, [warm])                     # the first job's one-off costs, not timed
        before = stack.metrics()
        sent = load.run(stack.executor_addr, items)
        time.sleep(1.5)                                           # the last step's metrics
        after = stack.metrics()
    return summarize(sent, before, after, budget), sent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", nargs="+", default=["full", "auto", "specache", "snapkv", "spindlekv"])
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--lengths", type=int, nargs="+", default=[3500])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget-jobs", type=float, nargs="+", default=[4.0])
    ap.add_argument("--kv-budget-bytes", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0: all at once")
    ap.add_argument("--scenario", choices=("throughput", "itl", "batching", "burst"), default="throughput")
    ap.add_argument("--long", type=int, default=4000, help="itl scenario: the arriving prompt's tokens")
    ap.add_argument("--max-batched-tokens", type=int, default=512,
                    help="KVPLAN_MAX_BATCHED_TOKENS and KVPLAN_PREFILL_CHUNK of the executor")
    ap.add_argument("--profiles", action="store_true",
                    help="each case family and length is a profile: the planner probes a sample of its jobs "
                         "(KVPLAN_PROFILE_SAMPLE) and the others reuse its plan")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="a job ends at the model's end token (default: every job generates --new-tokens, "
                         "as vllm bench serve --ignore-eos; answers are checked in the text all the same)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--json", default="serve.json", help="the results file's name in --out")
    args = ap.parse_args(argv)
    unknown = [s for s in args.strategies if s not in STRATEGIES and s != "adaptive"]
    if unknown:
        ap.error(f"unknown strategies {unknown}; known: {sorted(STRATEGIES)}")
    if args.requests < 1 or args.new_tokens < 1 or not args.lengths:
        ap.error("--requests and --new-tokens must be >= 1")

    mcfg = from_env(ModelConfig)
    tok = AutoTokenizer.from_pretrained(models.prepare(mcfg))
    shape = model_shape(mcfg, args.max_batched_tokens)
    cases = load.cases(tok, args.requests, args.lengths)
    if args.scenario != "throughput":
        from bench import scenarios
        return scenarios.SCENARIOS[args.scenario](args, tok, cases)
    budgets = [args.kv_budget_bytes] if args.kv_budget_bytes else [jobs_budget(shape, args, k) for k in args.budget_jobs]
    arrive = load.arrivals(args.requests, args.rate)
    runs = []
    for budget in budgets:
        for strategy in args.strategies:
            adaptive = strategy == "adaptive"                 # `auto` under an adaptive budget: the load decides
            ratio = None if strategy == "full" or adaptive else args.ratio
            items = [load.Item(c, "auto" if adaptive else strategy, ratio, args.new_tokens, t,
                               f"{c.family}-{c.length}" if args.profiles else "", not args.stop_at_eos, adaptive)
                     for c, t in zip(cases, arrive)]
            print(f"[serve] {strategy} at {ratio or 1.0} under {budget / 2**20:.0f} MiB ...", flush=True)
            summary, sent = serve_once(args, strategy, budget, items, f"{strategy}-{budget}")
            runs.append(dict(strategy=strategy, ratio=ratio or (summary["measured_ratio"] if adaptive else 1.0), **summary,
                             cases=[dict(id=s.item.case.id, correct=s.correct, ttft_s=s.ttft_s, tpot_s=s.tpot_s,
                                         tokens=len(s.t_tokens), reserve_ratio=s.result.reserve_ratio if s.result else None,
                                         kv_risk=s.result.kv_risk if s.result else None,
                                         kv_at_risk=s.result.kv_at_risk if s.result else None, error=s.error) for s in sent]))
            print(_row(runs[-1], runs), flush=True)
    out = dict(bench="serve", machine=platform.machine(), host=host().as_dict(), torch=torch.__version__,
               threads=torch.get_num_threads(),
               requests=args.requests, lengths=args.lengths, new_tokens=args.new_tokens, rate=args.rate,
               max_batched_tokens=args.max_batched_tokens, profiles=args.profiles, stop_at_eos=args.stop_at_eos, runs=runs,
               when=time.strftime("%Y-%m-%d %H:%M"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / args.json).write_text(json.dumps(out, indent=1))
    print(f"\nHost: {host().describe()}\n\n" + _table(runs))
    if len(budgets) > 1:
        from bench.plots import throughput_by_budget
        print(f"plot: {throughput_by_budget(runs, args.out / 'throughput_by_budget.png')}")


HEADER = ("| strategy | ratio | budget MiB | decode tok/s | × full | +mixed tok/s | × full | out tok/s | req/s | "
          "TTFT p50/p99 s | TPOT p50/p99 s | ITL p99 s | e2e p99 s | peak KV / budget | most decoding | done | correct | at risk (wrong) | measured |")


def _row(r: dict, runs: list[dict]) -> str:
    base = next((x for x in runs if x["strategy"] == "full" and x["kv_budget_bytes"] == r["kv_budget_bytes"]), None)
    x = lambda k: f"{r[k] / base[k]:.2f}×" if base else "—"                    # noqa: E731
    return (f"| {r['strategy']} | {r['ratio']:g} | {r['kv_budget_bytes'] / 2**20:.0f} | {r['decode_tps']:.1f} | "
            f"{x('decode_tps')} | {r['decode_mixed_tps']:.1f} | {x('decode_mixed_tps')} | {r['output_tps']:.2f} | "
            f"{r['requests_ps']:.3f} | {r['ttft'][0]:.1f}/{r['ttft'][2]:.1f} | {r['tpot'][0]:.2f}/{r['tpot'][2]:.2f} | "
            f"{r['itl'][2]:.2f} | {r['e2e'][2]:.0f} | {r['peak_kv_bytes'] / r['kv_budget_bytes']:.3f} | "
            f"{r['most_decoding']:.0f} | {r['done']}/{r['requests']} | {r['correct']}/{r['requests']} | "
            f"{r['at_risk']} ({r['wrong_at_risk']}/{r['done'] - r['correct']}) | {r['measured_ratio']:.3f} |")


def _table(runs: list[dict]) -> str:
    sep = "|" + "|".join(["---"] * (HEADER.count("|") - 1)) + "|"
    return "\n".join([HEADER, sep] + [_row(r, runs) for r in runs])


if __name__ == "__main__":
    main()
