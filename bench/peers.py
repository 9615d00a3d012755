"""kvplan beside the engines a user would pick instead, each at its best on this host, on the same
jobs and the same KV bytes: a wrapper over the peers' own scripts (`../shared/peers/`: vLLM's CPU
build, llama.cpp's server), which export this checkout's `bench.serve` jobs and budget themselves,
and one table of every run, captioned with the host's CPU and the flags that decide the peers' speed
(avx512_bf16, amx: `kvcore.host`).

    python -m bench.peers best vllm [--dtypes bfloat16 float32] [--kv fp8 auto] [ARGS...]
    python -m bench.peers best llamacpp [--weights f32 f16] [ARGS...]
    python -m bench.peers run vllm|llamacpp [ARGS...]           # one configuration, as the peer's script takes it
    python -m bench.peers table --serve bench/results/serve/serve.json [--vllm F.json ...]
                                [--llamacpp F.json ...] [--against "vLLM best"] [--out F.json]

`best vllm` runs the workload once per compute dtype (bf16 and fp32: which is faster depends on the
host — bf16 is native with AVX512-BF16 or AMX, emulated elsewhere), each with the first KV dtype of
--kv that starts (fp8 where vLLM's CPU backend takes it: it needs AVX-512; else the model's dtype),
and keeps the run with the highest end-to-end output tokens/s among those that finished every job.
`best llamacpp` runs llama.cpp's server with each GGUF weight type of --weights over its KV types
(the script's --kv: f16 q8_0 q4_0 by default) and keeps the fastest the same way. Each writes
best_<peer>.json under --out (its candidates, why any did not start, the host) beside the runs'
own JSONs. Extra arguments pass through to the peer's script (`--requests 12 --lengths 2000
--new-tokens 128 --budget-jobs 3` for vLLM; `--jobs 12 --tokens 2000 ...` for llama.cpp).

Run each alone on a quiet machine, one after another with `python -m bench.serve`: two processes
computing on two cores collapse each other's OpenMP teams.

`table` prints one markdown table — engine, KV form, jobs decoding at once, decode tokens/s (the
steps that only decode, every engine counted alike), end-to-end output tokens/s, TTFT p50, answers
right — with each row's ratio against the `--against` row (default: the best vLLM run, else the
first vLLM row), under a line naming the host, and writes it with its rows as JSON. A best_*.json
stands for its candidates' runs (the chosen one marked "best")."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from kvcore.host import host

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
SCRIPTS = {"vllm": ("vllm/run_vllm_peer.py", Path("/tmp/kvplan-peers/vllm/venv/bin/python")),
           "llamacpp": ("llamacpp/run_peer.py", Path(sys.executable))}
RESULTS = {"vllm": Path("/tmp/kvplan-peers/vllm/results"), "llamacpp": Path("/tmp/kvplan-peers/llamacpp/results")}
GGUF = "/tmp/kvplan-peers/gguf/SmolLM2-135M-Instruct-{}.gguf"         # build_peer.sh's conversions


def command(peer: str, peers_dir: Path, extra: list[str]) -> list[str]:
    script, python = SCRIPTS[peer]
    path = peers_dir / script
    if not path.exists():
        sys.exit(f"bench.peers: {path} is not here: give --peers-dir, the folder holding the peers' scripts")
    if not python.exists():
        sys.exit(f"bench.peers: {python} is not here: set the peer up first ({path.parent / 'README.md'})")
    cmd = [str(python), str(path), "--checkout", str(ROOT)]
    if peer == "llamacpp":              # its script imports modules that moved: run it through the shim
        cmd = [str(python), "-m", "bench.peer_shim", str(path), "--checkout", str(ROOT)]
    if peer == "vllm":
        cmd += ["--jobs", str(vllm_jobs(extra))]
    return cmd + extra


def vllm_jobs(extra: list[str]) -> Path:
    """The jobs vLLM's script sends, written by `bench.peer_jobs` from the workload arguments in
    `extra` (--requests, --lengths, --new-tokens, --budget-jobs, --max-batched-tokens) into its
    --out folder -> the JSONL's path (the script's own exporter imports modules that moved)."""
    from bench import peer_jobs
    ns, _ = peer_jobs.parser().parse_known_args(["--out", str(RESULTS["vllm"]), *extra])
    ns.out = Path(ns.out) / "jobs.jsonl"
    peer_jobs.export(ns)
    return ns.out


def run(peer: str, peers_dir: Path, extra: list[str]) -> int:
    cmd = command(peer, peers_dir, extra)
    print("[peers] " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def _finished(r: dict) -> bool:
    return r.get("done", r.get("requests")) == r.get("requests") and not math.isnan(r.get("output_tps", float("nan")))


def best_vllm(args, extra: list[str]) -> dict:
    """One run per compute dtype with the first KV dtype of args.kv that starts -> the summary."""
    out, candidates = args.out or RESULTS["vllm"], []
    out.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes:
        for kv in args.kv:
            tag = f"{dtype}-{kv}"
            path = out / f"vllm_peer-{tag}.json"
            path.unlink(missing_ok=True)                          # only this run's result counts
            rc = run("vllm", args.peers_dir, extra + ["--dtype", dtype, "--kv-cache-dtype", kv, "--out", str(out),
                                                      "--tag", tag])
            if rc or not path.exists():
                candidates.append(dict(dtype=dtype, kv=kv, started=False, error=f"exit {rc}; see {out}/server-{tag}.log"))
                continue                                          # this KV dtype did not start: the next one
            r = json.loads(path.read_text())
            candidates.append(dict(dtype=dtype, kv=kv, started=True, finished=_finished(r), file=str(path),
                                   output_tps=r["output_tps"], decode_tps=r["decode_tps"]))
            break                                                 # the first KV dtype that starts, per compute dtype
    return _pick("vllm", candidates, out)


def best_llamacpp(args, extra: list[str]) -> dict:
    """One script run per weight type (each over its KV types) -> the summary of every run."""
    out, candidates = args.out or RESULTS["llamacpp"], []
    out.mkdir(parents=True, exist_ok=True)
    for w in args.weights:
        name = f"peer_llamacpp-{w}.json"
        (out / name).unlink(missing_ok=True)
        rc = run("llamacpp", args.peers_dir, extra + ["--gguf", GGUF.format(w), "--out", str(out), "--json", name])
        path = out / name
        if rc or not path.exists():
            candidates.append(dict(weights=w, started=False, error=f"exit {rc}; see {out}/logs"))
            continue
        for i, r in enumerate(json.loads(path.read_text())["runs"]):
            candidates.append(dict(weights=w, kv=r.get("kv"), started=True, finished=_finished(r), file=str(path), run=i,
                                   output_tps=r.get("output_tps", float("nan")), decode_tps=r.get("decode_tps")))
    return _pick("llamacpp", candidates, out)


def _pick(peer: str, candidates: list[dict], out: Path) -> dict:
    done = [c for c in candidates if c.get("finished")]
    best = max(done, key=lambda c: c["output_tps"], default=None)
    summary = dict(bench=f"best_{peer}", host=host().as_dict(), host_line=host().describe(), candidates=candidates,
                   best=best, when=time.strftime("%Y-%m-%d %H:%M"))
    (out / f"best_{peer}.json").write_text(json.dumps(summary, indent=1))
    for c in candidates:
        what = " ".join(str(c[k]) for k in ("dtype", "weights", "kv") if c.get(k))
        state = (f"{c['output_tps']:.2f} out tok/s" + ("" if c["finished"] else " (jobs unfinished)")) if c["started"] \
            else f"did not start ({c['error']})"
        print(f"[peers] {peer} {what}: {state}{'  <- best' if c is best else ''}", flush=True)
    if best is None:
        print(f"[peers] {peer}: no configuration finished every job", flush=True)
    return summary


# -- the table -------------------------------------------------------------------------------------
def _vllm_row(v: dict, best: bool = False) -> dict:
    kv = "fp8" if "fp8" in v["kv_dtype"] else v["dtype"].replace("bfloat16", "bf16").replace("float", "fp")
    dtype = v["dtype"].replace("bfloat16", "bf16").replace("float", "fp")
    return dict(engine=f"vLLM {v['vllm']} {dtype}", kv=kv, decoding=v.get("most_decoding_steps") or v.get("most_running_steps"),
                decode_tps=v["decode_tps"], output_tps=v["output_tps"], ttft_p50=v["ttft"][0],
                correct=f"{v['correct']}/{v['requests']}", label="vLLM best" if best else f"vLLM {kv}", best=best)


def _llamacpp_rows(lc: dict, weights: str = "", best_run: int | None = None) -> list[dict]:
    out = []
    for i, r in enumerate(lc["runs"]):
        out.append(dict(engine=f"llama.cpp{' ' + weights if weights else ''}", kv=r.get("kv", "?"),
                        decoding=r.get("slots") or r.get("most_decoding"), decode_tps=r.get("decode_tps", float("nan")),
                        output_tps=r.get("output_tps", float("nan")), ttft_p50=(r.get("ttft") or [float("nan")])[0],
                        correct=f"{r.get('correct', '?')}/{r.get('requests', '?')}", best=i == best_run,
                        label="llama.cpp best" if i == best_run else None))
    return out


def rows(args) -> list[dict]:
    out = []
    if args.serve:
        serve = json.loads(Path(args.serve).read_text())
        for r in serve["runs"]:
            name = r["strategy"] if r["strategy"] in ("full", "adaptive") else f"{r['strategy']} {r['ratio']:g}"
            out.append(dict(engine=f"kvplan {name}", kv="fp16" if r["strategy"] == "full" else f"{r['measured_ratio']:.2f} of fp16",
                            decoding=int(r["most_decoding"]), decode_tps=r["decode_tps"], output_tps=r["output_tps"],
                            ttft_p50=r["ttft"][0], correct=f"{r['correct']}/{r['requests']}"))
    for path in args.vllm:
        v = json.loads(Path(path).read_text())
        if v.get("bench") == "best_vllm":              # every candidate that ran, the chosen one marked
            chosen = (v.get("best") or {}).get("file")
            out += [_vllm_row(json.loads(Path(c["file"]).read_text()), c["file"] == chosen)
                    for c in v["candidates"] if c["started"]]
        else:
            out.append(_vllm_row(v))
    for path in args.llamacpp:
        lc = json.loads(Path(path).read_text())
        if lc.get("bench") == "best_llamacpp":
            chosen = lc.get("best") or {}
            for f in dict.fromkeys(c["file"] for c in lc["candidates"] if c["started"]):
                weights = next(c["weights"] for c in lc["candidates"] if c.get("file") == f)
                out += _llamacpp_rows(json.loads(Path(f).read_text()), weights,
                                      chosen.get("run") if chosen.get("file") == f else None)
        else:
            out += _llamacpp_rows(lc)
    return out


def table(out: list[dict], against: str | None, host_line: str) -> str:
    base = next((r for r in out if against and (r.get("label") == against or r["engine"] == against)), None) or \
        next((r for r in out if r.get("label") == "vLLM best"), None) or \
        next((r for r in out if r["engine"].startswith("vLLM")), None)
    x = lambda r, k: f"{r[k] / base[k]:.2f}×" if base and base[k] else "—"           # noqa: E731
    lines = [f"Host: {host_line}", "",
             "| engine | KV | jobs decoding | decode tok/s | × | end-to-end out tok/s | × | TTFT p50 s | answers |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out:
        mark = " **(best)**" if r.get("best") else ""
        lines.append(f"| {r['engine']}{mark} | {r['kv']} | {r['decoding']} | {r['decode_tps']:.1f} | {x(r, 'decode_tps')} | "
                     f"{r['output_tps']:.2f} | {x(r, 'output_tps')} | {r['ttft_p50']:.1f} | {r['correct']} |")
    if base:
        lines.append(f"\n× against {base.get('label') or base['engine']}")
    return "\n".join(lines)


def _host_line(args) -> str:
    """The host the runs name (a best_*.json records it), else this one."""
    for path in [*args.vllm, *args.llamacpp]:
        line = json.loads(Path(path).read_text()).get("host_line")
        if line:
            return line
    return host().describe()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a peer's script on this checkout's jobs, one configuration")
    r.add_argument("peer", choices=sorted(SCRIPTS))
    r.add_argument("--peers-dir", type=Path, default=PEERS)
    b = sub.add_parser("best", help="run a peer in each configuration that may be its fastest here; keep the fastest")
    b.add_argument("peer", choices=sorted(SCRIPTS))
    b.add_argument("--peers-dir", type=Path, default=PEERS)
    native = host().native_bf16
    b.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32", "float16"],
                   default=["bfloat16", "float32"] if native else ["float32", "bfloat16"],
                   help="vLLM compute dtypes to try (each one run)")
    b.add_argument("--kv", nargs="+", default=["fp8", "auto"], help="vLLM KV dtypes, the first that starts is kept")
    b.add_argument("--weights", nargs="+", default=["f32", "f16"], help="llama.cpp GGUF weight types to try")
    b.add_argument("--out", type=Path, help="results folder (default: the peer's own under /tmp/kvplan-peers)")
    t = sub.add_parser("table", help="one table of kvplan's and the peers' runs")
    t.add_argument("--serve", help="a bench.serve JSON")
    t.add_argument("--vllm", nargs="*", default=[], help="vllm_peer*.json or best_vllm.json")
    t.add_argument("--llamacpp", nargs="*", default=[], help="peer_llamacpp*.json or best_llamacpp.json")
    t.add_argument("--against", help='the row ratios are taken against, e.g. "vLLM fp8" (default: vLLM best)')
    t.add_argument("--out", type=Path)
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "run":
        sys.exit(run(args.peer, args.peers_dir, extra))
    if args.cmd == "best":
        summary = (best_vllm if args.peer == "vllm" else best_llamacpp)(args, extra)
        sys.exit(0 if summary["best"] else 1)
    if extra:
        ap.error(f"unknown arguments {extra}")
    out = rows(args)
    if not out:
        ap.error("give --serve and/or peer results")
    line = _host_line(args)
    text = table(out, args.against, line)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(dict(host=line, rows=out, table=text), indent=1))


if __name__ == "__main__":
    main()
