"""`kvplan up/down/status`: the docker-compose topology as local background processes on
loopback: a redis-server (when installed and KVPLAN_REDIS_URL is unset), planner, cachestore,
executor, and the OpenAI-compatible HTTP API over the executor. Pid files, logs and the
addresses live in the state dir. While `up` waits for a service to serve, a status line says
which, for how long, and the last line of its log (`kvplan.ticker`): a first run converts the
model and builds the CPU kernels, about a minute."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvplan.config import (CachestoreConfig, ClusterConfig, ExecutorConfig, HttpConfig, ModelConfig, PlannerConfig,
                           from_env)
from kvplan import keyfile
from kvplan.serving import check_health

SERVICES = ("planner", "cachestore", "executor", "http")        # start order; stopped in reverse


@dataclass(frozen=True)
class Member:
    name: str
    pid: int
    address: str      # gRPC address, or the redis URL


def state_dir(cfg: ClusterConfig, model_cfg: ModelConfig) -> Path:
    return Path(cfg.state_dir or Path(model_cfg.cache_dir) / "cluster")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    """Whether a server could listen on `port` now. SO_REUSEADDR, as the servers bind (gRPC and
    uvicorn set it): a port whose last connections linger in TIME_WAIT after `kvplan down` is
    free — without it `kvplan up` said "port 8000 is taken" for up to a minute."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def read_members(d: Path) -> list[Member]:
    f = d / "cluster.json"
    if not f.exists():
        return []
    return [Member(**m) for m in json.loads(f.read_text())["members"]]


def _alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Unhealthy(RuntimeError):
    """A `kvplan up` cluster is up (some of its processes live) but its executor does not serve."""


def running_executor(cfg: ClusterConfig, model_cfg: ModelConfig) -> str | None:
    """The executor address of the `kvplan up` cluster; None when no cluster is up (no state, or
    every process of it gone). `Unhealthy` when one is up but its executor does not answer
    SERVING: the CLI says so, rather than running a job elsewhere without the cluster's keys."""
    members = read_members(state_dir(cfg, model_cfg))
    alive = [m for m in members if _alive(m.pid)]
    if not alive:
        return None
    health = {m.name: member_health(m) if m.name != "redis" else "UP" for m in alive}
    executor = next((m for m in alive if m.name == "executor"), None)
    if executor is not None and health["executor"] == "SERVING":
        return executor.address
    rows = ", ".join(f"{m.name} {health.get(m.name, 'DEAD') if _alive(m.pid) else 'DEAD'}" for m in members)
    raise Unhealthy(f"cluster unhealthy ({rows}; state in {state_dir(cfg, model_cfg)}): `kvplan status` shows "
                    "it, the logs are in the state dir; `kvplan down` stops it")


def _spawn(name: str, argv: list[str], env: dict[str, str], d: Path) -> subprocess.Popen:
    log = open(d / f"{name}.log", "ab")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def up(cfg: ClusterConfig, model_cfg: ModelConfig, echo=None) -> list[Member]:
    """Start the cluster; each service's line is `echo`ed (default: printed, above the status line
    a terminal shows while it waits)."""
    from kvplan.ticker import Ticker
    with Ticker("starting the cluster") as ticker:
        return _up(cfg, model_cfg, echo or ticker.echo, ticker)


