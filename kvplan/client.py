"""Client SDK: submit jobs, stream their events, manage planner strategies. Synchronous gRPC.

An executor address may name several executors (`HOST:PORT,HOST:PORT`, KVPLAN_EXECUTOR_ADDR): a
job lives in the job queue they share, so when the stream of the executor answering it breaks
(that executor died), `follow` re-attaches to the job with `WatchJob` on the next one, in turn,
with backoff — wherever the job is re-run — and marks where its replayed events start (REPLAY)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from kvcore.channels import client_channel
from kvcore.config import addresses
from kvcore.serving import channel_options
from protos import common_pb2, executor_pb2, executor_pb2_grpc, planner_pb2, planner_pb2_grpc


def request(prompt: str = "", *, messages: list[dict[str, str]] | None = None, question: str = "",
            max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float | None = None,
            seed: int | None = None, strategy: str = "", reserve_ratio: float | None = None,
            kv_tokens: int | None = None, tenant: str = "", profile: str = "",
            ignore_eos: bool = False, adaptive: bool = False, floor_ratio: float = 0.0,
            stop: Sequence[str] = (), top_logprobs: int | None = None,
            raw_prompt: bool = False) -> executor_pb2.GenerateRequest:
    """adaptive: the largest reserve ratio the executor's load leaves room for, not below
    `floor_ratio` (instead of reserve_ratio / kv_tokens); stop: stop sequences; top_logprobs:
    each token's log-probability and this many top tokens' (0: the token's alone); raw_prompt:
    the prompt is the model's input as it is (no chat template)."""
    budget = common_pb2.Budget()
    if adaptive:
        budget.adaptive.floor_ratio = floor_ratio
    if reserve_ratio is not None:
        budget.reserve_ratio = reserve_ratio
    if kv_tokens is not None:
        budget.kv_tokens = kv_tokens
    req = executor_pb2.GenerateRequest(
        prompt=prompt, question=question, temperature=temperature, strategy=strategy, budget=budget,
        tenant=tenant, profile=profile, ignore_eos=ignore_eos, stop=list(stop), raw_prompt=raw_prompt,
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages or []])
    if top_logprobs is not None:
        req.top_logprobs = top_logprobs
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    if top_p is not None:
        req.top_p = top_p
    if seed is not None:
        req.seed = seed
    return req


def result_dict(result: executor_pb2.JobResult) -> dict:
    """The result statistics as plain JSON-able data (the CLI's `--json` object): every field,
    64-bit integers as JSON numbers (protobuf's JSON form writes them as strings), nested ones too."""
    d = json_format.MessageToDict(result, preserving_proto_field_name=True,
                                  always_print_fields_with_no_presence=True)
    return _numbers(d, result.DESCRIPTOR)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _numbers(d: dict, desc) -> dict:
    """`d` (a message's JSON form) with its 64-bit integer fields as ints, walking nested messages."""
    for f in desc.fields:
        if f.name not in d:
            continue
        repeated = f.is_repeated
        if f.message_type is not None:
            d[f.name] = [_numbers(x, f.message_type) for x in d[f.name]] if repeated else \
                _numbers(d[f.name], f.message_type)
        elif f.type in _INT64:
            d[f.name] = [int(x) for x in d[f.name]] if repeated else int(d[f.name])
    return d


RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
REPLAY = executor_pb2.JobEvent()      # `follow`'s marker: the job's events start again (a re-attach)
TERMINAL = (executor_pb2.DONE, executor_pb2.FAILED, executor_pb2.CANCELLED)


def executor_addresses(address: str | Sequence[str]) -> tuple[str, ...]:
    """`HOST:PORT`, `HOST:PORT,HOST:PORT` or a list of them, as a tuple."""
    if isinstance(address, str):
        return addresses(address, "executor address")
    return tuple(address)


def follow(stubs: Sequence[executor_pb2_grpc.ExecutorStub], req: executor_pb2.GenerateRequest, timeout_s: float,
           reattach: int = 5, first: int = 0, sleep=time.sleep) -> Iterator[executor_pb2.JobEvent]:
    """`Generate` on stubs[first], then the job's events until its result or its terminal status.
    A stream that breaks while the job runs re-attaches with `WatchJob` on the next executor (in
    turn, with backoff, at most `reattach` times in a row), yielding REPLAY before the replayed
    events; a call that fails before the job exists with UNAVAILABLE (nothing listens there)
    goes to the next executor. Other errors, and the last one, raise `grpc.RpcError`."""
    i, job_id, tries, untried = first, "", 0, len(stubs) - 1
    call = stubs[i].Generate(req, timeout=timeout_s)
    while True:
        try:
            for ev in call:
                job_id, tries = ev.job_id, 0
                yield ev
                kind = ev.WhichOneof("kind")
                if kind == "result" or (kind == "status" and ev.status.state in TERMINAL):
                    return
            raise ConnectionError(f"job {job_id}: the stream ended without a result")
        except grpc.RpcError as e:
            if not job_id and e.code() == grpc.StatusCode.UNAVAILABLE and untried:
                untried -= 1                           # no job yet: submit to the next executor
                i = (i + 1) % len(stubs)
                call = stubs[i].Generate(req, timeout=timeout_s)
                continue
            if not job_id or e.code() not in RETRY_CODES or tries >= reattach:
                raise
            tries += 1
            sleep(min(10.0, 0.5 * 2 ** tries))
            i = (i + 1) % len(stubs)
            call = stubs[i].WatchJob(executor_pb2.JobRef(job_id=job_id), timeout=timeout_s)
            yield REPLAY


