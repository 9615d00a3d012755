"""Real processes for the fault tests (tests/executor/test_redis_recovery.py, tests/test_soak.py):
a redis-server with a password and append-only persistence that can be killed and started again
on the same port and data, and kvplan services as `python -m NAME` processes on free ports."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cachestore.process import free_port
from kvcore.serving import check_health

ROOT = Path(__file__).resolve().parents[1]


class RedisProc:
    """redis-server on 127.0.0.1 with `requirepass` and `appendonly yes` in `d`; `kill()` is a
    SIGKILL, `start()` again serves the same port from the same append-only file."""

    def __init__(self, d: Path):
        self.d, self.port, self.password = d, free_port(), secrets.token_urlsafe(16)
        self.proc: subprocess.Popen | None = None
        conf = d / "redis.conf"
        conf.write_text(f"port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\nsave \"\"\n"
                        f"appendonly yes\nappendfsync always\ndir {d}\n")
        conf.chmod(0o600)
        self.start()

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed (apt-get install -y redis-server)"
        self.proc = subprocess.Popen([exe, str(self.d / "redis.conf")], stdout=open(self.d / "redis.log", "ab"),
                                     stderr=subprocess.STDOUT)
        import redis
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url, socket_timeout=1).ping()
                return
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                assert self.proc.poll() is None, (self.d / "redis.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "redis-server did not come up"
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class Service:
    """One kvplan service as a process (`python -m NAME`) on free ports, started again on the same
    ports after a kill."""

    def __init__(self, module: str, log_dir: Path, env: dict, name: str = ""):
        self.module, self.name, self.log_dir = module, name or module, log_dir
        var = module.upper()
        self.port = free_port()
        self.env = {**env, f"KVPLAN_{var}_PORT": str(self.port), f"KVPLAN_{var}_METRICS_PORT": str(free_port())}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, wait_s: float = 180) -> None:
        self.starts += 1
        log = open(self.log_dir / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module], cwd=ROOT, env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        if wait_s:
            self.wait_serving(wait_s)

    def wait_serving(self, wait_s: float = 180) -> None:
        deadline = time.monotonic() + wait_s
        while check_health(self.address) != "SERVING":
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name} not SERVING:\n{self.tail()}"
            time.sleep(0.2)

    def tail(self, n: int = 3000) -> str:
        return (self.log_dir / f"{self.name}.log").read_text(errors="replace")[-n:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLAN_") or k in ("KVPLAN_CACHE_DIR", "KVPLAN_MODEL")}
    return {**env, **extra}
