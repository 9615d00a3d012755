"""Cluster overhead: the same greedy job run directly on the model runner and through the
services (planner + executor over gRPC, job queue, event stream), side by side in one run.

    python -m bench.cluster [--lengths 256 1024] [--new-tokens 32] [--repeats 2]

Writes bench/results/cluster.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvcore import model as models
from kvplan.client import ExecutorClient, request
from kvcore.config import ModelConfig, from_env
from kvplan.embedded import Embedded
from kvcore.plan import full_plan

RESULTS = Path(__file__).parent / "results" / "cluster.json"
FILLER = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. "


def _text(lm, tokens: int) -> str:
    ids = lm.tokenizer(FILLER * (tokens // 15 + 2), add_special_tokens=False)["input_ids"][:tokens]
    return lm.tokenizer.decode(ids)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    mcfg = from_env(ModelConfig)
    lm = models.load(mcfg)
    runner = Runner(lm, torch.float16)
    rows = []
    with Embedded(mcfg) as cluster, ExecutorClient(cluster.executor_addr, timeout_s=600) as client:
        for n in args.lengths:
            text = _text(lm, n)
            for rep in range(args.repeats):
                req = request(text, max_new_tokens=args.new_tokens, strategy="full")
                t0 = time.perf_counter()
                served = client.run(req).result
                served_s = time.perf_counter() - t0
                ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]
                t0 = time.perf_counter()
                direct = runner.run(Prompt(list(ids), []), full_plan(lm.num_layers, "bench"), Sampling(args.new_tokens))
                direct_s = time.perf_counter() - t0
                rows.append(dict(same_text=direct.text == served.text, prompt_tokens=served.prompt_tokens, repeat=rep, generated=served.generated_tokens,
                                 direct_s=direct_s, served_s=served_s, overhead=served_s / direct_s - 1,
                                 served_decode_tps=served.decode_tokens_per_s,
                                 direct_decode_tps=direct.decode_steps / direct.decode_s if direct.decode_s else 0.0))
    out = dict(bench="cluster", machine=platform.machine(), torch=torch.__version__, threads=torch.get_num_threads(),
               new_tokens=args.new_tokens, rows=rows,
               median_overhead=sorted(r["overhead"] for r in rows)[len(rows) // 2])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print("| prompt tokens | generated | direct s | served s | overhead | decode tok/s direct | served | same text |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['generated']} | {r['direct_s']:.2f} | {r['served_s']:.2f} | "
              f"{100 * r['overhead']:+.1f}% | {r['direct_decode_tps']:.1f} | {r['served_decode_tps']:.1f} | "
              f"{'yes' if r['same_text'] else 'NO'} |")
    print(f"\nmedian cluster overhead: {100 * out['median_overhead']:+.1f}%  ({RESULTS})")


if __name__ == "__main__":
    main()
