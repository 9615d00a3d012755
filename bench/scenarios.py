"""Serving scenarios beside `bench.serve`'s throughput run (same stack, load and metrics).

    itl        jobs decode; one long prompt arrives; their gaps while it prefills against one
               prefill chunk alone plus one decode step, both timed by the engine in the run
    batching   the same full-KV jobs one at a time, then all at once: decode tokens/s of each,
               and whether every answer is the same
    burst      quiet -> a burst of three times the jobs full KV holds -> quiet, under one budget:
               full, fixed auto and an adaptive budget, per phase"""
from __future__ import annotations

import json
import threading
import time

from bench import load
from bench.summary import jobs_budget, model_shape, pct, summarize
from bench.stack import Stack, metric


def _env(args, budget: int) -> dict[str, str]:
    return {"KVPLAN_KV_BUDGET_BYTES": str(budget), "KVPLAN_MAX_BATCHED_TOKENS": str(args.max_batched_tokens),
            "KVPLAN_PREFILL_CHUNK": str(args.max_batched_tokens), "KVPLAN_MAX_SEQS": str(args.max_seqs)}


def itl(args, tok, cases) -> None:
    """Jobs decoding, then one long prompt: their gaps while it prefills vs a chunk + a step."""
    budget = args.kv_budget_bytes or 1 << 40
    long_case = load.cases(tok, 1, [args.long])[0]
    items = [load.Item(c, "full", None, args.new_tokens, 0.0, ignore_eos=not args.stop_at_eos) for c in cases]
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
    items = [load.Item(c, "full", None, args.new_tokens, 0.0, ignore_eos=not args.stop_at_eos) for c in cases]
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


QUIET = 2          # jobs per quiet phase, each sent when the one before it ended


def burst(args, tok, cases) -> None:
    """Quiet -> burst (3K jobs at once, K = --budget-jobs) -> quiet, per budget kind: the ratio each
    job got, answers, TTFT per phase, decode tokens/s of the burst's steps."""
    from kvcore.config import ModelConfig, from_env
    k = args.budget_jobs[0]
    length = max(args.lengths)
    budget = args.kv_budget_bytes or jobs_budget(model_shape(from_env(ModelConfig), args.max_batched_tokens), args, k)
    n_burst = int(round(3 * k))
    pool = load.cases(tok, 2 * QUIET + n_burst, args.lengths)
    kinds = {"full": dict(strategy="full", ratio=None), f"auto@{args.ratio:g}": dict(strategy="auto", ratio=args.ratio),
             "adaptive": dict(strategy="auto", ratio=None, adaptive=True)}
    runs = []
    for name, kind in kinds.items():
        def item(c):
            return load.Item(c, new_tokens=args.new_tokens, at_s=0.0, ignore_eos=not args.stop_at_eos, **kind)
        print(f"[burst] {name} under {budget / 2**20:.0f} MiB ...", flush=True)
        env = {**_env(args, budget), "KVPLAN_DEFAULT_MAX_NEW_TOKENS": str(args.new_tokens)}
        with Stack(env, args.out / "logs" / f"burst-{name}") as stack:
            load.run(stack.executor_addr, [load.Item(pool[0], "full", None, 2, 0.0)])     # one-off costs, untimed
            phases, marks = {}, [stack.metrics()]
            for phase, sel in (("quiet", pool[:QUIET]), ("burst", pool[QUIET:QUIET + n_burst]),
                               ("quiet after", pool[QUIET + n_burst:])):
                sent = load.run(stack.executor_addr, [item(c) for c in sel]) if phase == "burst" else \
                    [load.run(stack.executor_addr, [item(c)])[0] for c in sel]
                time.sleep(1.5)
                marks.append(stack.metrics())
                phases[phase] = _phase(sent, marks[-2], marks[-1], budget)
        runs.append(dict(kind=name, **kind, phases=phases))
    as_full(runs)
    res = dict(scenario="burst", budget_bytes=budget, budget_jobs=k, length=length, new_tokens=args.new_tokens,
               burst_jobs=n_burst, quiet_jobs=QUIET, runs=runs, when=time.strftime("%Y-%m-%d %H:%M"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "burst.json").write_text(json.dumps(res, indent=1))
    print("| budget | phase | jobs | ratio chosen (min-max) | why | measured ratio | correct | as full | "
          "TTFT p50/p99 s | decode tok/s | most decoding (so far) | peak KV / budget (so far) |")
    print("|---|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|")
    for r in runs:
        for phase, ph in r["phases"].items():
            print(f"| {r['kind']} | {phase} | {ph['requests']} | {ph['ratio_min']:g}-{ph['ratio_max']:g} | "
                  f"{ph['reasons']} | {ph['measured_ratio']:.3f} | {ph['correct']}/{ph['requests']} | "
                  f"{ph['as_full']}/{ph['requests']} | {ph['ttft'][0]:.1f}/{ph['ttft'][2]:.1f} | "
                  f"{ph['decode_tps']:.1f} | {ph['most_decoding']:.0f} | {ph['peak_kv_bytes'] / budget:.3f} |")


def as_full(runs: list[dict]) -> None:
    """Each phase's `as_full`: its jobs whose text is full's for the same request (the same place
    in the same phase: a case may come more than once in a run)."""
    full = next((r for r in runs if r["kind"] == "full"), None)
    for r in runs:
        for name, ph in r["phases"].items():
            ref = full["phases"][name]["jobs"] if full else []
            ph["as_full"] = sum(a["text"] == b["text"] for a, b in zip(ph["jobs"], ref))


def _phase(sent, before, after, budget) -> dict:
    s = summarize(sent, before, after, budget)
    ok = [x.result for x in sent if x.result is not None]
    chosen = [x.result.budget_ratio if x.result.budget_reason else x.item.ratio or 1.0 for x in sent if x.result] \
        or [float("nan")]
    reasons = sorted({r.budget_reason for r in ok if r.budget_reason})
    return dict(requests=s["requests"], done=s["done"], correct=s["correct"], ttft=s["ttft"],
                decode_tps=s["decode_tps"], most_decoding=s["most_decoding"], peak_kv_bytes=s["peak_kv_bytes"],
                measured_ratio=s["measured_ratio"], ratio_min=min(chosen), ratio_max=max(chosen),
                reasons=",".join(reasons) or "-", errors=s["errors"], ids=[x.item.case.id for x in sent],
                jobs=[dict(id=x.item.case.id, text=x.result.text if x.result else "", correct=x.correct,
                           ratio=x.result.budget_ratio if x.result else None,
                           reason=x.result.budget_reason if x.result else None,
                           measured=x.result.reserve_ratio if x.result else None, ttft_s=x.ttft_s) for x in sent])


SCENARIOS = {"itl": itl, "batching": batching, "burst": burst}
