"""Operator traps of `kvplan up` and the CLI (issues 33 and 42), without the model: a port whose
last connections linger in TIME_WAIT is free again at once; a cluster that is up but unhealthy is
an error naming it (not a silent run in process without the cluster's keys); `kvplan up` with a
keys file of one's own and no services' key in it refuses to start, saying why; the keys an
operator added survive the next `kvplan up`; `kvplan up` over a cluster with a dead member starts
it again with the cluster's settings, `kvplan restart NAME` restarts one, `kvplan status` exits 1
while one is dead. (tests/test_cluster.py runs `up`/`down`/`up` and a killed executor for real.)"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

from kvplan import cli, cluster, members
from kvcore import keyfile
from kvcore.config import ConfigError
from cachestore.process import free_port


def _time_wait(port: int) -> None:
    """Leave a connection of a server on `port` in TIME_WAIT (the server closes first, as a
    stopped server does), and the listener closed."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()                                   # the server's side closes first: TIME_WAIT here
        time.sleep(0.05)
        client.close()
    time.sleep(0.05)


def test_a_port_in_time_wait_is_free_at_once_for_up_and_for_grpc():
    port = free_port()
    _time_wait(port)
    assert "TIME-WAIT" in _states(port)
    assert members.port_free(port)                    # `kvplan up`'s check ("port 8000 is taken" before)
    server = grpc.server(futures.ThreadPoolExecutor(1), options=[("grpc.so_reuseport", 0)])   # as serving.start
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    try:
        assert not members.port_free(port)            # a listener: taken
    finally:
        server.stop(0)


