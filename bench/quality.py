"""Quality under compression, real model: NIAH and multi-key retrieval accuracy (query-aware and
query-agnostic) and fidelity to the full-KV run (greedy top-1 agreement, logit KL), per
strategy × requested reserve ratio, with the measured ratio (kv_bytes / full_kv_bytes) beside it.

    python -m bench.quality [--quick] [--strategies full snapkv ...] [--ratios 0.5 0.3]
                            [--families niah multikey] [--modes query_aware] [--lengths 1000 2000]
    python -m bench.quality --tune-needles 2 3 4 6      # multi-key needle count, `full` only

Writes quality.json and NIAH heatmaps under bench/results/ (--quick: bench/results/quick/) and
prints a markdown table. Full-KV runs are shared by every ratio (one per case and mode), and every
prompt's leading chunks are prefilled once for all its runs (`Runner.prefix_of`; exact — tested).
Reported prefill_s is therefore the remaining prefill only; bench/speed.py measures speed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from bench import cases as C
from bench import risk
from bench.harness import MODES, Harness, agreement, check_strategies, measured_ratio
from bench.plots import niah_grid
from executor.prompt import Prompt
from planner.strategies import STRATEGIES

RESULTS = Path(__file__).parent / "results"
RATIOS = [0.5, 0.3, 0.2, 0.1]
LONG = 1900              # "contexts of 2k tokens and more": the 2k and 3.5k cases (their contexts are ~1950+)
FAMILIES = ["niah", "multikey"]
QUICK = dict(lengths=[1000], depths=[0, 50], strategies=["full", "snapkv", "spindlekv"], ratios=[0.5], fidelity_tokens=16)


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1k tokens, 2 depths, full+snapkv+spindlekv at 0.5")
    ap.add_argument("--strategies", nargs="+", help=f"default: every registered one ({' '.join(STRATEGIES)})")
    ap.add_argument("--ratios", type=float, nargs="+", help=f"requested reserve ratios (default {RATIOS})")
    ap.add_argument("--runs", nargs="+", metavar="STRATEGY:RATIO",
                    help="exact (strategy, ratio) runs instead of strategies × ratios, e.g. specache:0.2 specache-1bit:0.13")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=FAMILIES)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--lengths", type=int, nargs="+", help=f"context tokens (default {list(C.LENGTHS)})")
    ap.add_argument("--depths", type=int, nargs="+", help=f"needle depths in percent (default {list(C.DEPTHS)})")
    ap.add_argument("--new-tokens", type=int, default=32, help="answer tokens (greedy)")
    ap.add_argument("--fidelity-tokens", type=int, help="continuation tokens for fidelity (default 64; 0: skip)")
    ap.add_argument("--fidelity-length", type=int, default=2000, help="document tokens for fidelity")
    ap.add_argument("--out", type=Path, help="results folder (default bench/results, --quick: bench/results/quick)")
    ap.add_argument("--tune-needles", type=int, nargs="+", help="only tune the multi-key needle count with `full`")
    args = ap.parse_args(argv)
    quick = QUICK if args.quick else dict(lengths=list(C.LENGTHS), depths=list(C.DEPTHS),
                                          strategies=list(STRATEGIES), ratios=RATIOS, fidelity_tokens=64)
    for name, value in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.runs:
        try:
            args.runs = [(s, float(r)) for s, r in (x.rsplit(":", 1) for x in args.runs)]
        except ValueError:
            ap.error(f"--runs: expected STRATEGY:RATIO items, got {' '.join(args.runs)}")
        args.strategies = list(dict.fromkeys(s for s, _ in args.runs))
    check_strategies(args.strategies)
    args.out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    return args


def case_jobs(strategies: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    """(strategy, requested ratio) runs per case: `full` once (it ignores the ratio), the rest per ratio."""
    return ([("full", 1.0)] if "full" in strategies else []) + [(s, r) for s in strategies if s != "full" for r in ratios]


def run_cases(h: Harness, cases: list[C.Case], modes: list[str], jobs, new_tokens: int) -> list[dict]:
    units = sorted(((c, m) for c in cases for m in modes), key=lambda u: u[0].length)
    weight = sum(c.length for c, _ in units)
    print(f"{len(cases)} cases × {len(modes)} modes = {len(units)} prompts × {len(jobs)} runs = "
          f"{len(units) * len(jobs)} runs", file=sys.stderr)
    runs: dict[tuple, list[dict]] = defaultdict(list)
    t0, done = time.perf_counter(), 0
    bar = tqdm(units, file=sys.stderr, unit="case", dynamic_ncols=True)
    for i, (case, mode) in enumerate(bar):
        prompt = h.prompt(case.context, case.question, mode)
        prefix = h.runner.prefix_of(prompt)        # the leading chunks, once for every run of this prompt
        for strategy, ratio in jobs:
            plan = h.plan(strategy, list(prompt.context_ids), ratio, len(prompt.question_ids), new_tokens)  # run + yardstick
            res, logits = h.run(prompt, strategy, ratio, new_tokens, prefix, plan, measure_recall=plan.offload.enabled,
                                record_logits=True)
            evicts = any(lp.kind != "full" for lp in plan.layers)     # else the plan keeps every token's K/V
            predicted = h.predicted_retained(plan, list(prompt.context_ids)) if evicts else plan.predicted_retained_attention
            copy = h.predicted_copy(plan, list(prompt.context_ids)) if evicts else 1.0
            runs[case.family, mode, strategy, ratio].append(dict(
                predicted_retained=predicted, predicted_copy=copy, offload=res.offload, ratio=ratio,
                grounded=risk.grounded(list(prompt.context_ids) + list(prompt.question_ids), res.token_ids),
                kv_risk=res.kv_risk, kv_at_risk=res.kv_at_risk,
                **risk.confidence(logits, res.token_ids),
                id=case.id, length=case.length, depth=case.depth, key=case.key, answer=case.answer,
                reply=res.text, correct=C.is_correct(case.answer, res.text),
                digits=C.digits_matched(case.answer, res.text), measured_ratio=measured_ratio(res),
                context_tokens=len(prompt.context_ids), prompt_tokens=prompt.num_tokens,
                prefill_s=round(res.prefill_s, 3), decode_s=round(res.decode_s, 3), decode_steps=res.decode_steps))
        done += case.length
        eta = (time.perf_counter() - t0) / done * (weight - done)      # weighted by context length
        bar.set_postfix_str(f"eta {eta / 60:.0f} min")
        if i == 0:
            tqdm.write(f"first case {time.perf_counter() - t0:.1f}s for {len(jobs)} runs; "
                       f"ETA (length-weighted) {eta / 60:.0f} min", file=sys.stderr)
    bar.close()
    rows = []
    for (family, mode, strategy, ratio), got in runs.items():
        rows.append(dict(family=family, mode=mode, strategy=strategy, requested_ratio=ratio,
                         measured_ratio=sum(c["measured_ratio"] for c in got) / len(got),
                         correct=sum(c["correct"] for c in got), total=len(got),
                         mean_digits=sum(c["digits"] for c in got) / len(got),
                         predicted_retained=sum(c["predicted_retained"] for c in got) / len(got),
                         predicted_copy=sum(c["predicted_copy"] for c in got) / len(got),
                         **offload_summary(got), cases=got))
    return rows


def offload_summary(cases: list[dict]) -> dict:
    """Offload runs: the measured ratio at contexts of 2k tokens and more, the largest one there,
    and the prefetch recall against the oracle top-k (share of its rows; of its attention mass)."""
    off = [c for c in cases if c["offload"]]
    if not off:
        return {}
    long = [c["measured_ratio"] for c in off if c["context_tokens"] >= LONG]
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return dict(measured_ratio_2k=mean(long), max_ratio_2k=max(long, default=None),
                recall=mean([c["offload"]["recall"] for c in off if c["offload"]["recall"] is not None]),
                mass_recall=mean([c["offload"]["mass_recall"] for c in off if c["offload"]["mass_recall"] is not None]),
                late=sum(c["offload"]["stats"]["late"] for c in off),
                prefetches=sum(c["offload"]["stats"]["prefetches"] for c in off))


PREDICTORS = {"predicted_retained": "retained attention", "predicted_copy": "copy-aware retained attention"}


def rank_correlation(rows: list[dict]) -> list[dict]:
    """Per family, mode and predictor (`PREDICTORS`: planner.predict's retained attention and its
    copy-aware form): Spearman's ρ between the plans' prediction and the accuracy they measured,
    over every compressed (strategy, ratio) row."""
    from scipy.stats import spearmanr
    out = []
    for family, mode in sorted({(r["family"], r["mode"]) for r in rows}):
        mine = [r for r in rows if (r["family"], r["mode"]) == (family, mode) and r["strategy"] != "full"]
        if len(mine) < 3:
            continue
        for key in PREDICTORS:
            rho, p = spearmanr([r[key] for r in mine], [r["correct"] / r["total"] for r in mine])
            out.append(dict(family=family, mode=mode, predictor=key, rows=len(mine), spearman=float(rho), p_value=float(p)))
    return out


def fidelity(h: Harness, jobs, tokens: int, length: int) -> list[dict]:
    """Teacher-force the full run's greedy continuation of a long document through each plan."""
    ids = C.fidelity_document(h.tokenizer, length)
    prompt = Prompt(ids, [])
    ref, _ = h.forced_logits(prompt, h.plan("full", len(ids), 1.0), tokens)
    forced = ref.argmax(-1).tolist()
    rows = []
    for strategy, ratio in tqdm(jobs, file=sys.stderr, desc="fidelity", dynamic_ncols=True):
        logits, cache = h.forced_logits(prompt, h.plan(strategy, ids, ratio, 0, tokens), forced)
        top1, kl = agreement(ref, logits)
        rows.append(dict(strategy=strategy, requested_ratio=ratio, measured_ratio=measured_ratio(cache),
                         top1=top1, kl=kl, tokens=tokens, document_tokens=len(ids)))
    return rows


