"""The memory attacks of issue 42, repeated: what a caller without a key can make the services
hold. Real processes on free loopback ports, with API keys on: the planner (its probe model
loaded, so it holds freed memory as it serves), the cachestore, and the HTTP API (over no
executor: these attacks need none).

    python -m bench.hostile [--mb 50] [--calls 10] [--big-mb 200] [--big-calls 4] [--paths 10000] [--out DIR]

1. `--calls` keyless `--mb` MB `Plan` calls to the planner, one after another; the same with a
   key that is no key; the same as `Put` to the cachestore;
2. `--big-calls` keyless `--big-mb` MB `Plan` calls at once (peak RSS while they run);
3. `--calls` `--mb` MB `Plan` calls with a user key (read — gRPC must, to know the size — then
   refused by the role's limit, and the memory given back);
4. GETs of `--paths` distinct 2 KB paths at the HTTP API: `/metrics`' size before and after.

Each service's RSS is read before, at its peak (sampled every 10 ms) and 2 s after each attack.
Writes DIR/hostile.json and prints a markdown table with the ratio after/before side by side;
the acceptance: every RSS after within 10 % of before, `/metrics` flat.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import psutil

from cachestore.process import free_port
from kvcore import keyfile
from kvcore.serving import check_health


def _spawn(name: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvplan.cli", "serve", name], env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait(ready, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[-1]} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


class Rss:
    """A process's resident set: sampled every 10 ms in a thread while an attack runs."""

    def __init__(self, pid: int):
        self.proc, self.peak, self._run = psutil.Process(pid), 0, False

    def now(self) -> int:
        return self.proc.memory_info().rss

    def __enter__(self) -> "Rss":
        self.before, self.peak, self._run = self.now(), self.now(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._run:
            self.peak = max(self.peak, self.now())
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        time.sleep(2.0)                           # (a refused call's memory is given back 0.5 s after it)
        self._run = False
        self._thread.join()
        self.after = self.now()

    def row(self) -> dict:
        mib = lambda b: round(b / 2**20, 1)                                  # noqa: E731
        return {"before_mib": mib(self.before), "peak_mib": mib(self.peak), "after_mib": mib(self.after),
                "after_over_before": round(self.after / self.before, 3)}


def _calls(addr: str, method: str, key: str, mb: int, n: int, at_once: int = 1) -> list[str]:
    """n calls of `method` carrying an `mb` MB message (a string field 1 of that size), `at_once`
    concurrently -> their status codes."""
    raw = b"\x0a" + _varint(mb << 20) + b"x" * (mb << 20)
    md = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 1 << 30)]) as ch:
        rpc = ch.unary_unary(method, request_serializer=None, response_deserializer=None)

        def one(_):
            try:
                rpc(raw, metadata=md, timeout=120)
                return "OK"
            except grpc.RpcError as e:
                return e.code().name
        with futures.ThreadPoolExecutor(at_once) as pool:
            return list(pool.map(one, range(n)))


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _metrics_attack(url: str, paths: int) -> dict:
    size = lambda: len(urllib.request.urlopen(f"{url}/metrics", timeout=30).read())    # noqa: E731
    with httpx.Client(base_url=url, timeout=30) as c:
        c.get(f"/v1/{uuid.uuid4().hex}")                                   # (the `other` series exist)
        before, t0 = size(), time.perf_counter()
        codes = {}
        for i in range(paths):
            r = c.get(f"/v1/{uuid.uuid4().hex * 64}"[:2048])
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
    return {"paths": paths, "seconds": round(time.perf_counter() - t0, 2), "statuses": codes,
            "metrics_bytes_before": before, "metrics_bytes_after": size()}


