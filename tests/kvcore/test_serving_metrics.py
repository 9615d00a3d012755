"""The services' RPC metrics: a streaming RPC is counted and timed until its last message, in
buckets that reach minutes (a Generate stream lasts as long as its job)."""
from __future__ import annotations

from prometheus_client import REGISTRY

from kvplan.client import ExecutorClient, fold, request, Stream
from kvcore.serving import SECONDS_BUCKETS, _MetricsInterceptor
from tests.kvplan.fake_executor import FakeExecutor, events, result


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_streaming_rpc_is_counted_and_timed_to_its_end():
    labels = dict(service="stream-test", method="Generate")
    before = _sample("kvplan_rpc_seconds_count", **labels)
    with FakeExecutor(interceptors=[_MetricsInterceptor("stream-test")]) as fx, ExecutorClient(fx.address, 30) as c:
        fx.script.events = events((1, ["a", "b", "c"]), result=result("abc"))
        st = Stream()
        for ev in c.generate(request("hi")):
            fold(st, ev)
    assert st.result.text == "abc"
    assert _sample("kvplan_rpc_seconds_count", **labels) == before + 1
    assert _sample("kvplan_rpc_seconds_sum", **labels) > 0           # the stream's 6 events, 10 ms apart
    assert _sample("kvplan_rpcs_total", code="OK", **labels) >= 1
    assert max(SECONDS_BUCKETS) >= 600 and _sample("kvplan_rpc_seconds_bucket", le="1800.0", **labels) >= 1
