"""Hostile HTTP input (issues 33 and 42), with the official `openai` client, raw httpx and raw
sockets against the gateway over a scripted executor: every bad request is answered with the
right status in OpenAI's error shape, no job is submitted, and the gateway goes
on serving. Before issue 33: a 50 MB (or 2 MB) prompt was 429 `rate_limit_error` (the client
uploaded it three times, the body parsed whole first); max_tokens 2^31, 2^32, 2^63, kv_tokens 2^63
and a lone surrogate were a plain-text 500; invalid UTF-8 was FastAPI's {"detail": ...};
kv_ratio "0.5" and true were accepted; a 1 MB model name was echoed back whole. Before issue 42:
the 413 came while the client still sent its body, so the client sometimes read a reset
connection and sent it again; `/metrics` grew with every distinct URL; `Content-Length: -1` was
uvicorn's plain text; a JSON syntax error named a byte offset as its `param`."""
from __future__ import annotations

import json
import socket
import time
import uuid

import httpx
import openai
import pytest

from kvcore.auth import Gate
from kvplan.http_guard import DRAIN_S
from kvcore.keyfile import KeyRing, add_key
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


@pytest.mark.parametrize("mb", [50, 20, 5])
def test_a_body_over_the_limit_is_413_once_and_never_retried(fake, mb):
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=2, timeout=60)
    before = _requests(fake.url, 413)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * (mb << 20)}])
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    assert _requests(fake.url, 413) == before + 1             # one upload, no retry