def table(rows: list[dict], fid: list[dict], jobs) -> str:
    cols = sorted({(r["family"], r["mode"]) for r in rows}, key=lambda c: (FAMILIES.index(c[0]), MODES.index(c[1])))
    head = ["strategy", "reserve", "measured"] + [f"{f} / {m.removeprefix('query_')}" for f, m in cols]
    head += ["top-1", "KL"] if fid else []
    head += ["predicted retained", "copy-aware"]
    offload = any("recall" in r for r in rows)
    head += ["measured ≥2k (max)", "prefetch recall rows / mass"] if offload else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for strategy, ratio in jobs:
        mine = {(r["family"], r["mode"]): r for r in rows if r["strategy"] == strategy and r["requested_ratio"] == ratio}
        f = next((x for x in fid if x["strategy"] == strategy and x["requested_ratio"] == ratio), None)
        cases = [c for r in mine.values() for c in r["cases"]]
        measured = sum(c["measured_ratio"] for c in cases) / len(cases) if cases else (f or {}).get("measured_ratio", 1.0)
        cells = [strategy, "—" if strategy == "full" else f"{ratio:g}", f"{measured:.3f}"]
        cells += [f"{mine[c]['correct']}/{mine[c]['total']}" if c in mine else "" for c in cols]
        cells += [f"{f['top1']:.3f}", f"{f['kl']:.4f}"] if f else ([""] * 2 if fid else [])
        cells += [f"{sum(c[k] for c in cases) / len(cases):.3f}" if cases else "" for k in PREDICTORS]
        if offload:
            o = [r for r in mine.values() if "recall" in r]
            long = [c["measured_ratio"] for r in o for c in r["cases"] if c["context_tokens"] >= LONG]
            rec = [(r["recall"], r["mass_recall"]) for r in o if r["recall"] is not None]
            cells += [f"{sum(long) / len(long):.3f} ({max(long):.3f})" if long else "",
                      f"{sum(a for a, _ in rec) / len(rec):.3f} / {sum(b for _, b in rec) / len(rec):.3f}" if rec else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tune(h: Harness, args) -> None:
    """Full's multi-key score per needle count (the count is then fixed in cases.MULTIKEY_NEEDLES)."""
    scores = {}
    for n in args.tune_needles:
        cases = C.generate("multikey", h.tokenizer, args.lengths, args.depths, needles=n)
        rows = run_cases(h, cases, args.modes, [("full", 1.0)], args.new_tokens)
        scores[n] = {r["mode"]: f"{r['correct']}/{r['total']}" for r in rows}
        print(f"needles={n}: {scores[n]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multikey_tuning.json").write_text(json.dumps(dict(bench="multikey_tuning", scores=scores), indent=1))
    print("| needles | " + " | ".join(args.modes) + " |\n|---:|" + "---:|" * len(args.modes))
    for n, s in scores.items():
        print(f"| {n} | " + " | ".join(s.get(m, "") for m in args.modes) + " |")


def main(argv=None) -> None:
    args = parse(argv)
    if importlib.util.find_spec("scipy") is None:       # the rank correlation needs it: say so before the cases run
        sys.exit("bench.quality needs scipy (the rank correlation): pip install -e '.[bench]' (make bench does)")
    h = Harness.load()
    if args.tune_needles:
        return tune(h, args)
    jobs = args.runs or case_jobs(args.strategies, args.ratios)
    h.warmup(args.strategies)
    t0 = time.perf_counter()
    cases = [c for fam in args.families for c in C.generate(fam, h.tokenizer, args.lengths, args.depths)]
    rows = run_cases(h, cases, args.modes, jobs, args.new_tokens) if cases else []
    cases_s = time.perf_counter() - t0
    fid = fidelity(h, jobs, args.fidelity_tokens, args.fidelity_length) if args.fidelity_tokens else []
    out = dict(bench="quality", quick=args.quick, machine=platform.machine(), torch=torch.__version__,
               threads=torch.get_num_threads(), model=h.lm.model.config.name_or_path, new_tokens=args.new_tokens,
               lengths=args.lengths, depths=args.depths, strategies=args.strategies, ratios=args.ratios,
               multikey=dict(needles=C.MULTIKEY_NEEDLES, tuning=C.MULTIKEY_TUNING,
                             full_score={r["mode"]: f"{r['correct']}/{r['total']}" for r in rows
                                         if r["family"] == "multikey" and r["strategy"] == "full"}),
               seconds=dict(cases=round(cases_s, 1), fidelity=round(time.perf_counter() - t0 - cases_s, 1)),
               rows=rows, fidelity=fid, rank_correlation=rank_correlation(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(out, indent=1))
    pngs = [niah_grid([r for r in rows if r["family"] == "niah" and (r["strategy"], r["requested_ratio"]) == job],
                      *job, args.out / (f"niah_{job[0]}.png" if job[0] == "full" else f"niah_{job[0]}_r{job[1]:g}.png"))
            for job in jobs if any(r["family"] == "niah" and (r["strategy"], r["requested_ratio"]) == job for r in rows)]
    print(table(rows, fid, jobs))
    for rc in out["rank_correlation"]:
        print(f"predicted {PREDICTORS[rc['predictor']]} vs accuracy, {rc['family']} / {rc['mode']}: Spearman ρ = "
              f"{rc['spearman']:.2f} over {rc['rows']} plans (p = {rc['p_value']:.2g})")
    print(f"\n{len(rows)} rows, {out['seconds']['cases']}s cases + {out['seconds']['fidelity']}s fidelity; "
          f"{args.out / 'quality.json'}, {len(pngs)} NIAH heatmaps in {args.out}")


if __name__ == "__main__":
    main()
