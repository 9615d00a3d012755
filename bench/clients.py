"""A standard serving client against `kvplan up`: vLLM's own benchmark client (`vllm bench serve
--backend openai-chat --ignore-eos`) over the HTTP API, beside `bench.serve`'s client (gRPC
streams) on the same jobs and the same cluster, one after the other: whether the HTTP API honours
what such clients send (every token asked is generated) and whether what they measure is what the
engine did (TTFT and TPOT within 10% of bench.serve's).

    python -m bench.clients [--requests 8] [--lengths 3500] [--new-tokens 64] [--budget-jobs 8]
                            [--vllm-python /tmp/kvplan-peers/vllm/venv/bin/python] [--out bench/results/clients41]

The jobs are `bench.load.cases` (the serving bench's, in its order), each sent as one user turn
(context, blank line, question) with greedy decoding; the cluster is `kvplan up` with a state dir
of its own, free ports, API keys on (both clients send the admin key) and an executor KV budget of
`--budget-jobs` full jobs. Order: one untimed warm job, bench.serve's client, then vLLM's. The
vLLM client comes from the peer's venv (`../shared/peers/vllm/setup_vllm_venv.sh`) through the
peer's `vllm_cli.py` (its wheel's own entry point does not start). p50 is the median as vLLM's
client takes it (the mean of the middle two of an even count) on both rows. Writes
<out>/clients.json and prints a markdown table."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench import load
from bench.summary import jobs_budget, model_shape, pct
from cachestore.process import free_port
from kvcore import host, keyfile
from kvcore import model as models
from kvcore.config import ModelConfig, from_env

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "clients41"
VLLM_CLI = ROOT.parent / "shared" / "peers" / "vllm" / "vllm_cli.py"
VLLM_PY = Path("/tmp/kvplan-peers/vllm/venv/bin/python")
MODEL_NAME = "SmolLM2-135M-Instruct"


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[3500])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget-jobs", type=float, default=8.0, help="the executor's KV budget, in full jobs")
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="as bench.serve's default")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PY)
    ap.add_argument("--out", type=Path, default=OUT)
    return ap.parse_args(argv)


def cluster_env(args, state: Path, budget: int) -> dict[str, str]:
    """`kvplan up`'s environment: its own state dir, free ports, the bench's executor settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLAN_") or k in ("KVPLAN_CACHE_DIR", "KVPLAN_MODEL")}
    ports = {f"KVPLAN_{name}_PORT": str(free_port()) for name in
             ("PLANNER", "PLANNER_METRICS", "CACHESTORE", "CACHESTORE_METRICS", "EXECUTOR", "EXECUTOR_METRICS", "HTTP")}
    return {**env, **ports, "KVPLAN_STATE_DIR": str(state), "KVPLAN_KV_BUDGET_BYTES": str(budget),
            "KVPLAN_MAX_BATCHED_TOKENS": str(args.max_batched_tokens), "KVPLAN_PREFILL_CHUNK": str(args.max_batched_tokens),
            "KVPLAN_DEFAULT_MAX_NEW_TOKENS": str(args.new_tokens)}


def kvplan_cli(env: dict, *words: str) -> None:
    subprocess.run([sys.executable, "-m", "kvplan.cli", *words], env=env, check=True, cwd=ROOT,
                   stdin=subprocess.DEVNULL)


def grpc_client(env: dict, key: str, items: list[load.Item]) -> dict:
    """bench.serve's client (`bench.load.run`: a gRPC stream per job, all at once)."""
    os.environ["KVPLAN_API_KEY"] = key
    addr = f"127.0.0.1:{env['KVPLAN_EXECUTOR_PORT']}"
    warm = load.Item(items[0].case, "full", None, 2, 0.0, ignore_eos=True)
    load.run(addr, [warm])                                              # one-off costs, untimed
    t0 = time.perf_counter()
    sent = load.run(addr, items)
    wall = time.perf_counter() - t0
    done = [s for s in sent if s.result is not None and not s.error]
    ttft, tpot = [1e3 * s.ttft_s for s in sent], [1e3 * s.tpot_s for s in sent]
    return dict(client="bench.serve (gRPC)", completed=len(done), output_tokens=sum(len(s.t_tokens) for s in sent),
                ttft_ms=[statistics.median(ttft), pct(ttft, 99)], ttft_mean_ms=statistics.fmean(ttft),
                tpot_ms=[statistics.median(tpot), pct(tpot, 99)], tpot_mean_ms=statistics.fmean(tpot),
                per_job=dict(ttft_ms=ttft, tpot_ms=tpot), wall_s=wall, errors=[s.error for s in sent if s.error])


