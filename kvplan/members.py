"""A member of a `kvplan up` cluster as a process: its record in the state dir's cluster.json,
its start (`kvplan serve NAME` or a redis-server, logging to NAME.log in the state dir), its
health, its stop; the cluster's Redis config. `kvplan.cluster` composes them into up, down,
status and restart."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvcore.serving import check_health


@dataclass(frozen=True)
class Member:
    name: str
    pid: int
    address: str      # gRPC address, or the redis URL

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def port_free(port: int) -> bool:
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

def is_alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

def spawn(name: str, argv: list[str], env: dict[str, str], d: Path) -> subprocess.Popen:
    log = open(d / f"{name}.log", "ab")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)

def start(name: str, address: str, env: dict[str, str], d: Path) -> Member:
    """Spawn member `name` at `address` (redis: its state dir's redis.conf, which names the port)."""
    if name == "redis":
        p = spawn("redis", ["redis-server", str(d / "redis.conf")], env, d)
        wait_redis(int(address.rsplit(":", 1)[1].split("/")[0]))
        return Member("redis", p.pid, address)
    return Member(name, spawn(name, [sys.executable, "-m", "kvplan.cli", "serve", name], env, d).pid, address)

def wait_serving(m: Member, d: Path, deadline: float, timeout_s: float, ticker) -> None:
    ticker.say(f"waiting for the {m.name} to serve")
    while member_health(m) != "SERVING":
        ticker.note(last_line(d / f"{m.name}.log"))
        if not is_alive(m.pid):
            raise RuntimeError(f"{m.name} exited during start-up; log: {d / (m.name + '.log')}\n"
                               + tail(d / f"{m.name}.log"))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{m.name} not SERVING after {timeout_s:.0f}s; log: {d / (m.name + '.log')}")
        time.sleep(0.3)

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

def write_members(d: Path, members: list[Member]) -> None:
    (d / "cluster.json").write_text(json.dumps({"members": [m.__dict__ for m in members]}, indent=1))

def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

def last_line(path: Path) -> str:
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

def stop_all(members: list[Member], grace_s: float = 15.0) -> list[str]:
    stopped = []
    for m in reversed(members):
        if not is_alive(m.pid):
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

def member_health(m: Member) -> str:
    """A member's health: grpc.health.v1 for the gRPC services, GET /health for the HTTP API."""
    if m.name != "http":
        return check_health(m.address)
    from kvplan.healthcheck import http_health
    return http_health(m.address)
