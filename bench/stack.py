"""The services a serving bench runs against: planner, cachestore and executor as separate
processes on free loopback ports (the topology of `kvplan up`, API keys off, the job queue in
the executor's process), with the executor settings the bench gives (its KV budget above all);
and the executor's Prometheus metrics, read over HTTP."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cachestore.process import free_port
from kvcore.serving import check_health

SERVICES = ("planner", "cachestore", "executor")


class Stack:
    def __init__(self, executor_env: dict[str, str], log_dir: Path, start_timeout_s: float = 300.0):
        self.executor_env, self.log_dir, self.start_timeout_s = executor_env, log_dir, start_timeout_s
        self.ports = {name: free_port() for name in SERVICES}
        self.metrics_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def executor_addr(self) -> str:
        return f"127.0.0.1:{self.ports['executor']}"

    def __enter__(self) -> "Stack":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KVPLAN_AUTH": "off", "KVPLAN_REDIS_URL": "",
               "KVPLAN_PLANNER_PORT": str(self.ports["planner"]), "KVPLAN_PLANNER_METRICS_PORT": "0",
               "KVPLAN_CACHESTORE_PORT": str(self.ports["cachestore"]), "KVPLAN_CACHESTORE_METRICS_PORT": "0",
               "KVPLAN_EXECUTOR_PORT": str(self.ports["executor"]),
               "KVPLAN_EXECUTOR_METRICS_PORT": str(self.metrics_port),
               "KVPLAN_PLANNER_ADDR": f"127.0.0.1:{self.ports['planner']}",
               "KVPLAN_CACHESTORE_ADDR": f"127.0.0.1:{self.ports['cachestore']}"}
        try:
            for name in SERVICES:
                log = open(self.log_dir / f"{name}.log", "ab")
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "kvplan.cli", "serve", name],
                    env={**env, **(self.executor_env if name == "executor" else {})},
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + self.start_timeout_s
            for name in SERVICES:
                while check_health(f"127.0.0.1:{self.ports[name]}") != "SERVING":
                    if self.procs[name].poll() is not None:
                        raise RuntimeError(f"{name} exited during start-up; see {self.log_dir / (name + '.log')}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} not SERVING after {self.start_timeout_s:.0f}s")
                    time.sleep(0.3)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """The executor's metrics now: {(sample name, sorted labels): value}."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)