@dataclass
class Stream:
    """What a client assembles from a job's events (it restarts when the attempt changes)."""

    job_id: str = ""
    attempt: int = 0
    text: str = ""
    result: executor_pb2.JobResult | None = None
    status: executor_pb2.JobStatus | None = None


class _Client:
    stub_class = None

    def __init__(self, address: str | Sequence[str]):
        """address: HOST:PORT, or several (comma-separated, or a list): calls go to the first, a
        broken job stream re-attaches on the others."""
        self.addresses = executor_addresses(address)
        # TLS and KVPLAN_API_KEY from the env
        self.channels = [client_channel(a, options=channel_options()) for a in self.addresses]
        self.stubs = [self.stub_class(ch) for ch in self.channels]
        self.channel, self.stub = self.channels[0], self.stubs[0]

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ExecutorClient(_Client):
    stub_class = executor_pb2_grpc.ExecutorStub

    def __init__(self, address: str | Sequence[str], timeout_s: float = 3600.0, reattach: int = 5):
        super().__init__(address)
        self.timeout_s, self.reattach = timeout_s, reattach

    def generate(self, req: executor_pb2.GenerateRequest) -> Iterator[executor_pb2.JobEvent]:
        return self.stub.Generate(req, timeout=self.timeout_s)

    def submit(self, req: executor_pb2.GenerateRequest) -> executor_pb2.JobStatus:
        return self.stub.SubmitJob(req, timeout=30)

    def get(self, job_id: str) -> executor_pb2.JobStatus:
        return self.stub.GetJob(executor_pb2.JobRef(job_id=job_id), timeout=30)

    def watch(self, job_id: str) -> Iterator[executor_pb2.JobEvent]:
        return self.stub.WatchJob(executor_pb2.JobRef(job_id=job_id), timeout=self.timeout_s)

    def cancel(self, job_id: str) -> executor_pb2.JobStatus:
        return self.stub.CancelJob(executor_pb2.JobRef(job_id=job_id), timeout=30)

    def run(self, req: executor_pb2.GenerateRequest, on_event=None) -> Stream:
        """Generate and collect: the final text and result, calling on_event(stream, event) per event
        (REPLAY too, when a broken stream re-attached: the job's events start again)."""
        st = Stream()
        for ev in follow(self.stubs, req, self.timeout_s, self.reattach):
            fold(st, ev)
            if on_event:
                on_event(st, ev)
        return st


def fold(st: Stream, ev: executor_pb2.JobEvent) -> None:
    if ev is REPLAY:                                    # every attempt's events again, from the first
        st.attempt, st.text = 0, ""
        return
    st.job_id = ev.job_id
    if ev.attempt > st.attempt:
        st.attempt, st.text = ev.attempt, ""
    kind = ev.WhichOneof("kind")
    if kind == "delta":
        st.text += ev.delta.text
    elif kind == "result":
        st.result = ev.result
    elif kind == "status":
        st.status = ev.status
        if ev.status.HasField("result"):
            st.result = ev.status.result


class PlannerClient(_Client):
    stub_class = planner_pb2_grpc.PlannerStub

    def strategies(self, check_model: bool = False) -> planner_pb2.StrategyList:
        """check_model: also which compress nothing on the planner's model (its first ask loads and
        probes the model: a longer deadline)."""
        return self.stub.ListStrategies(planner_pb2.ListStrategiesRequest(check_model=check_model),
                                        timeout=120 if check_model else 10)

    def set_strategy(self, name: str) -> planner_pb2.StrategyInfo:
        return self.stub.SetStrategy(planner_pb2.SetStrategyRequest(name=name), timeout=10)

    def define_strategy(self, definition: str, activate: bool = False) -> planner_pb2.StrategyInfo:
        """Register (or replace) the strategy a definition (JSON or YAML text) names; with
        `activate`, also make it the default for jobs that name none."""
        return self.stub.SetStrategy(planner_pb2.SetStrategyRequest(definition=definition, activate=activate),
                                     timeout=10)