def _states(port: int) -> str:
    out = subprocess.run(["ss", "-tan", f"( sport = :{port} )"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else "TIME-WAIT"     # (no `ss`: the checks below still run)


@pytest.fixture
def state(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLAN_STATE_DIR", str(tmp_path / "state"))
    for name in ("KVPLAN_EXECUTOR_ADDR", "KVPLAN_API_KEY", "KVPLAN_AUTH_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "state").mkdir()
    return tmp_path / "state"


def test_an_unhealthy_cluster_is_an_error_not_a_run_in_process(state, capsys):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead_port = free_port()
        members = [{"name": "planner", "pid": live.pid, "address": f"127.0.0.1:{free_port()}"},
                   {"name": "executor", "pid": live.pid, "address": f"127.0.0.1:{dead_port}"}]
        (state / "cluster.json").write_text(json.dumps({"members": members}))
        t0 = time.perf_counter()
        assert cli.main(["generate", "--max-new-tokens", "2", "hi"]) == 1
        err = capsys.readouterr().err
        assert "cluster unhealthy" in err and "executor DOWN" in err and "embedded" not in err
        assert time.perf_counter() - t0 < 30
        assert cli.main(["generate", "--ratio", "2", "hi"]) == 2           # bad input still says so first
    finally:
        live.kill()
        live.wait()


def test_a_cluster_whose_processes_are_all_gone_is_no_cluster(state):
    (state / "cluster.json").write_text(json.dumps({"members": [
        {"name": "executor", "pid": 2**22 + 17, "address": f"127.0.0.1:{free_port()}"}]}))
    from kvcore.config import ClusterConfig, ModelConfig, from_env
    assert cluster.running_executor(from_env(ClusterConfig), from_env(ModelConfig)) is None


@pytest.mark.parametrize("services_key", ["", "user", "stranger"])
def test_up_with_ones_own_keys_file_and_no_services_key_refuses_to_start(state, monkeypatch, capsys, services_key):
    keys = state.parent / "keys.json"
    user = keyfile.add_key(keys, "acme", "user")
    monkeypatch.setenv("KVPLAN_AUTH", "on")
    monkeypatch.setenv("KVPLAN_AUTH_KEYS_FILE", str(keys))
    if services_key:
        monkeypatch.setenv("KVPLAN_API_KEY", user if services_key == "user" else keyfile.new_key())
    for name in ("PLANNER", "CACHESTORE", "EXECUTOR", "HTTP"):
        monkeypatch.setenv(f"KVPLAN_{name}_PORT", str(free_port()))
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err
    assert "KVPLAN_API_KEY" in err and "admin key" in err and str(keys) in err
    assert not (state / "cluster.json").exists()                # nothing was started


def test_up_keeps_the_keys_added_since_and_replaces_only_its_own(state):
    env = {"KVPLAN_AUTH": "on"}
    first = keyfile.cluster_keys(state, env)
    admin = (state / keyfile.ADMIN_KEY_FILE).read_text().strip()
    added = keyfile.add_key(state / keyfile.KEYS_FILE, "acme", "user", weight=2)     # `kvplan keys add`
    second = keyfile.cluster_keys(state, env)                                       # the next `kvplan up`
    ring = keyfile.KeyRing(state / keyfile.KEYS_FILE)
    assert ring.lookup(added) == keyfile.Identity("acme", "user", weight=2.0) and ring.weight("acme") == 2.0
    assert ring.lookup(admin) is None and ring.lookup(first["KVPLAN_API_KEY"]) is None   # the last up's: gone
    assert ring.lookup(second["KVPLAN_API_KEY"]).role == "admin"
    assert ring.lookup((state / keyfile.ADMIN_KEY_FILE).read_text().strip()).role == "admin"


@pytest.mark.parametrize("weight", [0, -1, 1e9, True, "2"])
def test_a_bad_weight_in_the_keys_file_is_a_config_error(tmp_path, weight):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": {"sha256:" + "0" * 64: {"tenant": "a", "role": "user", "weight": weight}}}))
    with pytest.raises(ConfigError, match="weight"):
        keyfile.KeyRing(f)


def test_keys_add_sets_a_tenants_weight_and_refuses_a_bad_one(tmp_path, capsys):
    f = tmp_path / "keys.json"
    assert cli.main(["keys", "add", "--tenant", "gold", "--weight", "3", "--file", str(f)]) == 0
    key = capsys.readouterr().out.strip()
    assert keyfile.KeyRing(f).lookup(key).weight == 3.0 and keyfile.KeyRing(f).weight("gold") == 3.0
    assert keyfile.KeyRing(f).weight("nobody") == 1.0
    assert cli.main(["keys", "add", "--tenant", "gold", "--weight", "0", "--file", str(f)]) == 2
    assert "--weight: must be a number in (0, 1000]" in capsys.readouterr().err


@pytest.fixture
def half_dead(state, monkeypatch):
    """A cluster whose planner, cachestore and HTTP API live and whose executor was SIGKILLed;
    spawning and health are scripted: -> (spawned [(name, env)], the live processes)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(3)]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    pids = {"planner": procs[0].pid, "cachestore": procs[1].pid, "executor": gone.pid, "http": procs[2].pid}
    (state / "cluster.json").write_text(json.dumps({"members": [
        {"name": n, "pid": pid, "address": f"127.0.0.1:{free_port()}"} for n, pid in pids.items()]}))
    (state / cluster.ENV_FILE).write_text(json.dumps({"KVPLAN_AUTH": "off", "KVPLAN_EXECUTOR_ADDR": "127.0.0.1:1"}))
    spawned = []

    def spawn(name, argv, env, d):
        spawned.append((name, env))
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return procs[-1]
    health = lambda m: "SERVING" if members.is_alive(m.pid) else "DOWN"      # noqa: E731
    monkeypatch.setattr(members, "spawn", spawn)
    for module in (members, cluster):
        monkeypatch.setattr(module, "member_health", health)
    monkeypatch.setenv("KVPLAN_EXECUTOR_ADDR", "127.0.0.1:2")                  # the shell's: the cluster's wins
    yield spawned, procs
    for p in procs:
        p.kill()
        p.wait()


def test_up_starts_again_the_member_that_died_and_says_so(state, half_dead, capsys):
    """Before issue 42: "a cluster is already up", exit 0, the executor still DEAD."""
    spawned, _ = half_dead
    assert cli.main(["status"]) == 1 and "DEAD" in capsys.readouterr().out
    assert cli.main(["up"]) == 0
    out = capsys.readouterr().out
    assert [name for name, _ in spawned] == ["executor"]
    assert spawned[0][1]["KVPLAN_EXECUTOR_ADDR"] == "127.0.0.1:1" and spawned[0][1]["KVPLAN_AUTH"] == "off"
    assert "executor" in out and "(was dead: started again)" in out and out.count("(running)") == 3
    assert cli.main(["status"]) == 0 and "DEAD" not in capsys.readouterr().out
    assert cli.main(["up"]) == 0 and "nothing to start" in capsys.readouterr().out and len(spawned) == 1


def test_restart_stops_one_member_and_starts_it_again(state, half_dead, capsys):
    spawned, procs = half_dead
    old = json.loads((state / "cluster.json").read_text())["members"][0]
    assert cli.main(["restart", "planner"]) == 0
    out = capsys.readouterr().out
    assert "planner" in out and "(restarted: started again)" in out
    assert procs[0].wait(10) is not None                                       # the old planner was stopped
    now = {m["name"]: m for m in json.loads((state / "cluster.json").read_text())["members"]}
    assert now["planner"]["address"] == old["address"] and now["planner"]["pid"] != old["pid"]
    assert [name for name, _ in spawned] == ["planner", "executor"]           # (and the dead one with it)
    with pytest.raises(SystemExit) as e:                                        # argparse: exit 2
        cli.main(["restart", "nothing"])
    assert e.value.code == 2


def test_restart_without_a_cluster_says_so(state, capsys):
    assert cli.main(["restart", "executor"]) == 1
    assert "no cluster is up" in capsys.readouterr().err
