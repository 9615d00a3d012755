"""The OpenAI-compatible HTTP API, tested with the official `openai` client and `curl -N`.

Over the real model (the embedded services): a streamed chat completion under `auto` at 0.2
reads usage.kv_bytes < usage.full_kv_bytes; a completion takes its prompt as it is (no chat
template); stop sequences and logprobs in OpenAI's shapes for chat and completions, streamed
and not; a budget the strategy cannot hold is 400 naming kv_ratio with the ratio that fits; the
model list, SSE lines through curl, a client that goes away cancelling its job (streamed or
not). Over a scripted executor (no model): bad input in OpenAI's error shape before any job
exists (response_format refused, not ignored), executor errors mapped to HTTP statuses, the
Authorization header forwarded as gRPC metadata, a re-run's text and log-probabilities not
streamed twice."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest

from kvplan.client import ExecutorClient
from kvplan.demo import DEMO_CONTEXT, DEMO_QUESTION
from protos import executor_pb2 as pb
from tests.kvplan.conftest import http_gateway
from tests.kvplan.fake_executor import FakeExecutor, events, result

MODEL = "test-model"


@pytest.fixture(scope="module")
def real_api(embedded):
    with http_gateway(embedded.executor_addr, MODEL) as url:
        yield url


@pytest.fixture
def fake():
    with FakeExecutor() as fx, http_gateway(fx.address, MODEL) as url:
        fx.url = url
        yield fx


def _openai(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)


# ---- the real model ------------------------------------------------------------------------

def test_openai_client_streams_a_chat_completion_under_auto_at_0_2(real_api):
    stream = _openai(real_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": DEMO_CONTEXT}], max_tokens=24, stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_strategy": "auto", "kv_ratio": 0.2, "kv_question": DEMO_QUESTION})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    print(f"streamed {len(chunks)} chunks: {text!r}; usage {usage}")
    assert chunks[0].choices[0].delta.role == "assistant" and text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert usage.kv_strategy == "auto" and not usage.degraded and usage.budget_met is not False
    assert 0.0 <= usage.kv_risk <= 1.0 and usage.kv_at_risk == (usage.kv_risk > 0)   # auto at 0.2: compressed
    assert 0 < usage.kv_bytes < usage.full_kv_bytes and usage.reserve_ratio <= 0.2
    assert usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_openai_client_completion_and_models(real_api, real_model_dir):
    from transformers import AutoTokenizer
    client = _openai(real_api)
    assert [m.id for m in client.models.list()] == [MODEL]
    prompt = "The capital of France is"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    assert "Paris" in got.choices[0].text and got.id.startswith("cmpl-")
    assert got.usage.kv_strategy == "full" and got.usage.kv_bytes >= got.usage.full_kv_bytes > 0
    # the text as it is, no chat template around it (which made "L'aujourcé! I" of this prompt)
    assert got.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(real_model_dir)(prompt)["input_ids"])


DAYS = [{"role": "user", "content": "List the days of the week, separated by commas."}]   # greedy: Monday .. Wednesday, Thursday ..


def test_stop_and_logprobs_in_a_chat_completion_streamed_and_not(real_api):
    client = _openai(real_api)
    whole = client.chat.completions.create(model=MODEL, messages=DAYS, max_tokens=40, stop=["Thursday"],
                                           logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    print(repr(choice.message.content), [t.token for t in choice.logprobs.content])
    assert choice.finish_reason == "stop" and "Thursday" not in choice.message.content
    assert "Wednesday" in choice.message.content
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)
    assert all(t.top_logprobs[0].token == t.token for t in content)          # greedy: the most likely is the chosen
    assert "".join(t.token for t in content).startswith(choice.message.content)
    stream = client.chat.completions.create(model=MODEL, messages=DAYS, max_tokens=40, stop=["Thursday"],
                                            logprobs=True, top_logprobs=3, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
        [t.token for t in content]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_and_logprobs_in_a_completion_streamed_and_not(real_api):
    client = _openai(real_api)
    whole = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=24, stop=[" six"],
                                      logprobs=2)
    choice = whole.choices[0]
    print(repr(choice.text), choice.logprobs)
    assert choice.finish_reason == "stop" and " six" not in choice.text and "five" in choice.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    assert all(len(top) == 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=24, stop=[" six"],
                                            logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text
    offsets = [o for c in stream if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_a_budget_the_strategy_cannot_hold_is_400_with_the_ratio_that_fits(real_api):
    with pytest.raises(openai.BadRequestError) as e:
        _openai(real_api).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name three colours of the rainbow."}], max_tokens=8,
            extra_body={"kv_strategy": "snapkv", "kv_ratio": 0.3})
    err = e.value.body
    print(err["message"])
    assert err["param"] == "kv_ratio" and err["message"].startswith("kv_ratio: snapkv cannot hold reserve ratio 0.3")
    assert "keeps at least 32" in err["message"] and " fits" in err["message"]


def _counted(name: str, **labels) -> float:
    """A counter of the in-process executor, summed over the series with `labels`."""
    from prometheus_client import REGISTRY
    return sum(x.value for m in REGISTRY.collect() for x in m.samples
               if x.name == name and all(x.labels.get(k) == v for k, v in labels.items()))


def test_a_budget_refused_in_a_stream_is_bad_request_before_any_chunk(real_api):
    """docs/http-api.md's streaming example with a budget the plan cannot hold: a 200, a role chunk
    and a bare APIError mid-stream before (issue 41); the refusal counted as one, not as FAILED."""
    refused, failed = _counted("kvplan_executor_jobs_refused_total"), _counted("kvplan_executor_jobs_total",
                                                                              state="FAILED")
    with pytest.raises(openai.BadRequestError) as e:
        _openai(real_api).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name three colours of the rainbow."}], max_tokens=8,
            stream=True, extra_body={"kv_strategy": "snapkv", "kv_ratio": 0.3})
    assert e.value.body["param"] == "kv_ratio" and " fits" in e.value.body["message"]
    assert _counted("kvplan_executor_jobs_refused_total", field="budget.reserve_ratio") >= 1
    assert _counted("kvplan_executor_jobs_refused_total") == refused + 1
    assert _counted("kvplan_executor_jobs_total", state="FAILED") == failed


def test_the_first_chunk_comes_with_the_first_token(real_api, embedded):
    """Judged by the job's own clock: its first token came at submitted_at + ttft_s; the first chunk
    arrives after it (the role chunk used to come at once, before the prefill)."""
    stream = _openai(real_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": DEMO_CONTEXT}], max_tokens=4, stream=True)
    first_at, chunk = None, None
    for chunk in stream:
        first_at = first_at or time.time()
    with ExecutorClient(embedded.executor_addr, 60) as c:
        status = c.get(chunk.id.removeprefix("chatcmpl-"))
    assert status.state == pb.DONE and status.result.ttft_s > 0
    assert first_at >= status.submitted_at + status.result.ttft_s


def test_ignore_eos_and_min_tokens_decide_how_many_tokens_come(real_api):
    client = _openai(real_api)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Reply with the single word OK."}], max_tokens=64)
    free = client.chat.completions.create(**ask)
    n = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and n < 56                # the model ends it by itself
    held = client.chat.completions.create(**ask, extra_body={"min_tokens": n + 8})
    assert held.usage.completion_tokens >= n + 8
    forced = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 64


def test_curl_shows_server_sent_events(real_api):
    if shutil.which("curl") is None:
        pytest.fail("curl is not installed (apt-get install -y curl)")
    body = {"model": MODEL, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    out = subprocess.run(["curl", "-N", "-sS", "--max-time", "300", f"{real_api}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=320)
    lines = [line for line in out.stdout.splitlines() if line]
    print("\n".join(lines[:3] + ["..."] + lines[-2:]))
    assert out.returncode == 0 and lines and all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "Paris" in "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_a_client_that_goes_away_cancels_its_job(real_api, embedded):
    body = {"model": MODEL, "stream": True, "max_tokens": 400,
            "messages": [{"role": "user", "content": "Write a long story about a dragon who learns to sing."}]}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{real_api}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"][0]["delta"].get("content"):
                        break                              # generating: now leave
    job_id = chunk["id"].removeprefix("chatcmpl-")
    with ExecutorClient(embedded.executor_addr, 60) as c:
        deadline = time.monotonic() + 120
        while c.get(job_id).state not in (pb.CANCELLED, pb.DONE) and time.monotonic() < deadline:
            time.sleep(0.2)
        status = c.get(job_id)
    assert status.state == pb.CANCELLED and status.generated_tokens < 400


def _ended(state: str) -> float:
    """Jobs the in-process executor ended in `state`, all strategies together."""
    from prometheus_client import REGISTRY
    return sum(s.value for m in REGISTRY.collect() if m.name == "kvplan_executor_jobs"
               for s in m.samples if s.name == "kvplan_executor_jobs_total" and s.labels.get("state") == state)


def test_a_client_that_goes_away_before_a_whole_answer_cancels_its_job(real_api):
    """Not streamed (issue 33): the job stopped at once instead of running its 400 tokens for nobody."""
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a dragon who learns to sing."}]}
    cancelled, done = _ended("CANCELLED"), _ended("DONE")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{real_api}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=3))
    deadline = time.monotonic() + 60
    while _ended("CANCELLED") == cancelled and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ended("CANCELLED") == cancelled + 1 and _ended("DONE") == done


# ---- a scripted executor -------------------------------------------------------------------

@pytest.mark.parametrize("extra, param, words", [
    ({"kv_ratio": 1.5}, "kv_ratio", "kv_ratio: must be in (0, 1], got 1.5"),
    ({"kv_ratio": 0}, "kv_ratio", "kv_ratio: must be in (0, 1], got 0"),
    ({"kv_tokens": 0}, "kv_tokens", "kv_tokens: must be >= 1"),
    ({"kv_budget": {"reserve_ratio": 2}}, "kv_budget.reserve_ratio", "must be in (0, 1]"),
    ({"kv_budget": {"fixed": True}}, "kv_budget", 'must be {"reserve_ratio": r}, {"kv_tokens": n} or {"adaptive"'),
    ({"kv_budget": {"adaptive": True}}, "kv_budget.adaptive", 'must be {} or {"floor_ratio": f}'),
    ({"kv_budget": {"adaptive": {"floor_ratio": 2}}}, "kv_budget.adaptive.floor_ratio", "must be a number in [0, 1]"),
    ({"kv_ratio": 0.2, "kv_tokens": 9}, "kv_tokens", "give one of kv_ratio, kv_tokens, kv_budget"),
    ({"kv_ration": 0.2}, "kv_ration", "unknown kvplan field"),
    ({"kv_ratio": "lots"}, "kv_ratio", "kv_ratio:"),
    ({"n": 2}, "n", "only 1 choice per request is supported, got 2"),
    ({"stop": [""]}, "stop[0]", "stop[0]: must be 1 to 256 characters"),
    ({"stop": ["a"] * 17}, "stop", "at most 16 stop sequences"),
    ({"response_format": {"type": "json_object"}}, "response_format", 'only {"type": "text"} is supported'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "no JSON schema"),
    ({"top_logprobs": 2}, "top_logprobs", 'needs "logprobs": true'),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20], got 21"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "not supported"),
    ({"foo": 1}, "foo", "foo: unknown field"),                     # was a 200 (issue 42): refused as OpenAI's API does
    ({"top_k": 5}, "top_k", "top-k sampling is not supported"),
    ({"repetition_penalty": 1.2}, "repetition_penalty", "only 1 is taken"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "only true is taken"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "must be in [0, 4], got 9"),
    ({"ignore_eos": 1}, "ignore_eos", "ignore_eos:"),
    ({"temperature": -1}, "temperature", "must be >= 0"),
])
def test_bad_input_is_400_in_openais_error_shape_before_any_job(fake, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        _openai(fake.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert words in e.value.body["message"]
    assert fake.script.calls == []                            # no job was submitted
    raw = httpx.post(f"{fake.url}/v1/chat/completions",
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_what_serving_clients_send_is_taken_or_honoured(fake):
    """vLLM's benchmark client sends ignore_eos and a neutral repetition_penalty, OpenAI's clients
    `user`; a JSON null is an absent field."""
    fake.script.events = events((1, ["ok"]), result=result("ok"))
    extra = {"ignore_eos": True, "min_tokens": 3, "repetition_penalty": 1.0, "top_k": -1, "user": "u-1",
             "request_id": "r-1", "logprobs": None, "skip_special_tokens": True, "presence_penalty": 0}
    got = _openai(fake.url).completions.create(model=MODEL, prompt="hi", max_tokens=8, extra_body=extra)
    assert got.choices[0].text == "ok"
    req = fake.script.requests[0]
    assert req.ignore_eos and req.min_tokens == 3 and req.max_new_tokens == 8


def test_unknown_model_is_404_and_a_malformed_body_400(fake):
    with pytest.raises(openai.NotFoundError) as e:
        _openai(fake.url).completions.create(model="gpt-4", prompt="hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    raw = httpx.post(f"{fake.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("code, details, status, param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role: must be one of system, user, assistant", 400,
     "messages[0].role"),
    (grpc.StatusCode.INVALID_ARGUMENT, "budget.reserve_ratio: must be in (0, 1], got 2", 400, "kv_ratio"),
    (grpc.StatusCode.UNAUTHENTICATED, "no API key", 401, None),
    (grpc.StatusCode.PERMISSION_DENIED, "admin only", 403, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 429, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (1200000 vs. 1114112)", 413, None),
    (grpc.StatusCode.UNAVAILABLE, "executor is warming up", 503, None),
])
def test_executor_errors_become_http_statuses(fake, code, details, status, param):
    # a queue bound says when to retry (429 with Retry-After); a request too large never fits (413)
    retry = (("retry-after", "2"),) if details == "queue full" else ()
    fake.script.reject = (code, details, retry)
    raw = httpx.post(f"{fake.url}/v1/chat/completions",
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    err = raw.json()["error"]
    assert raw.status_code == status and err["param"] == param and err["code"] == code.name.lower()
    assert raw.headers.get("retry-after") == ("2" if status == 429 else None)
    assert err["message"].endswith(details.partition(": ")[2] if param else details) or "kvplan up" in err["message"]


def test_the_authorization_header_travels_as_grpc_metadata(fake):
    fake.script.events = events((1, ["Hi"]), result=result("Hi"))
    got = _openai(fake.url, key="sk-tenant-a").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert got.choices[0].message.content == "Hi" and got.usage.kv_bytes == 200
    assert fake.script.metadata[0]["authorization"] == "Bearer sk-tenant-a"
    req = fake.script.requests[0]
    assert req.messages[0].content == "hi" and req.temperature == 0 and not req.HasField("seed")


def test_a_rerun_is_not_streamed_twice_and_a_sampled_request_gets_a_seed(fake):
    """The executor holding the job died after "The cap"; another re-ran it from the start."""
    fake.script.events = events((1, ["The", " cap"]), (2, ["The", " cap", "ital", " is Paris."]),
                                result=result("The capital is Paris."))
    stream = _openai(fake.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       stream=True, temperature=0.7)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "The capital is Paris."
    assert fake.script.requests[0].HasField("seed")           # a re-run replays the same sampled text


def test_a_rerun_streams_each_tokens_logprob_once(fake):
    def delta(attempt, text, *ids):
        return pb.JobEvent(job_id="job0", attempt=attempt, delta=pb.TokenDelta(
            text=text, token_ids=list(ids), logprobs=[pb.TokenLogprob(token_id=i, token=f"t{i}", logprob=-0.5,
                                                                      top=[pb.TopLogprob(token_id=i, token=f"t{i}",
                                                                                         logprob=-0.5)])
                                                      for i in ids]))
    head = events()
    fake.script.events = [head[0], delta(1, "A", 1), delta(1, "B", 2), delta(2, "A", 1), delta(2, "B", 2),
                          delta(2, "C", 3), pb.JobEvent(job_id="job0", attempt=2, result=result("ABC"))]
    stream = _openai(fake.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       stream=True, logprobs=True, top_logprobs=1)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ABC"
    assert [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
        ["t1", "t2", "t3"]
    assert fake.script.requests[0].top_logprobs == 1


def _http_requests(url: str, route: str, status: int) -> float:
    line = f'kvplan_http_requests_total{{route="{route}",status="{status}"}} '
    return sum(float(x.removeprefix(line)) for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith(line))


def test_a_failed_job_mid_stream_is_an_error_event_counted_with_its_status(fake):
    fake.script.events = events((1, ["Hel"])) + [pb.JobEvent(job_id="job0", attempt=1, status=pb.JobStatus(
        job_id="job0", state=pb.FAILED, error="RuntimeError: boom"))]
    before = _http_requests(fake.url, "/v1/chat/completions", 500)
    with pytest.raises(openai.APIError) as e:
        list(_openai(fake.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       stream=True))
    assert "boom" in str(e.value)
    assert _http_requests(fake.url, "/v1/chat/completions", 500) == before + 1      # not the 200 on the wire


def test_a_refusal_before_the_first_token_is_400_before_any_chunk(fake):
    """A budget the plan cannot hold is found once the job is queued and planned: the stream used to
    start with a 200 and a role chunk, then end in a bare APIError mid-stream (issue 41)."""
    fake.script.events = events((1, [])) + [pb.JobEvent(job_id="job0", attempt=1, status=pb.JobStatus(
        job_id="job0", state=pb.FAILED, error_field="budget.reserve_ratio",
        error="budget.reserve_ratio: snapkv cannot hold reserve ratio 0.01 (0.2 fits)"))]
    before = _http_requests(fake.url, "/v1/chat/completions", 400)
    with pytest.raises(openai.BadRequestError) as e:
        _openai(fake.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  stream=True, extra_body={"kv_ratio": 0.01})
    assert e.value.body["param"] == "kv_ratio" and "0.2 fits" in e.value.body["message"]
    assert _http_requests(fake.url, "/v1/chat/completions", 400) == before + 1


def test_the_first_chunk_carries_the_first_token(fake):
    fake.script.events = events((1, ["Hel", "lo"]), result=result("Hello"))
    chunks = [c for c in _openai(fake.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == "Hel"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"


def test_metrics_count_requests(fake):
    fake.script.events = events((1, ["ok"]), result=result("ok"))
    httpx.post(f"{fake.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    text = httpx.get(f"{fake.url}/metrics").text
    assert 'kvplan_http_requests_total{route="/v1/completions",status="200"}' in text
    assert "kvplan_http_request_seconds_bucket" in text


def test_health_follows_the_executor_and_the_container_healthcheck_reads_it(fake):
    hostport = fake.url.removeprefix("http://")
    check = lambda: subprocess.run([sys.executable, "-m", "kvplan.healthcheck", "--http", hostport],  # noqa: E731
                                   capture_output=True, text=True, timeout=60)
    assert httpx.get(f"{fake.url}/health").status_code == 200 and check().returncode == 0
    fake.set_serving(False)
    assert httpx.get(f"{fake.url}/health").status_code == 503
    got = check()
    assert got.returncode == 1 and "NOT_SERVING" in got.stderr