def _up(cfg: ClusterConfig, model_cfg: ModelConfig, echo, ticker) -> list[Member]:
    d = state_dir(cfg, model_cfg)
    d.mkdir(parents=True, exist_ok=True)
    existing = [m for m in read_members(d) if _alive(m.pid)]
    if existing:
        echo(f"kvplan: a cluster is already up (state in {d}); `kvplan down` stops it")
        return existing
    env = dict(os.environ)
    pcfg, ccfg, ecfg = from_env(PlannerConfig), from_env(CachestoreConfig), from_env(ExecutorConfig)
    hcfg = from_env(HttpConfig)
    for name, c in (("planner", pcfg), ("cachestore", ccfg), ("executor", ecfg), ("http", hcfg)):
        if not _port_free(c.port):
            raise RuntimeError(f"{name} port {c.port} on 127.0.0.1 is taken; set KVPLAN_{name.upper()}_PORT")
    env["KVPLAN_PLANNER_ADDR"] = f"127.0.0.1:{pcfg.port}"
    env["KVPLAN_CACHESTORE_ADDR"] = f"127.0.0.1:{ccfg.port}"
    env["KVPLAN_EXECUTOR_ADDR"] = f"127.0.0.1:{ecfg.port}"       # the HTTP API's executor
    d.chmod(0o700)                                     # keys, the Redis password and logs: this user's only
    env.update(keyfile.cluster_keys(d, env))              # API keys on: an admin key for the CLI, one for the services
    members: list[Member] = []
    try:
        redis_url = cfg.redis_url
        if not redis_url and shutil.which("redis-server"):
            port = _free_port()
            password = redis_config(d, port)
            p = _spawn("redis", ["redis-server", str(d / "redis.conf")], env, d)
            redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
            members.append(Member("redis", p.pid, f"redis://127.0.0.1:{port}/0"))   # no password in cluster.json
            wait_redis(port)
        env["KVPLAN_REDIS_URL"] = redis_url
        if not redis_url:
            echo("kvplan: redis-server not installed; the executor keeps its job queue in process")
        for name in SERVICES:
            p = _spawn(name, [sys.executable, "-m", "kvplan.cli", "serve", name], env, d)
            port = {"planner": pcfg, "cachestore": ccfg, "executor": ecfg, "http": hcfg}[name].port
            members.append(Member(name, p.pid, f"127.0.0.1:{port}"))
        _write(d, members)
        deadline = time.monotonic() + cfg.start_timeout_s
        for m in members[-len(SERVICES):]:
            ticker.say(f"waiting for the {m.name} to serve")
            while member_health(m) != "SERVING":
                ticker.note(_last_line(d / f"{m.name}.log"))
                if not _alive(m.pid):
                    raise RuntimeError(f"{m.name} exited during start-up; log: {d / (m.name + '.log')}\n"
                                       + _tail(d / f"{m.name}.log"))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{m.name} not SERVING after {cfg.start_timeout_s:.0f}s; "
                                       f"log: {d / (m.name + '.log')}")
                time.sleep(0.3)
            echo(f"kvplan: {m.name:<10} SERVING  {m.address}  pid {m.pid}")
    except BaseException:
        _stop_all(members)
        (d / "cluster.json").unlink(missing_ok=True)
        raise
    return members


def redis_config(d: Path, port: int) -> str:
    """A redis.conf (0600) for the cluster's Redis: loopback, a password, append-only persistence
    (queued and running jobs survive a Redis restart). -> the password"""
    password = secrets.token_urlsafe(24)
    fd = os.open(d / "redis.conf", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"port {port}\nbind 127.0.0.1\nrequirepass {password}\nsave \"\"\nappendonly yes\n"
                f"appendfsync everysec\ndir {d}\n")
    return password


def wait_redis(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):     # up (a password is asked first)
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"redis-server on port {port} did not answer PING")


def _write(d: Path, members: list[Member]) -> None:
    (d / "cluster.json").write_text(json.dumps({"members": [m.__dict__ for m in members]}, indent=1))


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _last_line(path: Path) -> str:
    """The last line of a service's log without its timestamp: what it is doing."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    last = lines[-1] if lines else ""
    parts = last.split(" ", 2)                       # "2026-11-27 01:02:03,456 INFO name: message"
    return parts[2] if len(parts) == 3 and parts[0][:2].isdigit() else last


def _stop_all(members: list[Member], grace_s: float = 15.0) -> list[str]:
    stopped = []
    for m in reversed(members):
        if not _alive(m.pid):
            continue
        try:
            proc = psutil.Process(m.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        except psutil.NoSuchProcess:
            pass
        stopped.append(f"{m.name} (pid {m.pid})")
    return stopped


def down(cfg: ClusterConfig, model_cfg: ModelConfig, echo=print) -> None:
    d = state_dir(cfg, model_cfg)
    members = read_members(d)
    if not members:
        echo("kvplan: no cluster is up")
        return
    for s in _stop_all(members):
        echo(f"kvplan: stopped {s}")
    (d / "cluster.json").unlink(missing_ok=True)


def status(cfg: ClusterConfig, model_cfg: ModelConfig) -> list[tuple[str, int, str, str]]:
    """(name, pid, address, health) per member; health "DEAD" when the process is gone."""
    rows = []
    for m in read_members(state_dir(cfg, model_cfg)):
        if not _alive(m.pid):
            health = "DEAD"
        elif m.name == "redis":
            health = "UP"
        else:
            health = member_health(m)
        rows.append((m.name, m.pid, m.address, health))
    return rows


def member_health(m: Member) -> str:
    """A member's health: grpc.health.v1 for the gRPC services, GET /health for the HTTP API."""
    if m.name != "http":
        return check_health(m.address)
    from kvplan.healthcheck import http_health
    return http_health(m.address)
