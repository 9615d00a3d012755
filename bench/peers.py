"""kvplan beside the engines a user would pick instead, on the same jobs and the same KV bytes: a
wrapper over the peers' own scripts (`../shared/peers/`: vLLM's CPU build, llama.cpp's server),
which export this checkout's `bench.serve` jobs and budget themselves, and one table of every run.

    python -m bench.peers run vllm [--dtype bfloat16] [--kv-cache-dtype fp8] [--tag fp8] [ARGS...]
    python -m bench.peers run llamacpp [--kv f16 q8_0 q4_0] [ARGS...]
    python -m bench.peers table --serve bench/results/serve/serve.json [--vllm F.json ...]
                                [--llamacpp F.json] [--against "vLLM fp8"] [--out F.json]

`run` starts the peer's script with this checkout and its interpreter (extra arguments pass
through: `--max-num-batched-tokens 4096`, `--requests`, `--lengths`, `--new-tokens`, ...); the
peers' venvs and builds are made by their own setup scripts (see their READMEs). Run each alone on
a quiet machine, one after another with `python -m bench.serve`: two processes computing on two
cores collapse each other's OpenMP teams.

`table` prints one markdown table — engine, KV form, jobs decoding at once, decode tokens/s (the
steps that only decode, every engine counted alike), end-to-end output tokens/s, TTFT p50, answers
right — with each row's ratio against the `--against` row (default the first vLLM row), and
writes it with its rows as JSON."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
SCRIPTS = {"vllm": ("vllm/run_vllm_peer.py", Path("/tmp/kvplan-peers/vllm/venv/bin/python")),
           "llamacpp": ("llamacpp/run_peer.py", Path(sys.executable))}


def run(peer: str, peers_dir: Path, extra: list[str]) -> int:
    script, python = SCRIPTS[peer]
    path = peers_dir / script
    if not path.exists():
        sys.exit(f"bench.peers: {path} is not here: give --peers-dir, the folder holding the peers' scripts")
    if not python.exists():
        sys.exit(f"bench.peers: {python} is not here: set the peer up first ({path.parent / 'README.md'})")
    cmd = [str(python), str(path), "--checkout", str(ROOT)]
    if peer == "vllm":
        cmd += ["--project-python", sys.executable]
    print("[peers] " + " ".join(cmd + extra), flush=True)
    return subprocess.call(cmd + extra, cwd=ROOT)


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
        kv = "fp8" if "fp8" in v["kv_dtype"] else v["dtype"].replace("bfloat16", "bf16").replace("float", "fp")
        out.append(dict(engine=f"vLLM {v['vllm']} {v['dtype'].replace('bfloat16', 'bf16')}", kv=kv,
                        decoding=v.get("most_decoding_steps") or v.get("most_running_steps"),
                        decode_tps=v["decode_tps"], output_tps=v["output_tps"], ttft_p50=v["ttft"][0],
                        correct=f"{v['correct']}/{v['requests']}", label=f"vLLM {kv}"))
    for path in args.llamacpp:
        lc = json.loads(Path(path).read_text())
        for r in lc["runs"]:
            out.append(dict(engine="llama.cpp", kv=r.get("kv", "?"), decoding=r.get("slots") or r.get("most_decoding"),
                            decode_tps=r.get("decode_tps", float("nan")), output_tps=r.get("output_tps", float("nan")),
                            ttft_p50=(r.get("ttft") or [float("nan")])[0],
                            correct=f"{r.get('correct', '?')}/{r.get('requests', '?')}"))
    return out


def table(out: list[dict], against: str | None) -> str:
    base = next((r for r in out if against and (r.get("label") == against or r["engine"] == against)), None) or \
        next((r for r in out if r["engine"].startswith("vLLM")), None)
    x = lambda r, k: f"{r[k] / base[k]:.2f}×" if base and base[k] else "—"           # noqa: E731
    lines = ["| engine | KV | jobs decoding | decode tok/s | × | end-to-end out tok/s | × | TTFT p50 s | answers |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out:
        lines.append(f"| {r['engine']} | {r['kv']} | {r['decoding']} | {r['decode_tps']:.1f} | {x(r, 'decode_tps')} | "
                     f"{r['output_tps']:.2f} | {x(r, 'output_tps')} | {r['ttft_p50']:.1f} | {r['correct']} |")
    if base:
        lines.append(f"\n× against {base.get('label', base['engine'])}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a peer's script on this checkout's jobs")
    r.add_argument("peer", choices=sorted(SCRIPTS))
    r.add_argument("--peers-dir", type=Path, default=PEERS)
    t = sub.add_parser("table", help="one table of kvplan's and the peers' runs")
    t.add_argument("--serve", help="a bench.serve JSON")
    t.add_argument("--vllm", nargs="*", default=[])
    t.add_argument("--llamacpp", nargs="*", default=[])
    t.add_argument("--against", help='the row ratios are taken against, e.g. "vLLM fp8"')
    t.add_argument("--out", type=Path)
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "run":
        sys.exit(run(args.peer, args.peers_dir, extra))
    if extra:
        ap.error(f"unknown arguments {extra}")
    out = rows(args)
    if not out:
        ap.error("give --serve and/or peer results")
    text = table(out, args.against)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(dict(rows=out, table=text), indent=1))


if __name__ == "__main__":
    main()
