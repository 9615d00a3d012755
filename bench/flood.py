"""One tenant floods, three others keep working (issue 33's acceptance), against the topology of
`kvplan up` with API keys: a redis-server job queue, planner, cachestore, executor and the HTTP
API as separate processes on free loopback ports.

    python -m bench.flood [--flood-s 2] [--flood-requests 500] [--requests 6] [--out DIR]

1. alone: three light tenants, each sending `--requests` short streamed requests one after
   another (half over HTTP with the `openai` client, half over gRPC), all three at once: their
   TTFT (request sent -> first text);
2. flood: the fourth tenant sends `--flood-requests` streamed requests within `--flood-s` seconds
   (a bounded loop, half HTTP, half gRPC; beyond its queue quota and rate they are refused, 429 /
   RESOURCE_EXHAUSTED) while the light tenants send the same load as alone. The flooder is a
   client process of its own, as another user's program is: in the light tenants' event loop its
   500 requests' client work starved their clients (their first requests' TTFT 3.8 s, the
   executor's own TTFT for them ~0.5 s);
3. 10 s after the flood's last request: every service's health;
4. every job the flood got accepted must end (DONE, or FAILED / CANCELLED with its reason):
   a job still waiting or running once the queue drained, or gone, is lost.

Writes DIR/flood.json and prints a markdown table: the light tenants' TTFT p50 / p99 alone and
under the flood, their ratio, services NOT_SERVING after 10 s, lost jobs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import tempfile
import time
from pathlib import Path

import grpc
import openai

from kvplan import cluster
from kvcore import keyfile
from kvplan.client import request
from kvcore.config import ClusterConfig, ModelConfig, from_env
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc

LIGHT = ("t1", "t2", "t3")
FLOOD = "flood"
MODEL = "SmolLM2-135M-Instruct"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def _cluster_env(state: Path) -> None:
    """`kvplan up` on free ports, with keys, a Redis of its own, no metrics port clashes."""
    from cachestore.process import free_port
    os.environ.update(KVPLAN_STATE_DIR=str(state), KVPLAN_AUTH="on")
    for name in ("PLANNER", "CACHESTORE", "EXECUTOR"):
        os.environ[f"KVPLAN_{name}_PORT"] = str(free_port())
        os.environ[f"KVPLAN_{name}_METRICS_PORT"] = str(free_port())
    os.environ["KVPLAN_HTTP_PORT"] = str(free_port())
    for k in ("KVPLAN_REDIS_URL", "KVPLAN_EXECUTOR_ADDR", "KVPLAN_AUTH_KEYS_FILE", "KVPLAN_API_KEY"):
        os.environ.pop(k, None)


class Load:
    """The clients of one run: a gRPC channel and an HTTP client per tenant key."""

    def __init__(self, grpc_addr: str, http_addr: str, keys: dict[str, str], new_tokens: int):
        self.grpc_addr, self.http_addr, self.keys, self.new_tokens = grpc_addr, http_addr, keys, new_tokens
        self.channel = grpc.aio.insecure_channel(grpc_addr)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)
        self.http = {t: openai.AsyncOpenAI(base_url=f"http://{http_addr}/v1", api_key=k, max_retries=0, timeout=900)
                     for t, k in keys.items()}

    async def one(self, tenant: str, prompt: str, over_http: bool) -> dict:
        """One streamed request -> {ttft_s, job_id, refused, error, done}."""
        out = {"tenant": tenant, "http": over_http, "ttft_s": None, "job_id": "", "refused": "", "error": "",
               "done": False}
        t0 = time.perf_counter()
        try:
            if over_http:
                stream = await self.http[tenant].chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=self.new_tokens,
                    stream=True)
                async for chunk in stream:
                    out["job_id"] = chunk.id.split("-", 1)[1]
                    if chunk.choices and chunk.choices[0].delta.content and out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    if chunk.choices and chunk.choices[0].finish_reason:
                        out["done"] = True
            else:
                md = (("authorization", f"Bearer {self.keys[tenant]}"),)
                async for ev in self.stub.Generate(request(prompt, max_new_tokens=self.new_tokens), metadata=md,
                                                   timeout=900):
                    out["job_id"] = ev.job_id
                    if ev.HasField("delta") and ev.delta.text and out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    if ev.HasField("result"):
                        out["done"] = True                 # the executor's own view: where the time went
                        out["server"] = dict(ttft_s=ev.result.ttft_s, queue_s=ev.result.queue_s,
                                             prefill_s=ev.result.prefill_s)
                    if ev.HasField("status") and ev.status.state in (pb.FAILED, pb.CANCELLED):
                        out["error"] = ev.status.error or pb.JobState.Name(ev.status.state)
        except (openai.APIStatusError, grpc.aio.AioRpcError) as e:
            code = str(e.status_code) if isinstance(e, openai.APIStatusError) else e.code().name
            out["error" if out["job_id"] else "refused"] = code          # refused: before any job existed
        except Exception as e:                 # a failed request is counted, not fatal to the bench
            out["error"] = f"{type(e).__name__}: {e}"
        return out

    async def light(self, n: int, gap_s: float) -> list[dict]:
        """Each light tenant: n requests one after another (HTTP and gRPC in turn), all tenants at once."""
        async def tenant(t: str, k: int) -> list[dict]:
            got = []
            for i in range(n):
                got.append(await self.one(t, f"In one sentence: what is {3 + i + 7 * k} times {k + 2}?", i % 2 == 0))
                await asyncio.sleep(gap_s)
            return got
        return [r for rs in await asyncio.gather(*(tenant(t, k) for k, t in enumerate(LIGHT))) for r in rs]

    async def flood(self, n: int, seconds: float) -> tuple[list[dict], float]:
        """n requests of the flooding tenant spread over `seconds` (a bounded loop) -> (results, end)."""
        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + seconds * i / n - time.perf_counter()))
            tasks.append(asyncio.create_task(self.one(FLOOD, f"Write one short line about the number {i}.", i % 2 == 1)))
        end = time.perf_counter()
        return await asyncio.gather(*tasks), end

    async def close(self) -> None:
        await self.channel.close()
        for c in self.http.values():
            await c.close()


def _flooder(grpc_addr: str, http_addr: str, key: str, new_tokens: int, n: int, seconds: float, conn) -> None:
    """The flooding tenant as a client of its own (a process with its own event loop, as another
    user's program is): its requests' client work must not stall the light tenants' clients, whose
    TTFT the bench reports. Sends "ready", then (its results, the wall time its loop ended)."""
    async def run() -> tuple[list[dict], float]:
        load = Load(grpc_addr, http_addr, {FLOOD: key}, new_tokens)
        try:
            conn.send("ready")
            results, end = await load.flood(n, seconds)
            return results, time.time() - (time.perf_counter() - end)       # perf_counter -> wall time
        finally:
            await load.close()
    conn.send(asyncio.run(run()))


async def _states(addr: str, admin: str, job_ids: list[str]) -> dict[str, str]:
    async with grpc.aio.insecure_channel(addr) as ch:
        stub, md, out = executor_pb2_grpc.ExecutorStub(ch), (("authorization", f"Bearer {admin}"),), {}
        for j in job_ids:
            try:
                out[j] = pb.JobState.Name((await stub.GetJob(pb.JobRef(job_id=j), metadata=md, timeout=30)).state)
            except grpc.aio.AioRpcError as e:
                out[j] = e.code().name
        return out


async def _scenario(args, members, state: Path) -> dict:
    addr = {m.name: m.address for m in members}
    keys = {t: keyfile.add_key(state / keyfile.KEYS_FILE, t, "user") for t in (*LIGHT, FLOOD)}
    admin = (state / keyfile.ADMIN_KEY_FILE).read_text().strip()
    time.sleep(1.2)                                            # the servers read the keys file again
    load = Load(addr["executor"], addr["http"], keys, args.new_tokens)
    try:
        await load.light(1, 0.0)                               # warm: every path once
        alone = await load.light(args.requests, args.gap_s)
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_flooder, args=(addr["executor"], addr["http"], keys[FLOOD], args.new_tokens,
                                                  args.flood_requests, args.flood_s, child), daemon=True)
        proc.start()
        await asyncio.to_thread(conn.recv)                     # its clients are made: the flood begins
        await asyncio.sleep(0.3)                               # the flood is on
        under = await load.light(args.requests, args.gap_s)
        flood, flood_end = await asyncio.to_thread(conn.recv)
        proc.join(30)
        await asyncio.sleep(max(0.0, flood_end + 10 - time.time()))
        health = {name: h for name, _, _, h in cluster.status(from_env(ClusterConfig), from_env(ModelConfig))}
        accepted = [r["job_id"] for r in flood + alone + under if r["job_id"]]
        deadline = time.monotonic() + args.drain_s
        while True:
            states = await _states(addr["executor"], admin, accepted)
            if all(s in ("DONE", "FAILED", "CANCELLED") for s in states.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
    finally:
        await load.close()
    lost = [j for j, s in states.items() if s not in ("DONE", "FAILED", "CANCELLED")]
    return dict(
        alone=_summary(alone), under_flood=_summary(under),
        flood=dict(sent=len(flood), accepted=sum(1 for r in flood if r["job_id"]),
                   refused={k: sum(1 for r in flood if r["refused"] == k) for k in {r["refused"] for r in flood} if k},
                   completed=sum(1 for r in flood if r["done"]), stream_errors=[r["error"] for r in flood if r["error"]],
                   end_s=flood_end),
        not_serving_10s_after=[n for n, h in health.items() if h not in ("SERVING", "UP")], health=health,
        states={s: list(states.values()).count(s) for s in set(states.values())}, lost=lost)


def _summary(rs: list[dict]) -> dict:
    ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
    server = [r["server"] for r in rs if r.get("server")]
    return dict(n=len(rs), ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), ttft=ttft,
                errors=[r["error"] or r["refused"] for r in rs if r["error"] or r["refused"]],
                server_ttft_p50=pct([x["ttft_s"] for x in server], 50),
                server_ttft_p99=pct([x["ttft_s"] for x in server], 99),
                server_prefill_p50=pct([x["prefill_s"] for x in server], 50),
                server_queue_p50=pct([x["queue_s"] for x in server], 50))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood-s", type=float, default=2.0)
    ap.add_argument("--flood-requests", type=int, default=500)
    ap.add_argument("--requests", type=int, default=6, help="requests per light tenant, alone and under the flood")
    ap.add_argument("--gap-s", type=float, default=0.5, help="a light tenant's pause between its requests")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--drain-s", type=float, default=900.0, help="how long the flood's jobs may take to end")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "flood")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvplan-flood-") as tmp:
        state = Path(tmp) / "state"
        _cluster_env(state)
        members = cluster.up(from_env(ClusterConfig), from_env(ModelConfig))
        try:
            res = asyncio.run(_scenario(args, members, state))
        finally:
            cluster.down(from_env(ClusterConfig), from_env(ModelConfig))
    res.update(bench="flood", machine=platform.machine(), cpus=os.cpu_count(), args={
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    a, u = res["alone"], res["under_flood"]
    res["ttft_p99_ratio"] = u["ttft_p99"] / a["ttft_p99"] if a["ttft_p99"] else float("nan")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flood.json").write_text(json.dumps(res, indent=1))
    f = res["flood"]
    print("| light tenants' TTFT | p50 s | p99 s | requests | errors |")
    print("|---|---:|---:|---:|---:|")
    print(f"| alone | {a['ttft_p50']:.2f} | {a['ttft_p99']:.2f} | {a['n']} | {len(a['errors'])} |")
    print(f"| under the flood | {u['ttft_p50']:.2f} | {u['ttft_p99']:.2f} | {u['n']} | {len(u['errors'])} |")
    print(f"\nTTFT p99 under the flood / alone: {res['ttft_p99_ratio']:.2f}x; flood: {f['sent']} sent, "
          f"{f['accepted']} accepted, refused {f['refused']}, {f['completed']} completed; NOT_SERVING 10 s after "
          f"the flood: {res['not_serving_10s_after'] or 'none'}; lost jobs: {len(res['lost'])} ({args.out})")


if __name__ == "__main__":
    main()
