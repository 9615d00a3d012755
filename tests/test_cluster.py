"""Integration: real processes, real Redis, real gRPC on 127.0.0.1.

- an executor killed while it holds a job: a second executor re-claims and finishes it, and
  the client watching the job gets the result;
- `kvplan up` / `generate` / `down` from the CLI: the answer, and no process left behind; then
  `up` again at once on the same ports, with the key `kvplan keys add` made still valid;
- the executor of a `kvplan up` cluster SIGKILLed under an HTTP stream: `kvplan status` exits 1,
  `kvplan up` starts it again (it said "a cluster is already up" before issue 42), every member
  serves, and the stream goes on to the job's text.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvcore import cost
from kvplan.client import ExecutorClient, fold, request, Stream
from kvcore.serving import check_health
from protos import executor_pb2 as pb
from cachestore.process import free_port

ROOT = Path(__file__).resolve().parents[1]


def _start(module: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _wait_serving(addr: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while check_health(addr) != "SERVING":
        assert proc.poll() is None, f"{proc.args} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{addr} not SERVING:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.fixture
def services(redis_db, tmp_path, real_model_dir):
    env = dict(os.environ, KVPLAN_REDIS_URL=redis_db, KVPLAN_CLAIM_IDLE_MS="3000", KVPLAN_HEARTBEAT_MS="500")
    procs = []

    def start(module: str, name: str, **extra) -> tuple[subprocess.Popen, str]:
        """Start one service on fresh free ports; a port another process took between our probe
        and its bind (ephemeral-port reuse) gets a new one, up to three tries."""
        var = module.upper()
        for attempt in range(3):
            port = free_port()
            log = tmp_path / f"{name}-{attempt}.log"
            p = _start(module, {**env, f"KVPLAN_{var}_PORT": str(port), f"KVPLAN_{var}_METRICS_PORT": str(free_port()),
                                **extra}, log)
            addr = f"127.0.0.1:{port}"
            try:
                _wait_serving(addr, p, log)
            except AssertionError:
                if p.poll() is not None and "Address already in use" in log.read_text() and attempt < 2:
                    continue
                p.kill()
                raise
            procs.append(p)
            return p, addr

    _, env["KVPLAN_PLANNER_ADDR"] = start("planner", "planner")
    _, env["KVPLAN_CACHESTORE_ADDR"] = start("cachestore", "cachestore")
    yield lambda name, **extra: start("executor", name, KVPLAN_EXECUTOR_ID=name, **extra)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_a_job_survives_the_executor_that_held_it(services, sig):
    """SIGKILL: the executor dies holding the job. SIGTERM with a short grace: it stops the job
    un-acked and exits. Either way a second executor re-claims the job and finishes it."""
    proc_a, addr_a = services("exec-a", KVPLAN_GRACE_S="0.5")
    seen = Stream()
    with ExecutorClient(addr_a, timeout_s=120) as a:
        job = a.submit(request("Write a long story about a dragon who learns to sing.", max_new_tokens=160))
        for ev in a.watch(job.job_id):
            fold(seen, ev)
            if ev.HasField("delta"):           # exec-a holds the job and is generating
                break
        assert a.get(job.job_id).state == pb.RUNNING and a.get(job.job_id).executor_id == "exec-a"
    proc_a.send_signal(sig)
    assert proc_a.wait(40) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)

    _, addr_b = services("exec-b")
    with ExecutorClient(addr_b, timeout_s=240) as b:
        for ev in b.watch(job.job_id):          # replays attempt 1, then follows attempt 2
            fold(seen, ev)
        final = b.get(job.job_id)
    assert seen.result is not None, "the client got no result"
    assert final.state == pb.DONE and final.attempts == 2
    assert seen.result.executor_id == "exec-b" == final.result.executor_id
    assert seen.attempt == 2 and seen.text == seen.result.text and seen.result.generated_tokens > 0


def _kvplan(*args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvplan.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _up_env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, KVPLAN_STATE_DIR=str(tmp_path / "state"), **extra)
    for name in ("PLANNER", "CACHESTORE", "EXECUTOR"):
        env[f"KVPLAN_{name}_PORT"] = str(free_port())
        env[f"KVPLAN_{name}_METRICS_PORT"] = str(free_port())
    env["KVPLAN_HTTP_PORT"] = str(free_port())
    env["KVPLAN_AUTH"] = "on"              # as in production: `kvplan up` makes the keys, the CLI uses its admin key
    for k in ("KVPLAN_REDIS_URL", "KVPLAN_EXECUTOR_ADDR", "KVPLAN_PLANNER_ADDR", "KVPLAN_CACHESTORE_ADDR"):
        env.pop(k, None)
    return env


def test_kvplan_up_generate_down(tmp_path, real_model_dir):
    env = _up_env(tmp_path)
    up = _kvplan("up", env=env)
    assert up.returncode == 0, up.stderr
    try:
        members = json.loads((tmp_path / "state" / "cluster.json").read_text())["members"]
        assert {m["name"] for m in members} == {"redis", "planner", "cachestore", "executor", "http"}
        status = _kvplan("status", env=env)
        assert status.returncode == 0 and status.stdout.count("SERVING") == 4, status.stdout
        gen = _kvplan("generate", "--json", "--max-new-tokens", "16", "What is the capital of France?", env=env)
        assert gen.returncode == 0, gen.stderr
        out = json.loads(gen.stdout)                       # exactly one JSON object on stdout
        assert "Paris" in out["text"] and out["strategy"] == "full" and out["budget_met"] is True
        # full layers grow in chunks of ROW_CHUNK rows: the spare rows are held and counted
        assert 1.0 <= out["reserve_ratio"] < 1.0 + cost.ROW_CHUNK / out["prompt_tokens"]
        assert out["kv_bytes"] == sum(x["kv_bytes"] for x in out["per_layer"]) >= out["full_kv_bytes"] > 0
        assert out["executor_id"] != "" and "embedded" not in gen.stderr     # the cluster ran it
        bad = _kvplan("generate", "--ratio", "1.5", "hi", env=env)
        assert bad.returncode == 2 and "--ratio: must be in (0, 1]" in bad.stderr
        _the_http_api_answers(f"127.0.0.1:{env['KVPLAN_HTTP_PORT']}", tmp_path / "state")
        added = _kvplan("keys", "add", "--tenant", "acme", env=env)
        assert added.returncode == 0, added.stderr
    finally:
        down = _kvplan("down", env=env)
    assert down.returncode == 0, down.stderr
    time.sleep(0.2)
    alive = [m for m in members if psutil.pid_exists(m["pid"])
             and psutil.Process(m["pid"]).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after `kvplan down`: {alive}"
    assert _kvplan("status", env=env).returncode == 1
    # issue 33: up again at once on the same ports (TIME_WAIT is no "port taken"), and the key
    # added with `kvplan keys add` still works (`up` used to make the keys file anew)
    again = _kvplan("up", env=env)
    try:
        assert again.returncode == 0, again.stderr
        _the_key_works(f"127.0.0.1:{env['KVPLAN_HTTP_PORT']}", added.stdout.strip())
    finally:
        assert _kvplan("down", env=env).returncode == 0


def _the_key_works(address: str, key: str) -> None:
    import openai
    got = openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0, timeout=300).completions.create(
        model="SmolLM2-135M-Instruct", prompt="Say hi.", max_tokens=2)
    assert got.usage.completion_tokens >= 1                                  # acme's job ran
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{address}/v1", api_key="kvp_not-a-key", max_retries=0).completions.create(
            model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2)


def _the_http_api_answers(address: str, state: Path) -> None:
    """`kvplan up`'s HTTP API, with the cluster's admin key and without a key."""
    import openai
    from kvcore.keyfile import ADMIN_KEY_FILE
    key = (state / ADMIN_KEY_FILE).read_text().strip()
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0, timeout=300)
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                    max_tokens=12)                      # the text to continue, as it is
    assert "Paris" in got.choices[0].text and got.usage.kv_bytes > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{address}/v1", api_key="not-a-key", max_retries=0).completions.create(
            model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2)


def test_a_killed_executor_comes_back_with_kvplan_up_and_its_stream_goes_on(tmp_path, real_model_dir, monkeypatch):
    import threading
    import openai
    from kvcore.keyfile import ADMIN_KEY_FILE
    env = _up_env(tmp_path, KVPLAN_CLAIM_IDLE_MS="3000", KVPLAN_HEARTBEAT_MS="500")
    assert _kvplan("up", env=env).returncode == 0
    try:
        members = {m["name"]: m for m in json.loads((tmp_path / "state" / "cluster.json").read_text())["members"]}
        key = (tmp_path / "state" / ADMIN_KEY_FILE).read_text().strip()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{env['KVPLAN_HTTP_PORT']}/v1", api_key=key, max_retries=0,
                               timeout=600)
        got, first = {}, threading.Event()

        def read():
            text = ""
            for chunk in client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", stream=True, max_tokens=96,
                    messages=[{"role": "user", "content": "Count from one to fifty in words."}],
                    extra_body={"ignore_eos": True}):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
                got["id"] = chunk.id
                first.set()
            got["text"] = text
        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(300), "no first chunk"
        os.kill(members["executor"]["pid"], signal.SIGKILL)
        status = _kvplan("status", env=env)
        assert status.returncode == 1 and "DEAD" in status.stdout, status.stdout
        again = _kvplan("up", env=env)
        assert again.returncode == 0 and "was dead: started again" in again.stdout, (again.stdout, again.stderr)
        status = _kvplan("status", env=env)
        assert status.returncode == 0 and status.stdout.count("SERVING") == 4, status.stdout
        reader.join(600)
        assert not reader.is_alive() and "text" in got, "the stream did not go on"
        monkeypatch.setenv("KVPLAN_API_KEY", key)
        with ExecutorClient(f"127.0.0.1:{env['KVPLAN_EXECUTOR_PORT']}", 60) as c:
            job = c.get(got["id"].removeprefix("chatcmpl-"))
        assert job.state == pb.DONE and job.attempts == 2 and got["text"] == job.result.text
    finally:
        assert _kvplan("down", env=env).returncode == 0
