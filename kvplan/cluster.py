"""`kvplan up/down/status/restart`: the docker-compose topology as local background processes on
loopback: a redis-server (when installed and KVPLAN_REDIS_URL is unset), planner, cachestore,
executor, and the OpenAI-compatible HTTP API over the executor. Pid files, logs, the addresses
and the services' settings (`cluster.env.json`, 0600: their key and Redis password among them)
live in the state dir. While `up` waits for a service to serve, a status line says which, for
how long, and the last line of its log (`kvplan.ticker`): a first run converts the model and
builds the CPU kernels, about a minute.

`up` on a cluster that is up starts again what of it is dead or missing — same port, same
settings, same keys — and says what it did (before issue 42 it said "a cluster is already up"
over a SIGKILLed executor); `restart NAME` stops one member and starts it again the same way."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from kvcore import keyfile
from kvcore.config import (CachestoreConfig, ClusterConfig, ExecutorConfig, HttpConfig, ModelConfig, PlannerConfig,
                           from_env)
from kvplan.members import (Member, free_port, is_alive, member_health, port_free, read_members, redis_config, spawn,
                            start, stop_all, wait_redis, wait_serving, write_members)

SERVICES = ("planner", "cachestore", "executor", "http")        # start order; stopped in reverse
MEMBERS = ("redis", *SERVICES)
ENV_FILE = "cluster.env.json"       # the KVPLAN_* settings the services were started with (0600)


def state_dir(cfg: ClusterConfig, model_cfg: ModelConfig) -> Path:
    return Path(cfg.state_dir or Path(model_cfg.cache_dir) / "cluster")


class Unhealthy(RuntimeError):
    """A `kvplan up` cluster is up (some of its processes live) but its executor does not serve."""


def running_executor(cfg: ClusterConfig, model_cfg: ModelConfig) -> str | None:
    """The executor address of the `kvplan up` cluster; None when no cluster is up (no state, or
    every process of it gone). `Unhealthy` when one is up but its executor does not answer
    SERVING: the CLI says so, rather than running a job elsewhere without the cluster's keys."""
    members = read_members(state_dir(cfg, model_cfg))
    alive = [m for m in members if is_alive(m.pid)]
    if not alive:
        return None
    health = {m.name: member_health(m) if m.name != "redis" else "UP" for m in alive}
    executor = next((m for m in alive if m.name == "executor"), None)
    if executor is not None and health["executor"] == "SERVING":
        return executor.address
    rows = ", ".join(f"{m.name} {health.get(m.name, 'DEAD') if is_alive(m.pid) else 'DEAD'}" for m in members)
    raise Unhealthy(f"cluster unhealthy ({rows}; state in {state_dir(cfg, model_cfg)}): `kvplan status` shows "
                    "it, the logs are in the state dir; `kvplan down` stops it")


def up(cfg: ClusterConfig, model_cfg: ModelConfig, echo=None) -> list[Member]:
    """Start the cluster; each service's line is `echo`ed (default: printed, above the status line
    a terminal shows while it waits)."""
    from kvplan.ticker import Ticker
    with Ticker("starting the cluster") as ticker:
        return _up(cfg, model_cfg, echo or ticker.echo, ticker)


def _up(cfg: ClusterConfig, model_cfg: ModelConfig, echo, ticker) -> list[Member]:
    d = state_dir(cfg, model_cfg)
    d.mkdir(parents=True, exist_ok=True)
    existing = read_members(d)
    if any(is_alive(m.pid) for m in existing):
        return _revive(cfg, d, existing, echo, ticker)
    env = dict(os.environ)
    pcfg, ccfg, ecfg = from_env(PlannerConfig), from_env(CachestoreConfig), from_env(ExecutorConfig)
    hcfg = from_env(HttpConfig)
    for name, c in (("planner", pcfg), ("cachestore", ccfg), ("executor", ecfg), ("http", hcfg)):
        if not port_free(c.port):
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
            port = free_port()
            password = redis_config(d, port)
            p = spawn("redis", ["redis-server", str(d / "redis.conf")], env, d)
            redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
            members.append(Member("redis", p.pid, f"redis://127.0.0.1:{port}/0"))   # no password in cluster.json
            wait_redis(port)
        env["KVPLAN_REDIS_URL"] = redis_url
        if not redis_url:
            echo("kvplan: redis-server not installed; the executor keeps its job queue in process")
        _save_env(d, env)
        for name in SERVICES:
            port = {"planner": pcfg, "cachestore": ccfg, "executor": ecfg, "http": hcfg}[name].port
            members.append(start(name, f"127.0.0.1:{port}", env, d))
        write_members(d, members)
        deadline = time.monotonic() + cfg.start_timeout_s
        for m in members[-len(SERVICES):]:
            wait_serving(m, d, deadline, cfg.start_timeout_s, ticker)
            echo(f"kvplan: {m.name:<10} SERVING  {m.address}  pid {m.pid}")
    except BaseException:
        stop_all(members)
        (d / "cluster.json").unlink(missing_ok=True)
        raise
    return members


