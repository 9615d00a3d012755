"""Hostile HTTP input (issue 33), with the official `openai` client and raw httpx against the
gateway over a scripted executor: every bad request is answered in under a second with the right
status in OpenAI's error shape, no job is submitted, and the gateway goes on serving. Before: a
50 MB (or 2 MB) prompt was 429 `rate_limit_error` (the client uploaded it three times, the body
parsed whole first); max_tokens 2^31, 2^32, 2^63, kv_tokens 2^63 and a lone surrogate were a
plain-text 500; invalid UTF-8 was FastAPI's {"detail": ...}; kv_ratio "0.5" and true were
accepted; a 1 MB model name was echoed back whole."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.kvplan.conftest import http_gateway
from tests.kvplan.fake_executor import FakeExecutor, events, result

MODEL = "test-model"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fake():
    with FakeExecutor() as fx, http_gateway(fx.address, MODEL) as url:
        fx.url = url
        fx.script.events = events((1, ["ok"]), result=result("ok"))
        yield fx


@pytest.fixture(autouse=True)
def _still_serving_after(fake):
    calls = len(fake.script.calls)
    yield
    assert fake.script.calls[calls:] == []                    # no job was submitted
    got = httpx.post(f"{fake.url}/v1/chat/completions", json={"model": MODEL, "messages": HI}, timeout=10)
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == "ok"
    del fake.script.calls[calls:]


def _requests(url: str, status: int) -> float:
    text = httpx.get(f"{url}/metrics").text
    line = f'kvplan_http_requests_total{{route="/v1/chat/completions",status="{status}"}} '
    return sum(float(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line))


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


@pytest.mark.parametrize("mb", [50, 5])
def test_a_body_over_the_limit_is_413_once_and_never_retried(fake, mb):
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=2, timeout=60)
    before = _requests(fake.url, 413)
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * (mb << 20)}])
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    assert time.perf_counter() - t0 < 5                       # (the client's own JSON encoding of 50 MB included)
    assert _requests(fake.url, 413) == before + 1             # one upload, no retry


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(fake):
    sent = []

    def body():
        for _ in range(64):
            sent.append(1)
            yield b"x" * (1 << 20)
    r = httpx.post(f"{fake.url}/v1/chat/completions", content=body(), headers={"content-type": "application/json"})
    _error(r, 413, None)
    assert len(sent) < 64


def test_a_prompt_over_the_text_limit_is_400_naming_the_field(fake):
    r = httpx.post(f"{fake.url}/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "a" * (2 << 20)}]})
    assert "at most 524288" in _error(r, 400, "messages")["message"]


BAD = [
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 2**32}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_completion_tokens": 2**63}, "max_completion_tokens"),
    ({"kv_tokens": 2**63}, "kv_tokens"),
    ({"kv_budget": {"kv_tokens": 2**64}}, "kv_budget.kv_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"kv_ratio": "0.5"}, "kv_ratio"),
    ({"kv_ratio": True}, "kv_ratio"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"temperature": "0"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"kv_question": "\ud800"}, "kv_question"),
    ({"messages": [{"role": "user", "content": "hi \udfff"}]}, "messages[0].content"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "messages.0.role"),
    ({"kv_strategy": "s" * 200}, "kv_strategy"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p for _, p in BAD])
def test_every_bad_field_is_400_in_openais_shape(fake, extra, param):
    t0 = time.perf_counter()
    body = json.dumps({"model": MODEL, "messages": HI, **extra})     # lone surrogates as JSON escapes
    r = httpx.post(f"{fake.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=10)
    assert time.perf_counter() - t0 < 1.0
    err = _error(r, 400, param)
    assert err["type"] == "invalid_request_error" and err["message"].startswith(param)


def test_invalid_utf8_and_broken_json_are_400_in_openais_shape(fake):
    for raw in (b'{"model": "test-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}', b"{not json"):
        r = httpx.post(f"{fake.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert _error(r, 400, r.json()["error"]["param"])["type"] == "invalid_request_error"
        assert "detail" not in r.json()


def test_a_huge_model_name_is_not_echoed_back_whole(fake):
    with pytest.raises(openai.NotFoundError) as e:
        openai.OpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=0).chat.completions.create(
            model="m" * (1 << 20), messages=HI)
    assert e.value.body["param"] == "model" and len(e.value.body["message"]) < 300


def test_unknown_routes_and_methods_answer_in_openais_shape(fake):
    _error(httpx.get(f"{fake.url}/v1/nothing-here"), 404, None)
    _error(httpx.get(f"{fake.url}/v1/chat/completions"), 405, None)
