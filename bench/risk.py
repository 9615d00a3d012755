"""Does an answer know it is at risk? Scores an executor can compute at answer time, and how well
each separates the compressed answers that differ from `full`'s from those that match (ROC AUC).

Candidates (every one: higher = safer; all known before the run, none fitted to its cases):
- `predicted_retained`, `predicted_copy`: the plan's predicted retained attention and its
  copy-aware form (`planner.predict`: the window's attention at the context's end, which the
  executor's own prefill computes too);
- `first_prob`, `mean_prob`, `min_prob`: the model's probability of the tokens it chose (the
  first one; the mean and the least over the answer) — the sampler's logits;
- `min_margin`: the least top-1 minus top-2 probability over the answer;
- `grounded`: the share of the answer's tokens inside some `executor.engine.risk.NGRAM`-gram that also occurs in the
  prompt (an answer read from the context is copied; a made-up one is not) — prompt and answer
  ids only; the executor reports 1 - `grounded` as `kv_risk` (`executor.engine.risk`);
- `ratio`: the requested reserve ratio (the trivial baseline).

    python -m bench.risk bench/results/risk41/quality.json [--split length|depth]

The split: the threshold of each candidate (Youden's J) is chosen on the tuning cases and its
miss/false-alarm rates reported on the others; AUC needs no threshold but is reported on both.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from executor.engine.risk import grounded

CANDIDATES = ("predicted_retained", "predicted_copy", "first_prob", "mean_prob", "min_prob", "min_margin",
              "grounded", "ratio")


def confidence(step_logits: list[torch.Tensor], tokens: list[int]) -> dict:
    """step_logits: per generated token its row's logits [V]; tokens: the tokens taken."""
    if not tokens:
        return dict(first_prob=1.0, mean_prob=1.0, min_prob=1.0, min_margin=1.0)
    p = torch.softmax(torch.stack(step_logits[:len(tokens)]).float(), -1)                # [n, V]
    chosen = p.gather(1, torch.tensor(tokens)[:, None])[:, 0]                             # [n]
    top2 = p.topk(2, -1).values                                                           # [n, 2]
    return dict(first_prob=float(chosen[0]), mean_prob=float(chosen.mean()), min_prob=float(chosen.min()),
                min_margin=float((top2[:, 0] - top2[:, 1]).min()))


def auc(safe: list[float], risky: list[float]) -> float | None:
    """P(a matching answer scores above a differing one), ties half (Mann-Whitney)."""
    if not safe or not risky:
        return None
    wins = sum((s > r) + 0.5 * (s == r) for s in safe for r in risky)
    return wins / (len(safe) * len(risky))


def threshold(cases: list[dict], key: str, label: str) -> float:
    """The cut maximising TPR - FPR (Youden's J) for `score < cut` flagging `label` cases."""
    best, cut = -2.0, 0.0
    for c in sorted({x[key] for x in cases}) + [float("inf")]:
        tpr = _rate([x for x in cases if x[label]], key, c)
        fpr = _rate([x for x in cases if not x[label]], key, c)
        if tpr - fpr > best:
            best, cut = tpr - fpr, c
    return cut


def _rate(cases: list[dict], key: str, cut: float) -> float:
    return sum(x[key] < cut for x in cases) / len(cases) if cases else 0.0


def compressed_cases(quality: dict) -> list[dict]:
    """Every compressed run's case with its labels: `differs` (its reply is not full's, same case
    and mode) and `wrong` (not correct)."""
    full = {(r["family"], r["mode"], c["id"]): c for r in quality["rows"] if r["strategy"] == "full" for c in r["cases"]}
    out = []
    for r in quality["rows"]:
        if r["strategy"] == "full":
            continue
        for c in r["cases"]:
            ref = full[r["family"], r["mode"], c["id"]]
            out.append(dict(c, family=r["family"], mode=r["mode"], strategy=r["strategy"], ratio=r["requested_ratio"],
                            differs=c["reply"] != ref["reply"], wrong=not c["correct"], full_correct=ref["correct"]))
    return out


def split(cases: list[dict], how: str) -> tuple[list[dict], list[dict]]:
    """(tuning, held out): `length` tunes on the shortest length; `depth` on depths 0 and 50."""
    if how == "length":
        short = min(c["length"] for c in cases)
        return [c for c in cases if c["length"] == short], [c for c in cases if c["length"] != short]
    return [c for c in cases if c["depth"] in (0, 50)], [c for c in cases if c["depth"] not in (0, 50)]


def separation(cases: list[dict], label: str = "differs", how: str = "length") -> list[dict]:
    """Per mode (and pooled) and candidate: AUC on the tuning and held-out cases, the tuned
    threshold and its held-out flag rates (share of `label` cases flagged; of the others)."""
    rows = []
    for mode in sorted({c["mode"] for c in cases}) + ["pooled"]:
        mine = cases if mode == "pooled" else [c for c in cases if c["mode"] == mode]
        tune, held = split(mine, how)
        for key in CANDIDATES:
            if not all(key in c for c in mine):
                continue
            a = lambda xs: auc([x[key] for x in xs if not x[label]], [x[key] for x in xs if x[label]])
            cut = threshold(tune, key, label)
            rows.append(dict(mode=mode, candidate=key, label=label, split=how, cases=len(mine),
                             tune_cases=len(tune), held_cases=len(held),
                             held_positive=sum(x[label] for x in held), auc_all=a(mine), auc_tune=a(tune),
                             auc_held=a(held), threshold=cut,
                             held_flagged=_rate([x for x in held if x[label]], key, cut),
                             held_false_alarms=_rate([x for x in held if not x[label]], key, cut)))
    return rows


def table(rows: list[dict]) -> str:
    fmt = lambda x: "—" if x is None else f"{x:.2f}"
    lines = ["| mode | candidate | AUC tune | AUC held out | threshold | held-out flagged / false alarms |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['candidate']} | {fmt(r['auc_tune'])} | {fmt(r['auc_held'])} | "
                     f"{r['threshold']:.3g} | {r['held_flagged']:.2f} / {r['held_false_alarms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("quality", type=Path, help="a quality.json written with per-case risk candidates")
    ap.add_argument("--split", choices=("length", "depth"), default="length")
    ap.add_argument("--out", type=Path, help="write the separation rows here (JSON)")
    args = ap.parse_args(argv)
    cases = compressed_cases(json.loads(args.quality.read_text()))
    out = {}
    for label in ("differs", "wrong"):
        rows = separation(cases, label, args.split)
        out[label] = rows
        n = {m: (sum(c[label] for c in cases if c["mode"] == m), sum(c["mode"] == m for c in cases))
             for m in sorted({c["mode"] for c in cases})}
        print(f"\n### label `{label}` ({', '.join(f'{m}: {p}/{t}' for m, (p, t) in n.items())}), "
              f"split by {args.split}\n\n{table(rows)}")
    if args.out:
        args.out.write_text(json.dumps(dict(split=args.split, cases=len(cases), separation=out), indent=1))
    print(f"\n{len(cases)} compressed runs", file=sys.stderr)


if __name__ == "__main__":
    main()
