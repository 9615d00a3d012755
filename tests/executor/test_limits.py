"""Limits before work on the executor (issue 23), over real gRPC with the real model (the
embedded default): each bad request of the hostile-client table is answered with a clear status
in under a second and the executor keeps serving; the queue is bounded, per tenant too, with
`retry-after` metadata."""
import time

import grpc
import pytest

from kvplan.client import ExecutorClient, request
from kvcore.serving import check_health
from protos import executor_pb2 as pb
from tests.executor.stack import embedded_with
from tests.metrics import summed

MAX_QUEUED, PER_TENANT = 6, 4


@pytest.fixture(scope="module")
def cluster(model_cfg, real_model_dir):
    with embedded_with(model_cfg, {"KVPLAN_MAX_QUEUED": str(MAX_QUEUED),
                                   "KVPLAN_MAX_QUEUED_PER_TENANT": str(PER_TENANT)}) as e:
        yield e


@pytest.fixture
def client(cluster):
    with ExecutorClient(cluster.executor_addr, timeout_s=300) as c:
        yield c


def work_done() -> tuple[float, float, float]:
    """What an accepted request costs, from the executor's own counters: engine steps, jobs refused
    once queued (tokenized or planned first) and prefills, all kinds and fields summed."""
    return (summed("kvplan_executor_steps"), summed("kvplan_executor_jobs_refused"),
            summed("kvplan_executor_prefill_seconds"))


def rejected(call, code: grpc.StatusCode, field: str) -> None:
    """`call` fails with `code`, its details naming `field`, before any expensive work: no engine
    step, no refusal after queueing, no prefill happened while it ran (a check by counters, not by
    the clock: a slow host must not fail it). Nothing else runs on this module's stack meanwhile."""
    before = work_done()
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details()[:200])
    assert e.value.details().startswith(field), e.value.details()[:200]
    assert work_done() == before, ("expensive work was done before the refusal", before, work_done())


def serving(cluster, client) -> None:
    """The executor still serves, and the counters `rejected` reads move when work is done."""
    assert check_health(cluster.executor_addr) == "SERVING"
    steps, _, prefills = work_done()
    assert client.run(request("Say hi.", max_new_tokens=2)).result.generated_tokens >= 1
    after = work_done()
    assert after[0] > steps and after[2] == prefills + 1, (steps, prefills, after)


@pytest.mark.parametrize("mb", [20, 200])
def test_a_huge_prompt_is_refused_before_it_is_read(cluster, client, mb):
    """Before: 200 MB killed the executor (tokenized before the length check); 20 MB took 32 s."""
    raw = request("x" * (mb << 20)).SerializeToString()           # built before the clock starts
    call = client.channel.unary_unary("/kvplan.v1.Executor/SubmitJob", request_serializer=None,
                                      response_deserializer=None)
    rejected(lambda: call(raw, timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED,
             "SERVER: Received message larger than max")
    serving(cluster, client)


BAD = [
    (dict(prompt="word " * (110 << 10)), "prompt"),                      # past KVPLAN_MAX_PROMPT_BYTES, under gRPC's
    (dict(prompt="hi", temperature=1e-40), "temperature"),               # accepted, then the job FAILED
    (dict(prompt="hi", temperature=float("inf")), "temperature"),
    (dict(prompt="hi", max_new_tokens=2**31 - 1), "max_new_tokens"),
    (dict(prompt="hi", tenant="acme\n2026-01-01 INFO kvplan.executor: forged"), "tenant"),   # forged log lines
    (dict(prompt="hi", profile="p" * 500), "profile"),
    (dict(messages=[{"role": "user", "content": "x"}] * 2000), "messages"),
]


@pytest.mark.parametrize("kwargs, field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_invalid_argument_before_any_work(cluster, client, kwargs, field):
    prompt = kwargs.pop("prompt", "")
    rejected(lambda: client.submit(request(prompt, **kwargs)), grpc.StatusCode.INVALID_ARGUMENT, field + ":")
    serving(cluster, client)


@pytest.mark.parametrize("method", ["SubmitJob", "GetJob", "CancelJob", "Generate", "WatchJob"])
def test_undecodable_bytes_are_invalid_argument(cluster, client, method):
    stream = method in ("Generate", "WatchJob")
    make = client.channel.unary_stream if stream else client.channel.unary_unary
    call = make(f"/kvplan.v1.Executor/{method}", request_serializer=None, response_deserializer=None)
    rejected(lambda: list(call(b"\xff\xff\xff\x07garbage", timeout=5)) if stream else
             call(b"\xff\xff\xff\x07garbage", timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "request:")
    serving(cluster, client)


def test_the_queue_is_bounded_globally_and_per_tenant(cluster, client):
    """Before: 200 jobs in 0.63 s, all accepted."""
    accepted, refused = [], []
    t0 = time.perf_counter()
    for i in range(200):
        try:
            accepted.append(client.submit(request("Write a long story.", max_new_tokens=300, tenant="flood")))
        except grpc.RpcError as e:
            refused.append(e)
    took = time.perf_counter() - t0
    try:
        assert len(accepted) == PER_TENANT and len(refused) == 200 - PER_TENANT
        e = refused[0]
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant 'flood'" in e.details()
        assert int(dict(e.trailing_metadata())["retry-after"]) >= 1
        others = [client.submit(request("Write a long story.", max_new_tokens=300, tenant=f"t{i}"))
                  for i in range(MAX_QUEUED - PER_TENANT)]
        accepted += others
        with pytest.raises(grpc.RpcError) as full:
            client.submit(request("hi", tenant="late"))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the queue is full" in full.value.details()
        print(f"\n200 submissions in {took:.2f}s: {PER_TENANT} accepted, {len(refused)} RESOURCE_EXHAUSTED")
    finally:
        for st in accepted:
            client.cancel(st.job_id)
    deadline = time.monotonic() + 60
    while any(client.get(st.job_id).state not in (pb.CANCELLED, pb.DONE) for st in accepted):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    serving(cluster, client)                       # the cancelled jobs left the queue: room again
