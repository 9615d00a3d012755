"""The chaos soak (issue 23): ~40 jobs over ~5 minutes against `kvplan up` with API keys on, a
second executor, a redis-server with a password and append-only persistence, and the
cachestore, while an executor, the cachestore and the planner are SIGKILLed and Redis is killed
and started again at seeded random times (each killed service is started again a few seconds
later, as a supervisor would). Every job ends DONE exactly once, or FAILED with a reason after
its attempts; nothing is lost; no segment is left in /dev/shm; executor RSS stays flat. It prints
jobs, faults, lost and the final states.

Marked `soak` (and slow): it runs for minutes, so the default `make test` leaves it out;
`make soak` (or `pytest -m soak tests/test_soak.py -s`) runs it."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil
import pytest

from cachestore.process import free_port
from cachestore.segment import leftovers
from kvplan.client import ExecutorClient, request
from protos import executor_pb2 as pb
from tests.procs import ROOT, RedisProc, Service, base_env

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(1800)]

SEED = int(os.environ.get("KVPLAN_SOAK_SEED", "23"))
JOBS, SUBMIT_OVER_S, FAULTS = 40, 240.0, 8
STRATEGIES = [("full", None), ("snapkv", 0.5), ("specache", 0.5), ("streaming_llm", 0.5), ("specache", 0.3)]
CONTEXT = ("The Meridian Line is a night train that leaves Lisbon at 21:40 and reaches Madrid at 07:15. Its "
           "dining car serves grilled sardines, and the conductor, Ines Rocha, has worked on the line for "
           "nineteen years. ")


def _kvplan(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvplan.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


class Cluster:
    """`kvplan up` (planner, cachestore, executor, HTTP API) on a Redis of ours, plus a second
    executor; kills and starts again any of them."""

    def __init__(self, tmp: Path):
        self.tmp, self.state = tmp, tmp / "state"
        self.redis = RedisProc(tmp)
        self.env = base_env(KVPLAN_STATE_DIR=str(self.state), KVPLAN_REDIS_URL=self.redis.url, KVPLAN_AUTH="on",
                            KVPLAN_CLAIM_IDLE_MS="4000", KVPLAN_HEARTBEAT_MS="500", KVPLAN_MAX_ATTEMPTS="4",
                            KVPLAN_PLAN_DEADLINE_S="5", KVPLAN_REDIS_RETRY_S="1", KVPLAN_MAX_SEQS="4")
        for name in ("PLANNER", "CACHESTORE", "EXECUTOR"):
            self.env[f"KVPLAN_{name}_PORT"] = str(free_port())
            self.env[f"KVPLAN_{name}_METRICS_PORT"] = str(free_port())
        self.env["KVPLAN_HTTP_PORT"] = str(free_port())
        up = _kvplan("up", env=self.env)
        assert up.returncode == 0, up.stdout + up.stderr
        self.admin = (self.state / "admin.key").read_text().strip()
        self.members = {m["name"]: m for m in json.loads((self.state / "cluster.json").read_text())["members"]}
        self.service_env = {**self.env, "KVPLAN_AUTH_KEYS_FILE": str(self.state / "keys.json"),
                            "KVPLAN_API_KEY": self.admin,
                            "KVPLAN_PLANNER_ADDR": self.members["planner"]["address"],
                            "KVPLAN_CACHESTORE_ADDR": self.members["cachestore"]["address"],
                            "KVPLAN_EXECUTOR_ADDR": self.members["executor"]["address"]}
        self.second = Service("executor", tmp, {**self.service_env, "KVPLAN_EXECUTOR_ID": "soak-exec-2"},
                              name="executor-2")
        self.second.start()
        self.extra: list[subprocess.Popen] = []          # members started again by us

    def executors(self) -> list[str]:
        return [self.members["executor"]["address"], self.second.address]

    def pid(self, name: str) -> int:
        return self.second.proc.pid if name == "executor-2" else self.members[name]["pid"]

    def kill(self, name: str) -> None:
        if name == "redis":
            self.redis.kill()
        elif name == "executor-2":
            self.second.kill()
        else:
            pid = self.members[name]["pid"]
            os.kill(pid, signal.SIGKILL)
            try:
                psutil.Process(pid).wait(30)
            except psutil.NoSuchProcess:
                pass

    def restart(self, name: str) -> None:
        if name == "redis":
            self.redis.start()
        elif name == "executor-2":
            self.second.start(wait_s=0)
        else:
            m = self.members[name]
            env = {**self.service_env, f"KVPLAN_{name.upper()}_PORT": m["address"].rsplit(":", 1)[1]}
            p = subprocess.Popen([sys.executable, "-m", "kvplan.cli", "serve", name], cwd=ROOT, env=env,
                                 stdin=subprocess.DEVNULL, stdout=open(self.state / f"{name}.log", "ab"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
            m["pid"] = p.pid
            self.extra.append(p)
            (self.state / "cluster.json").write_text(json.dumps({"members": list(self.members.values())}))

    def down(self) -> None:
        """Members we started again are our children: we stop (and reap) them; `kvplan down` the rest."""
        self.second.stop()
        for p in self.extra:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
        down = _kvplan("down", env=self.env)
        self.redis.stop()
        assert down.returncode == 0, down.stderr


def test_chaos_soak(tmp_path, real_model_dir, monkeypatch, capsys):
    rng = random.Random(SEED)
    cluster = Cluster(tmp_path)
    tenant = f"soak-{rng.randrange(16**6):06x}"
    keys = _kvplan("keys", "add", "--tenant", tenant, "--role", "user", env=cluster.env)
    assert keys.returncode == 0, keys.stderr
    monkeypatch.setenv("KVPLAN_API_KEY", keys.stdout.strip())
    victims = ["executor", "executor-2", "cachestore", "planner", "redis"]
    plan = sorted((rng.uniform(15, SUBMIT_OVER_S + 20), victims[i % len(victims)]) for i in range(FAULTS))
    faults: list[tuple[float, str]] = []
    rss: dict[int, list[int]] = {}
    accepted: list[str] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def chaos():
        for at, name in plan:
            if stop.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            cluster.kill(name)
            faults.append((round(time.monotonic() - t0, 1), name))
            stop.wait(rng.uniform(2, 6))              # down a while, then a supervisor starts it again
            cluster.restart(name)

    def sample():
        while not stop.wait(2.0):
            for name in ("executor", "executor-2"):
                try:
                    rss.setdefault(cluster.pid(name), []).append(psutil.Process(cluster.pid(name)).memory_info().rss)
                except psutil.NoSuchProcess:
                    pass

    threads = [threading.Thread(target=chaos, daemon=True), threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    try:
        for i in range(JOBS):
            strategy, ratio = STRATEGIES[i % len(STRATEGIES)]
            req = request(CONTEXT * rng.randint(1, 6), question="Who is the conductor?", strategy=strategy,
                          reserve_ratio=ratio, max_new_tokens=rng.randint(8, 40))
            accepted.append(_submit(cluster, req, rng))
            time.sleep(max(0.0, (i + 1) * SUBMIT_OVER_S / JOBS - (time.monotonic() - t0)))
        threads[0].join(SUBMIT_OVER_S + 120)               # every fault injected (and recovered from)
        final = _wait_all(cluster, accepted, deadline_s=900)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        cluster.down()
    states = Counter(pb.JobState.Name(s.state) for s in final.values())
    lost = [j for j in accepted if final.get(j) is None or final[j].state not in (pb.DONE, pb.FAILED)]
    failed_without_reason = [j for j, s in final.items() if s.state == pb.FAILED and not s.error]
    left = [n for n in leftovers() if tenant in n]
    flat = {pid: _growth(v) for pid, v in rss.items() if len(v) >= 30}
    with capsys.disabled():
        print(f"\nsoak (seed {SEED}): {len(accepted)} jobs, {len(faults)} faults {faults}, lost {len(lost)}, "
              f"states {dict(states)}, results per DONE job {dict(Counter(final_results.values()))}, "
              f"attempts {dict(Counter(s.attempts for s in final.values()))}, "
              f"degraded {sum(s.result.degraded for s in final.values())}, "
              f"segments left {len(left)}, executor RSS growth (last/second quarter) "
              f"{ {p: round(g, 3) for p, g in flat.items()} }, {time.monotonic() - t0:.0f}s")
    assert len(faults) == FAULTS and not lost and not failed_without_reason
    assert all(n == 1 for n in final_results.values()), final_results
    assert not left, left
    assert all(g < 1.3 for g in flat.values()), flat


final_results: dict[str, int] = {}


def _submit(cluster: Cluster, req, rng) -> str:
    """Submit to a live executor, retrying UNAVAILABLE (a killed one, Redis down) with backoff."""
    deadline = time.monotonic() + 300
    while True:
        addr = rng.choice(cluster.executors())
        try:
            with ExecutorClient(addr, timeout_s=30) as c:
                return c.submit(req).job_id
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.RESOURCE_EXHAUSTED), f"{e.code().name}: {e.details()}"
            assert time.monotonic() < deadline, "no executor accepted a job for 5 minutes"
            time.sleep(1.0)


def _wait_all(cluster: Cluster, jobs: list[str], deadline_s: float) -> dict[str, pb.JobStatus]:
    """Every job's final status (DONE / FAILED / CANCELLED), and its result events counted."""
    final: dict[str, pb.JobStatus] = {}
    deadline = time.monotonic() + deadline_s
    while len(final) < len(jobs) and time.monotonic() < deadline:
        for j in [j for j in jobs if j not in final]:
            for addr in cluster.executors():
                try:
                    with ExecutorClient(addr, timeout_s=30) as c:
                        st = c.get(j)
                        if st.state in (pb.DONE, pb.FAILED, pb.CANCELLED):
                            final[j] = st
                            if st.state == pb.DONE:
                                final_results[j] = sum(ev.HasField("result") for ev in c.watch(j))
                    break
                except grpc.RpcError:
                    continue
        time.sleep(1.0)
    return final


def _growth(samples: list[int]) -> float:
    """The mean RSS of the last quarter of one process's samples over that of its second quarter."""
    q = len(samples) // 4
    second, last = samples[q:2 * q], samples[-q:]
    return (sum(last) / len(last)) / (sum(second) / len(second))
