"""Compress instead of preempt, through the real services (the embedded default, real model): an
adaptive job that started while memory was free runs at 1.0; a second job arrives and waits for
bytes; the executor re-plans the first from the statistics it sent at the ratio the load calls for
and shrinks its cache mid-decode: its bytes drop to the new reservation, it keeps the unshrunk
run's text up to that point and finishes its tokens, and the second job runs beside it. A floor of
1.0 keeps the first job whole, and the second waits until it ends."""
import concurrent.futures as cf
import threading
import time

import pytest

from kvplan.client import ExecutorClient, request
from kvplan.demo import DEMO_CONTEXT, DEMO_QUESTION
from tests.executor.stack import demo_full_bytes, embedded_with

LONG, SHORT = 48, 4         # the running job's tokens, the arriving job's
SEEN = 4                    # the second job is sent once the first generated this many


@pytest.fixture(scope="module")
def full_bytes(real_model) -> int:
    return demo_full_bytes(real_model, LONG)


@pytest.fixture(scope="module")
def cluster(model_cfg, real_model_dir, full_bytes):
    with embedded_with(model_cfg, {"KVPLAN_KV_BUDGET_BYTES": str(int(1.8 * full_bytes))}) as e:     # one full job, not a second beside it
        yield e


def _job(new: int, floor: float = 0.0):
    return request(DEMO_CONTEXT, question=DEMO_QUESTION, max_new_tokens=new, strategy="auto", adaptive=True,
                   floor_ratio=floor, ignore_eos=True)


class _Run:
    """A job run on its own thread: its token ids and when each came."""

    def __init__(self, cluster, req):
        self.ids, self.times, self.seen = [], [], threading.Event()
        self.future = cf.ThreadPoolExecutor(1).submit(self._go, cluster.executor_addr, req)

    def _go(self, addr, req):
        def on_event(st, ev):
            if ev.WhichOneof("kind") == "delta":
                self.ids += list(ev.delta.token_ids)
                self.times += [time.monotonic()] * len(ev.delta.token_ids)
                if len(self.ids) >= SEEN:
                    self.seen.set()
        with ExecutorClient(addr, timeout_s=900) as c:
            return c.run(req, on_event)

    @property
    def result(self):
        return self.future.result(timeout=900).result


def _burst(cluster, floor: float) -> tuple[_Run, _Run]:
    first = _Run(cluster, _job(LONG, floor))
    assert first.seen.wait(600)
    second = _Run(cluster, _job(SHORT))
    second.result, first.result
    return first, second


@pytest.fixture(scope="module")
def alone(cluster):
    run = _Run(cluster, _job(LONG))
    assert (run.result.budget_ratio, run.result.budget_reason, list(run.result.shrinks)) == (1.0, "fits", [])
    return run


def test_a_running_job_is_shrunk_for_a_waiting_one_and_keeps_its_text(cluster, alone, full_bytes):
    first, second = _burst(cluster, floor=0.1)
    r = first.result
    assert (r.budget_ratio, r.budget_reason) == (1.0, "fits")          # as planned: memory was free
    assert len(r.shrinks) == 1, r
    s = r.shrinks[0]
    assert 0.1 <= s.ratio < 1.0 and SEEN <= s.generated_tokens < LONG
    print(f"\nshrunk to {s.ratio:g} after {s.generated_tokens} tokens: KV {s.kv_bytes_before} -> {s.kv_bytes_after} "
          f"bytes, reserved {s.reserved_before} -> {s.reserved_after} (budget {int(1.8 * full_bytes)}); at its end "
          f"{r.kv_bytes} of {r.kv_reserved_bytes} reserved, reserve ratio {r.reserve_ratio:.3f}")
    # its bytes drop to at most the new reservation, and stay there to the last token
    assert s.kv_bytes_after < s.kv_bytes_before and s.kv_bytes_after <= s.reserved_after < s.reserved_before
    assert r.kv_bytes <= r.kv_reserved_bytes == s.reserved_after and r.reserve_ratio < 0.9
    # the same text as the unshrunk run up to the shrink, and every token after it
    assert r.finish_reason == "length" and r.generated_tokens == LONG == len(first.ids)
    assert first.ids[:s.generated_tokens] == alone.ids[:s.generated_tokens]
    # the waiting job was admitted because of the shrink: it ran beside the first, not after it
    assert second.result.generated_tokens == SHORT and second.times[0] < first.times[-1]
    assert second.result.queue_s > 0.0


def test_a_floor_of_one_keeps_the_running_job_whole_and_the_other_waits(cluster):
    first, second = _burst(cluster, floor=1.0)
    r = first.result
    assert list(r.shrinks) == [] and r.budget_ratio == 1.0 and r.reserve_ratio == pytest.approx(1.0, abs=0.02)
    assert r.generated_tokens == LONG and second.result.generated_tokens == SHORT
    assert second.times[0] > first.times[-1]                 # it waited until the first ended
