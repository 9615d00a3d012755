"""Serving scenarios beside `bench.serve`'s throughput run (same stack, load and metrics).

    itl        jobs decode; one long prompt arrives; their gaps while it prefills against one
               prefill chunk alone plus one decode step, both timed by the engine in the run
    batching   the same full-KV jobs one at a time, then all at once: decode tokens/s of each,
               and whether every answer is the same"""
from __future__ import annotations

import json
import threading
import time

from bench import load
from bench.serve import pct, summarize
from bench.stack import Stack, metric


def _env(args, budget: int) -> dict[str, str]:
    return {"KVPLAN_KV_BUDGET_BYTES": str(budget), "KVPLAN_MAX_BATCHED_TOKENS": str(args.max_batched_tokens),
            "KVPLAN_PREFILL_CHUNK": str(args.max_batched_tokens), "KVPLAN_MAX_SEQS": str(args.max_seqs)}


def itl(args, tok, cases) -> None:
    """Jobs decoding, then one long prompt: their gaps while it prefills vs a chunk + a step."""
    budget = args.kv_budget_bytes or 1 << 40
    long_case = load.cases(tok, 1, [args.long])[0]
    items = [load.Item(c, "full", None, args.new_tokens, 0.0) for c in cases]
    with Stack(_env(args, budget), args.out / "logs" / "itl") as stack:
        load.run(stack.executor_addr, [load.Item(cases[0], "full", None, 2, 0.0)])
        before = stack.metrics()
        box: dict = {}
        bg = threading.Thread(target=lambda: box.setdefault("bg", load.run(stack.executor_addr, items)))
        bg.start()
        while metric(stack.metrics(), "kvplan_executor_running_sequences") < len(items) or \
                metric(stack.metrics(), "kvplan_executor_steps_total", kind="decode") - \
                metric(before, "kvplan_executor_steps_total", kind="decode") < 2:
            time.sleep(0.2)
        t_long = time.perf_counter()
        long = load.run(stack.executor_addr, [load.Item(long_case, "full", None, 4, 0.0)])[0]
        bg.join()
        after = stack.metrics()
        load.run(stack.executor_addr, [load.Item(long_case, "full", None, 1, 0.0)])     # alone: its chunks' time
        time.sleep(1.5)
        alone = stack.metrics()
    window = (t_long, long.t_tokens[0] if long.t_tokens else long.t_done)
    gaps = [b - a for s in box["bg"] for a, b in zip(s.t_tokens, s.t_tokens[1:]) if window[0] <= b <= window[1]]
    s = summarize(box["bg"], before, after, budget)
    chunk = metric(alone, "kvplan_executor_step_seconds_max", kind="prefill")      # its longest chunk, alone
    bound = chunk + s["decode_step_s"]
    res = dict(scenario="itl", jobs=len(items), long_tokens=long.result.prompt_tokens if long.result else None,
               gaps=len(gaps), itl_p50=pct(gaps, 50), itl_p99=pct(gaps, 99), itl_max=max(gaps, default=float("nan")),
               chunk_step_s=chunk, decode_step_s=s["decode_step_s"], bound_s=bound,
               max_batched_tokens=args.max_batched_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "itl.json").write_text(json.dumps(res, indent=1))
    print("| jobs decoding | arriving prompt | gaps while it prefills | ITL p50 s | ITL p99 s | max s | "
          "its longest chunk alone s | one decode step s | bound s | p99 within |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    print(f"| {res['jobs']} | {res['long_tokens']} | {res['gaps']} | {res['itl_p50']:.2f} | {res['itl_p99']:.2f} | "
          f"{res['itl_max']:.2f} | {res['chunk_step_s']:.2f} | {res['decode_step_s']:.2f} | {bound:.2f} | "
          f"{'yes' if res['itl_p99'] <= bound else 'NO'} |")




def batching(args, tok, cases) -> None:
    """Full-KV jobs alone, then together: decode tokens/s (steps with no prefill) and answers."""
    items = [load.Item(c, "full", None, args.new_tokens, 0.0) for c in cases]
    with Stack(_env(args, args.kv_budget_bytes or 1 << 40), args.out / "logs" / "batching") as stack:
        load.run(stack.executor_addr, [load.Item(cases[0], "full", None, 2, 0.0)])
        m0 = stack.metrics()
        alone = [load.run(stack.executor_addr, [it])[0] for it in items]
        time.sleep(1.5)
        m1 = stack.metrics()
        together = load.run(stack.executor_addr, items)
        time.sleep(1.5)
        m2 = stack.metrics()
    a, b = summarize(alone, m0, m1, 1), summarize(together, m1, m2, 1)
    same = [x.result is not None and y.result is not None and x.result.text == y.result.text
            for x, y in zip(alone, together)]
    res = dict(scenario="batching", jobs=len(items), prompt_tokens=[s.result.prompt_tokens for s in alone if s.result],
               new_tokens=args.new_tokens, alone_decode_tps=a["decode_tps"], together_decode_tps=b["decode_tps"],
               speedup=b["decode_tps"] / a["decode_tps"], alone_output_tps=a["output_tps"],
               together_output_tps=b["output_tps"], same_answers=sum(same), most_decoding=b["most_decoding"],
               correct_alone=a["correct"], correct_together=b["correct"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batching.json").write_text(json.dumps(res, indent=1))
    print("| jobs | prompt tokens | decode tok/s alone | together | × | out tok/s alone | together | "
          "same answers | correct alone / together |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {res['jobs']} | {min(res['prompt_tokens'])}-{max(res['prompt_tokens'])} | {res['alone_decode_tps']:.1f} | "
          f"{res['together_decode_tps']:.1f} | {res['speedup']:.2f}× | {res['alone_output_tps']:.2f} | "
          f"{res['together_output_tps']:.2f} | {res['same_answers']}/{res['jobs']} | "
          f"{res['correct_alone']} / {res['correct_together']} |")


SCENARIOS = {"itl": itl, "batching": batching}