def run(args) -> dict:
    state = Path(tempfile.mkdtemp(prefix="kvplan-hostile-"))
    keys = state / "keys.json"
    user = keyfile.add_key(keys, "acme", "user")
    service = keyfile.add_key(keys, "kvplan-services", "admin")
    ports = {n: free_port() for n in ("planner", "cachestore", "http", "pm", "cm")}
    env = {**os.environ, "KVPLAN_AUTH": "on", "KVPLAN_AUTH_KEYS_FILE": str(keys), "KVPLAN_API_KEY": service,
           "KVPLAN_PLANNER_PORT": str(ports["planner"]), "KVPLAN_PLANNER_METRICS_PORT": str(ports["pm"]),
           "KVPLAN_CACHESTORE_PORT": str(ports["cachestore"]), "KVPLAN_CACHESTORE_METRICS_PORT": str(ports["cm"]),
           "KVPLAN_HTTP_PORT": str(ports["http"]), "KVPLAN_EXECUTOR_ADDR": f"127.0.0.1:{free_port()}"}
    env.pop("KVPLAN_REDIS_URL", None)
    procs = {n: _spawn(n, env, state / f"{n}.log") for n in ("planner", "cachestore", "http")}
    addr = {n: f"127.0.0.1:{ports[n]}" for n in ("planner", "cachestore")}
    url = f"http://127.0.0.1:{ports['http']}"
    res: dict = {"args": vars(args) | {"out": str(args.out)}, "host": platform.node(), "cpus": os.cpu_count()}
    try:
        for n in ("planner", "cachestore"):
            _wait(lambda n=n: check_health(addr[n]) == "SERVING", procs[n], state / f"{n}.log")
        _wait(lambda: _answers(url), procs["http"], state / "http.log", 60)
        plan, put = "/kvplan.v1.Planner/Plan", "/kvplan.v1.CacheStore/Put"
        _calls(addr["planner"], plan, "", 1, 1)                             # (first-call costs out of the way)
        _calls(addr["cachestore"], put, "", 1, 1)
        attacks = [("planner", plan, "", args.mb, args.calls, 1, "keyless"),
                   ("planner", plan, "kvp_not-a-key", args.mb, args.calls, 1, "unknown key"),
                   ("planner", plan, "", args.big_mb, args.big_calls, args.big_calls, "keyless, at once"),
                   ("cachestore", put, "", args.mb, args.calls, 1, "keyless"),
                   ("planner", plan, user, args.mb, args.calls, 1, "user key over its limit")]
        res["attacks"] = []
        for service_name, method, key, mb, n, at_once, who in attacks:
            with Rss(procs[service_name].pid) as rss:
                codes = _calls(addr[service_name], method, key, mb, n, at_once)
            res["attacks"].append({"service": service_name, "method": method.rsplit("/", 1)[1], "caller": who,
                                   "mb": mb, "calls": n, "at_once": at_once,
                                   "codes": sorted(set(codes)), **rss.row()})
        res["metrics"] = _metrics_attack(url, args.paths)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    return res


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/metrics", timeout=2).status == 200
    except OSError:
        return False


def table(res: dict) -> str:
    rows = ["| service | call | caller | MB × calls (at once) | codes | RSS before MiB | peak | after | after/before |",
            "|---|---|---|---|---|---|---|---|---|"]
    for a in res["attacks"]:
        rows.append(f"| {a['service']} | {a['method']} | {a['caller']} | {a['mb']} × {a['calls']} ({a['at_once']}) | "
                    f"{', '.join(a['codes'])} | {a['before_mib']} | {a['peak_mib']} | {a['after_mib']} | "
                    f"{a['after_over_before']} |")
    m = res["metrics"]
    rows += ["", "| distinct paths | statuses | /metrics bytes before | after | after/before |", "|---|---|---|---|---|",
             f"| {m['paths']} | {m['statuses']} | {m['metrics_bytes_before']} | {m['metrics_bytes_after']} | "
             f"{m['metrics_bytes_after'] / m['metrics_bytes_before']:.3f} |"]
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50, help="MB per message (50)")
    ap.add_argument("--calls", type=int, default=10, help="calls per attack (10)")
    ap.add_argument("--big-mb", type=int, default=200, help="MB per message of the concurrent attack (200)")
    ap.add_argument("--big-calls", type=int, default=4, help="calls at once in the concurrent attack (4)")
    ap.add_argument("--paths", type=int, default=10000, help="distinct paths sent to the HTTP API (10000)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hostile")
    args = ap.parse_args(argv)
    for name in ("mb", "calls", "big_mb", "big_calls", "paths"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if max(args.mb, args.big_mb) > 250:
        ap.error("--mb and --big-mb must be at most 250 (the services' receive limit is 256 MiB)")
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hostile.json").write_text(json.dumps(res, indent=1))
    print(table(res))


if __name__ == "__main__":
    main()
