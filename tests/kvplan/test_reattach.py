"""Streams survive an executor loss on every client (issue 33), with real processes: a real
redis-server job queue, a planner, a cachestore and two executors (real model), the HTTP gateway
over both (KVPLAN_EXECUTOR_ADDR=a,b) read with the official `openai` client, and `kvplan.Client`
over both. The executor answering the stream (the first one: both clients start there) is
SIGKILLed mid-stream; the stream re-attaches to the job on the other executor, wherever it runs
now, and ends with the whole greedy text, shown once. Before: the HTTP stream ended in an error
event while the job was re-run for nobody, and the SDK re-attached only to the dead address."""
import time

import openai
import pytest

import kvplan
from kvplan.client import ExecutorClient, request
from tests.kvplan.conftest import http_gateway
from tests.procs import RedisProc, Service, base_env

pytestmark = pytest.mark.slow
PROMPT = "Count from 1 to 60, separated by commas."
NEW_TOKENS = 120


@pytest.fixture
def two_executors(tmp_path, real_model_dir):
    redis = RedisProc(tmp_path)
    env = base_env(KVPLAN_REDIS_URL=redis.url, KVPLAN_AUTH="off", KVPLAN_CLAIM_IDLE_MS="3000",
                   KVPLAN_HEARTBEAT_MS="500")
    started = []
    try:
        for name in ("planner", "cachestore"):
            s = Service(name, tmp_path, env)
            s.start()
            started.append(s)
        env = {**env, "KVPLAN_PLANNER_ADDR": started[0].address, "KVPLAN_CACHESTORE_ADDR": started[1].address}
        execs = [Service("executor", tmp_path, {**env, "KVPLAN_EXECUTOR_ID": name}, name=name) for name in "ab"]
        for e in execs:
            e.start(wait_s=0)
        for e in execs:
            e.wait_serving()
        started += execs
        yield execs
    finally:
        for s in reversed(started):
            s.stop()
        redis.stop()


def _reference(addr: str) -> str:
    with ExecutorClient(addr, timeout_s=300) as c:
        return c.run(request(PROMPT, max_new_tokens=NEW_TOKENS)).result.text


def test_http_and_sdk_streams_reattach_on_the_other_executor(two_executors):
    a, b = two_executors
    expected = _reference(b.address)
    with http_gateway(f"{a.address},{b.address}", "m") as url:
        stream = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=600).chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=NEW_TOKENS, stream=True)
        pieces = []
        for chunk in stream:                            # the gateway's first request goes to a
            pieces.append((chunk.choices[0].delta.content or "") if chunk.choices else "")
            if len("".join(pieces)) > 10 and a.alive():
                a.kill()                                # the executor answering the stream dies
        assert not a.alive() and "".join(pieces) == expected
    a.start()                                           # the same port again: both up for the SDK
    with kvplan.Client([a.address, b.address], timeout_s=600) as client:
        s = client.stream(PROMPT, max_new_tokens=NEW_TOKENS)
        got, t0 = [], time.monotonic()
        for piece in s:                                  # the SDK starts on a too
            got.append(piece)
            if len("".join(got)) > 10 and a.alive():
                a.kill()
        assert "".join(got) == expected == s.result.text
    print(f"\nboth streams whole after their executor died (SDK: {time.monotonic() - t0:.1f}s, "
          f"attempts {s.result.attempts})")