def vllm_client(args, env: dict, key: str, items: list[load.Item], model_dir: Path) -> dict:
    """`vllm bench serve --backend openai-chat --ignore-eos` over kvplan's HTTP API, all at once."""
    ds = args.out / "dataset.jsonl"
    with open(ds, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps({"prompt": it.case.context + "\n\n" + it.case.question,
                                "output_tokens": args.new_tokens}) + "\n")
    cmd = [str(args.vllm_python), str(VLLM_CLI), "bench", "serve", "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", f"http://127.0.0.1:{env['KVPLAN_HTTP_PORT']}",
           "--model", MODEL_NAME, "--tokenizer", str(model_dir), "--dataset-name", "custom", "--dataset-path", str(ds),
           "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(len(items)),
           "--custom-output-len", str(args.new_tokens), "--ignore-eos", "--request-rate", "inf", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(args.out), "--result-filename", "vllm_bench_serve.json"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OPENAI_API_KEY": key}, timeout=3600)
    wall = time.perf_counter() - t0
    (args.out / "vllm_bench_serve.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"vllm bench serve exited {p.returncode}; see {args.out / 'vllm_bench_serve.log'}")
    r = json.loads((args.out / "vllm_bench_serve.json").read_text())
    return dict(client="vllm bench serve (HTTP)", completed=r["completed"], output_tokens=r["total_output_tokens"],
                ttft_ms=[r["median_ttft_ms"], r["p99_ttft_ms"]], ttft_mean_ms=r["mean_ttft_ms"],
                tpot_ms=[r["median_tpot_ms"], r["p99_tpot_ms"]], tpot_mean_ms=r["mean_tpot_ms"], wall_s=wall,
                errors=[e for e in r.get("errors", []) if e])


def table(rows: list[dict], asked: int) -> str:
    ref = rows[0]
    lines = ["| client | jobs done | tokens / asked | TTFT p50 ms | × | TTFT mean ms | × | TPOT p50 ms | × "
             "| TPOT mean ms | × |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['client']} | {r['completed']} | {r['output_tokens']} / {asked} "
                     f"| {r['ttft_ms'][0]:.0f} | {r['ttft_ms'][0] / ref['ttft_ms'][0]:.3f} "
                     f"| {r['ttft_mean_ms']:.0f} | {r['ttft_mean_ms'] / ref['ttft_mean_ms']:.3f} "
                     f"| {r['tpot_ms'][0]:.1f} | {r['tpot_ms'][0] / ref['tpot_ms'][0]:.3f} "
                     f"| {r['tpot_mean_ms']:.1f} | {r['tpot_mean_ms'] / ref['tpot_mean_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(argv)
    if not args.vllm_python.exists():
        print(f"--vllm-python: {args.vllm_python} not found (../shared/peers/vllm/setup_vllm_venv.sh makes it)",
              file=sys.stderr)
        raise SystemExit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    mcfg = from_env(ModelConfig)
    model_dir = models.prepare(mcfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    shape = model_shape(mcfg, args.max_batched_tokens)
    budget = jobs_budget(shape, argparse.Namespace(lengths=args.lengths, new_tokens=args.new_tokens), args.budget_jobs)
    items = [load.Item(c, "full", None, args.new_tokens, 0.0, ignore_eos=True)
             for c in load.cases(tok, args.requests, args.lengths)]
    with tempfile.TemporaryDirectory(prefix="kvplan-clients-") as state:
        env = cluster_env(args, Path(state), budget)
        kvplan_cli(env, "up")
        try:
            key = (Path(state) / keyfile.ADMIN_KEY_FILE).read_text().strip()
            rows = [grpc_client(env, key, items)]
            rows.append(vllm_client(args, env, key, items, model_dir))
        finally:
            kvplan_cli(env, "down")
    asked = args.requests * args.new_tokens
    text = table(rows, asked)
    caption = (f"{args.requests} jobs × {max(args.lengths)} tokens × {args.new_tokens} new, all at once, against "
               f"`kvplan up` (full KV, budget {budget:,} B); {host.host().describe()}")
    print(caption + "\n\n" + text)
    (args.out / "clients.json").write_text(json.dumps(dict(
        caption=caption, rows=rows, asked_tokens=asked, budget_bytes=budget, host=host.host().describe(),
        machine=platform.machine(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv[1:]), indent=1))


if __name__ == "__main__":
    main()