def _raw(url: str, head: bytes, body: bytes = b"", pause_s: float = 0.0, timeout_s: float = 60) -> bytes:
    """Send `head` and then `body` on a socket of its own, in 256 KB pieces `pause_s` apart (a
    client slower than the server), as every HTTP client does: the whole body before it reads;
    -> all the server answered (socket.timeout when it did not within `timeout_s`)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(head)
        for i in range(0, len(body), 256 << 10):
            time.sleep(pause_s)
            s.sendall(body[i:i + (256 << 10)])
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    return out


def test_a_client_that_sends_its_whole_body_first_reads_the_413(fake):
    """The server reads (and discards) the rest of an oversized body before it answers; it used to
    answer and close while the body still came, and the client's next write met a reset (so did
    its read: the answer was lost)."""
    body = b"x" * (6 << 20)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    got = _raw(fake.url, head, body, pause_s=0.01)
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"


def test_expect_100_continue_is_answered_before_the_body_is_sent(fake):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\nExpect: 100-continue\r\n\r\n")
    got = _raw(fake.url, head, timeout_s=DRAIN_S / 2)           # a server waiting for the body would time out
    assert got.startswith(b"HTTP/1.1 413 ")


def test_a_chunked_body_over_the_limit_is_413_and_never_kept(fake):
    sent = []

    def body(n: int):
        for _ in range(n):
            sent.append(1)
            yield b"x" * (1 << 20)
    r = httpx.post(f"{fake.url}/v1/chat/completions", content=body(8), headers={"content-type": "application/json"})
    assert "+ bytes" not in _error(r, 413, None)["message"]          # read to its end: the client reads the 413
    sent.clear()
    with httpx.Client(base_url=fake.url) as c:                      # past the drain bound: answered at once
        try:
            _error(c.post("/v1/chat/completions", content=body(200), headers={"content-type": "application/json"}),
                   413, None)
        except httpx.TransportError:                                # (its client may see the reset)
            pass
    assert len(sent) < 200


def test_metrics_are_labelled_by_route_not_by_path(fake):
    """Thousands of distinct paths leave /metrics as it was: one `other` series counts them all."""
    httpx.get(f"{fake.url}/v1/warm-up-{uuid.uuid4().hex}")            # the `other` series exist
    httpx.get(f"{fake.url}/{uuid.uuid4().hex}")
    before = httpx.get(f"{fake.url}/metrics").text
    with httpx.Client(base_url=fake.url) as c:
        for i in range(3000):
            assert c.get(f"/v1/{'p' * 200}{i}" if i % 2 else f"/{uuid.uuid4().hex * 8}").status_code == 404
    after = httpx.get(f"{fake.url}/metrics").text
    series = lambda text: sorted(l.rpartition(" ")[0] for l in text.splitlines() if l.startswith("kvplan_http"))
    assert series(after) == series(before)
    assert len(after) - len(before) < 200                           # (only counts' digits grow)
    assert 'route="other",status="404"' in after and "pppp" not in after


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
    ({"messages": [{"role": 3, "content": "hi"}]}, "messages[0].role"),
    ({"kv_strategy": "s" * 200}, "kv_strategy"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p for _, p in BAD])
def test_every_bad_field_is_400_in_openais_shape(fake, extra, param):
    body = json.dumps({"model": MODEL, "messages": HI, **extra})     # lone surrogates as JSON escapes
    r = httpx.post(f"{fake.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=10)
    err = _error(r, 400, param)
    assert err["type"] == "invalid_request_error" and err["message"].startswith(param)


def test_invalid_utf8_and_broken_json_are_400_in_openais_shape(fake):
    for raw in (b'{"model": "test-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
                b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,}',
                b"{not json"):
        r = httpx.post(f"{fake.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        err = _error(r, 400, None)                                  # no field: not a byte offset as `param`
        assert err["type"] == "invalid_request_error" and "detail" not in r.json()


def test_a_request_http_itself_cannot_parse_is_answered_in_openais_shape(fake):
    """uvicorn's own refusals (before any app runs) were plain text."""
    for head, status in ((b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
                         (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n", 400),
                         (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * (40 << 10), 431)):
        got = _raw(fake.url, head)
        assert got.startswith(f"HTTP/1.1 {status} ".encode()), got[:200]
        err = json.loads(got.partition(b"\r\n\r\n")[2])["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"].startswith("malformed HTTP request")


def test_a_huge_model_name_is_not_echoed_back_whole(fake):
    with pytest.raises(openai.NotFoundError) as e:
        openai.OpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=0).chat.completions.create(
            model="m" * (1 << 20), messages=HI)
    assert e.value.body["param"] == "model" and len(e.value.body["message"]) < 300


def test_unknown_routes_and_methods_answer_in_openais_shape(fake):
    _error(httpx.get(f"{fake.url}/v1/nothing-here"), 404, None)
    _error(httpx.get(f"{fake.url}/v1/chat/completions"), 405, None)


MALFORMED_KEYS = [b"Bearer a b\tc", b"Bearer " + b"k" * (60 << 10), b"Basic dXNlcjpwYXNz", b"Bearer", b"Bearer  ",
                  b"Bearer k\x01ey", "Bearer cl\u00e9".encode("latin-1")]


@pytest.mark.parametrize("header", MALFORMED_KEYS, ids=["spaces-and-tab", "60KB", "basic", "no-key", "blank",
                                                        "control", "latin-1"])
def test_a_malformed_key_is_401_in_openais_shape_and_never_sent_on(fake, header):
    """`Bearer a b\tc` was a 500 ("Invalid metadata", gRPC's refusal of the bytes); a 60 KB key a
    413 with gRPC's text."""
    body = json.dumps({"model": MODEL, "messages": HI}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: " + header + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    got = _raw(fake.url, head + body)
    assert got.startswith(b"HTTP/1.1 401 "), got[:200]
    err = json.loads(got.partition(b"\r\n\r\n")[2])["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key", err
    assert err["message"].startswith("Authorization: ") and len(err["message"]) < 200


def test_the_model_list_needs_a_key_the_executor_takes(tmp_path):
    keys = tmp_path / "keys.json"
    key = add_key(keys, "acme", "user")
    with FakeExecutor(interceptors=[Gate(KeyRing(keys))]) as fx, http_gateway(fx.address, MODEL) as url:
        for headers, status in (({}, 401), ({"Authorization": "Bearer kvp_not-a-key"}, 401),
                                ({"Authorization": f"Bearer {key}"}, 200)):
            r = httpx.get(f"{url}/v1/models", headers=headers)
            assert r.status_code == status, r.text
        assert r.json()["data"][0]["id"] == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="kvp_wrong", max_retries=0).models.list()
