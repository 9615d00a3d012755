"""The Python SDK: the README's example runs as written and prints the answer and its ratio;
`kvplan.Client` over the real model (generate -> Result, stream -> text pieces, a budget with
no strategy is `auto`'s, bad input is ValueError naming the SDK's own argument — also a budget
its strategy cannot hold, refused with the ratio that would fit, and after auto's own prefill
with no text streamed first; stop sequences end the text);
over a scripted executor: a broken stream re-attaches to its job and a re-run's text is yielded
once, the API key travels as metadata, a refused key is the SDK's AuthenticationError (a real
executor's refusal: tests/kvcore/test_auth.py), an address that does not answer says so."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvplan
from kvplan.demo import DEMO_CONTEXT, DEMO_QUESTION
from cachestore.process import free_port
from tests.kvplan.fake_executor import FakeExecutor, events, result

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    """The Python block after the README's `<!-- sdk-example -->` marker."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- sdk-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md has no <!-- sdk-example --> python block"
    return m.group(1)


def test_the_readme_example_runs_and_prints_the_answer_and_its_ratio(real_model_dir):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 10
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(got.stdout)
    assert got.returncode == 0, got.stderr[-3000:]
    answer, ratio = got.stdout.strip().splitlines()[-2:]
    assert "Ines Rocha" in answer and 0 < float(ratio) <= 0.2


def test_client_generates_and_streams_over_the_real_model(embedded):
    with kvplan.Client(embedded.executor_addr) as client:
        r = client.generate(DEMO_CONTEXT, question=DEMO_QUESTION, ratio=0.2, max_new_tokens=24)
        assert isinstance(r, kvplan.Result) and r.strategy == "auto"       # a budget and no strategy: auto
        assert r.budget_met is not False and 0 < r.kv_bytes < r.full_kv_bytes and r.reserve_ratio <= 0.2
        assert r.attempts == 1 and not r.degraded and r.warnings(0.2) == []
        assert r.kv_risk == 0.0 and r.kv_at_risk is False and r.raw.kv_at_risk is False   # copied from the prompt
        s = client.stream("What is the capital of France?", max_new_tokens=12)
        pieces = list(s)
        assert len(pieces) > 1 and "".join(pieces) == s.result.text and "Paris" in s.result.text
        with pytest.raises(ValueError, match=r"^ratio: must be in \(0, 1\], got 1\.5$"):
            client.generate("hi", ratio=1.5)                 # the SDK's argument, not budget.reserve_ratio
        with pytest.raises(ValueError, match=r"^ratio: snapkv cannot hold reserve ratio 0\.5 on this job \(\d+ prompt "
                                             r"tokens, 4 new tokens\).* keeps at least 32; reserve ratio (0\.\d+|1) fits"):
            client.generate("Name three colours of the rainbow.", strategy="snapkv", ratio=0.5, max_new_tokens=4)
        stopped = client.generate("List the days of the week, separated by commas.", max_new_tokens=40,
                                  stop=["Wednesday"], logprobs=2)
        assert stopped.finish_reason == "stop" and "Wednesday" not in stopped.text and "Tuesday" in stopped.text
        lps = stopped.raw.logprobs
        assert len(lps) == stopped.generated_tokens and all(len(x.top) == 2 and x.logprob <= 0 for x in lps)
        assert all(x.top[0].logprob >= x.logprob - 1e-4 for x in lps)      # greedy: the top token is the chosen one
        assert [x.token_id for x in lps] == [x.top[0].token_id for x in lps]


def test_auto_refused_streams_no_text_before_the_error(embedded):
    """auto plans from its own prefill's statistics; its refusal of a budget came after the
    prefill, when the first token was already sampled, and that token ("The") was streamed before
    the job failed. The first token waits for the plan, and such a budget is now refused before
    the prefill (planner/precheck.py; tests/executor/test_service.py)."""
    context = " ".join(DEMO_CONTEXT.split(" ")[:282])                 # ~413 tokens with the template
    with kvplan.Client(embedded.executor_addr) as client:
        s = client.stream(context, strategy="auto", ratio=0.3, max_new_tokens=128)
        pieces = []
        with pytest.raises(ValueError, match=r"^ratio: auto cannot hold reserve ratio 0\.3 .* reserve ratio 0\.\d+ fits"):
            for piece in s:
                pieces.append(piece)
        assert pieces == []


def test_a_broken_stream_reattaches_and_a_rerun_is_yielded_once():
    with FakeExecutor() as fx, kvplan.Client(fx.address, api_key="sk-a", reattach=2) as client:
        fx.script.events = events((1, ["The", " cap"]), (2, ["The", " cap", "ital", " is Paris."]),
                                  result=result("The capital is Paris."))
        fx.script.break_generate_after = 3                 # the executor died after "The"
        s = client.stream("hi", temperature=0.8)
        assert "".join(s) == "The capital is Paris." and s.result.attempts == 2
        assert fx.script.calls == ["Generate", "WatchJob"]
        assert {m["authorization"] for m in fx.script.metadata} == {"Bearer sk-a"}
        assert fx.script.requests[0].HasField("seed")      # sampled: a seed, so a re-run replays the text


def test_a_refused_key_is_the_sdks_own_error():
    import grpc
    with FakeExecutor() as fx, kvplan.Client(fx.address, api_key="kvp_wrong") as client:
        fx.script.reject = (grpc.StatusCode.UNAUTHENTICATED, "unknown API key", ())
        with pytest.raises(kvplan.AuthenticationError, match="refused the API key \\(unknown API key\\).*KVPLAN_API_KEY"):
            client.generate("hi")
        fx.script.reject = (grpc.StatusCode.INVALID_ARGUMENT, "budget.kv_tokens: must be >= 1, got 0", ())
        with pytest.raises(ValueError, match=r"^kv_tokens: must be >= 1, got 0$"):
            client.generate("hi", kv_tokens=0)


def test_a_failed_job_raises_job_failed():
    from protos import executor_pb2 as pb
    with FakeExecutor() as fx, kvplan.Client(fx.address) as client:
        fx.script.events = events((1, ["x"])) + [pb.JobEvent(job_id="job0", attempt=1, status=pb.JobStatus(
            job_id="job0", state=pb.FAILED, error="boom"))]
        with pytest.raises(kvplan.JobFailed, match="job job0 ended FAILED: boom"):
            client.generate("hi")


def test_an_address_that_does_not_answer_says_so():
    with kvplan.Client(f"127.0.0.1:{free_port()}", timeout_s=5) as client:
        with pytest.raises(ConnectionError, match="`kvplan up` starts a local cluster"):
            client.generate("hi")