def _save_env(d: Path, env: dict[str, str]) -> None:
    """The services' KVPLAN_* settings, for starting one of them again later (only these: the
    rest of the caller's environment may hold secrets of its own)."""
    fd = os.open(d / ENV_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({k: v for k, v in env.items() if k.startswith("KVPLAN_")}, f, indent=1)


def _saved_env(d: Path) -> dict[str, str]:
    """This process's environment with the cluster's own settings over it."""
    try:
        saved = json.loads((d / ENV_FILE).read_text())
    except (OSError, ValueError):
        raise RuntimeError(f"the cluster in {d} keeps no settings to start a service with ({ENV_FILE}: it was "
                           "started by an older kvplan): `kvplan down`, then `kvplan up`") from None
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVPLAN_")}, **saved}


def _revive(cfg: ClusterConfig, d: Path, members: list[Member], echo, ticker,
            again: frozenset[str] = frozenset()) -> list[Member]:
    """Start again each member of a running cluster that is dead or missing, or named in `again`
    (stopped first), in start order, each on its port with the cluster's settings; wait until
    each serves. Echoes one line per member: what it is and what was done."""
    env, by_name = _saved_env(d), {m.name: m for m in members}
    names = [n for n in MEMBERS if n in by_name or n != "redis"]      # (a Redis of its own only if it had one)
    started: list[Member] = []
    running: list[Member] = []          # alive all along: said once the started ones serve
    try:
        for name in names:
            m = by_name.get(name)
            if m is not None and name in again:
                stop_all([m])
            if m is not None and is_alive(m.pid):
                running.append(m)
                continue
            address = m.address if m is not None else _address(name, env)
            if name != "redis" and not port_free(int(address.rsplit(":", 1)[1])):
                raise RuntimeError(f"{name}'s port {address} is taken by another process; free it, or `kvplan down` "
                                   "and `kvplan up` on other ports")
            new = start(name, address, env, d)
            by_name[name] = new
            started.append(new)
            write_members(d, [by_name[n] for n in MEMBERS if n in by_name])
            if name != "redis":
                wait_serving(new, d, time.monotonic() + cfg.start_timeout_s, cfg.start_timeout_s, ticker)
            was = "restarted" if name in again else ("was dead" if m is not None else "was missing")
            echo(f"kvplan: {name:<10} {'UP' if name == 'redis' else 'SERVING':<12} {address}  pid {new.pid}  "
                 f"({was}: started again)")
    except BaseException:
        stop_all(started)
        raise
    # a member that ran all along may not serve until its dead peer is back (the HTTP API while
    # its executor was dead): give it the start timeout, so `up` returns on a serving cluster;
    # one that still does not serve is said as it is (`kvplan status` exits 1 on it)
    deadline = time.monotonic() + (cfg.start_timeout_s if started else 0)
    for m in running:
        health = "UP" if m.name == "redis" else member_health(m)
        while health != "SERVING" and m.name != "redis" and time.monotonic() < deadline and is_alive(m.pid):
            ticker.say(f"waiting for the {m.name} to serve again")
            time.sleep(0.3)
            health = member_health(m)
        echo(f"kvplan: {m.name:<10} {health:<12} {m.address}  pid {m.pid}  (running)")
    if not started:
        echo(f"kvplan: the cluster is up, nothing to start (state in {d}); `kvplan restart NAME` restarts one "
             "member, `kvplan down` stops it")
    return [by_name[n] for n in MEMBERS if n in by_name]


def _address(name: str, env: dict[str, str]) -> str:
    """Where a member missing from cluster.json goes: its configured port."""
    cls = {"planner": PlannerConfig, "cachestore": CachestoreConfig, "executor": ExecutorConfig, "http": HttpConfig}
    return f"127.0.0.1:{from_env(cls[name], env).port}"


def restart(cfg: ClusterConfig, model_cfg: ModelConfig, name: str, echo=None) -> list[Member]:
    """Stop member `name` of the running cluster (if it runs) and start it again as `up` would."""
    from kvplan.ticker import Ticker
    if name not in MEMBERS:
        raise ValueError(f"SERVICE: must be one of {', '.join(MEMBERS)}, got {name!r}")
    d = state_dir(cfg, model_cfg)
    members = read_members(d)
    if not any(is_alive(m.pid) for m in members):
        raise RuntimeError(f"no cluster is up (state in {d}): `kvplan up` starts one")
    if name == "redis" and not (d / "redis.conf").exists():
        raise ValueError("SERVICE: this cluster runs no redis-server of its own (KVPLAN_REDIS_URL names one)")
    with Ticker(f"restarting the {name}") as ticker:
        return _revive(cfg, d, members, echo or ticker.echo, ticker, again=frozenset({name}))


def down(cfg: ClusterConfig, model_cfg: ModelConfig, echo=print) -> None:
    d = state_dir(cfg, model_cfg)
    members = read_members(d)
    if not members:
        echo("kvplan: no cluster is up")
        return
    for s in stop_all(members):
        echo(f"kvplan: stopped {s}")
    (d / "cluster.json").unlink(missing_ok=True)


def status(cfg: ClusterConfig, model_cfg: ModelConfig) -> list[tuple[str, int, str, str]]:
    """(name, pid, address, health) per member; health "DEAD" when the process is gone."""
    rows = []
    for m in read_members(state_dir(cfg, model_cfg)):
        if not is_alive(m.pid):
            health = "DEAD"
        elif m.name == "redis":
            health = "UP"
        else:
            health = member_health(m)
        rows.append((m.name, m.pid, m.address, health))
    return rows


