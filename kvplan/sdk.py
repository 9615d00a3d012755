"""The Python SDK: `kvplan.Client` over a running cluster's gRPC API.

    import kvplan
    with kvplan.Client("127.0.0.1:50052", api_key="...") as client:
        r = client.generate(context, question="Who signed it?", strategy="auto", ratio=0.2)
        print(r.text, r.reserve_ratio)
        for text in client.stream("Tell me about KV caches", max_new_tokens=64):
            print(text, end="", flush=True)

A job survives the executor that held it; so does a call here: if the stream breaks while the
job runs (the executor answering it went away), the client re-attaches to the job (`WatchJob`,
which replays it) on the next executor it knows (`Client("host1:50052,host2:50052")`, or a
list; each in turn, the one that broke last) and goes on from where it was, and a re-run's text
is never yielded twice (`kvplan.attempts`). A sampled request without a seed gets one, so a re-run
replays the same text. Errors are the SDK's own, in its own words: bad input raises `ValueError`
naming this module's argument (`ratio: must be in (0, 1], got 1.5`), also when the executor
refuses it after tokenizing or planning (a budget its strategy cannot hold, with the ratio that
would); a key the executor does not take raises `AuthenticationError`; a job that fails raises
`JobFailed`; an address where nothing answers raises `ConnectionError`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc

from kvplan.attempts import AttemptText
from kvplan.client import REPLAY, executor_addresses, follow, request
from kvcore.serving import channel_options
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc


# request fields (the executor's checks name them) -> this module's arguments
ARGS = {"budget.reserve_ratio": "ratio", "budget.kv_tokens": "kv_tokens", "top_logprobs": "logprobs"}


class AuthenticationError(PermissionError):
    """The executor refused the API key (none, unknown, or without the role the call needs)."""


def _bad(field: str, details: str) -> ValueError:
    """The executor's `field: message` in this module's argument names."""
    arg = ARGS.get(field, field)
    return ValueError(f"{arg}: {details.removeprefix(field + ': ')}")


class JobFailed(RuntimeError):
    """The job ended FAILED or CANCELLED; `status` is its last JobStatus."""

    def __init__(self, status: pb.JobStatus):
        super().__init__(f"job {status.job_id} ended {pb.JobState.Name(status.state)}"
                         + (f": {status.error}" if status.error else ""))
        self.status = status


@dataclass(frozen=True)
class Result:
    """One job's answer and what its cache held."""

    text: str
    job_id: str
    strategy: str
    prompt_tokens: int
    generated_tokens: int
    kv_bytes: int                    # bytes every tensor of the cache held
    full_kv_bytes: int               # the uncompressed cache of the same tokens (storage dtype)
    reserve_ratio: float             # kv_bytes / full_kv_bytes
    degraded: bool                   # the planner or the cachestore was lost: a fallback ran
    budget_met: bool | None          # the plan held the budget asked (None: not judged)
    budget_floor_tokens: int         # fewest prompt tokens per KV head the plan kept in a layer
    finish_reason: str               # "eos" | "length" | "stop" (a stop sequence)
    attempts: int                    # executors that ran it
    prefill_s: float
    decode_tokens_per_s: float
    raw: pb.JobResult = field(repr=False, compare=False)
    kv_risk: float = 0.0             # share of the answer not copied from the prompt (executor.engine.risk)
    kv_at_risk: bool = False         # its cache was compressed and kv_risk is above the measured threshold

    def warnings(self, ratio: float | None = None) -> list[str]:
        """What a user must be told about this answer: a fallback ran (degraded), or the cache
        did not hold the budget asked (`ratio`: the reserve ratio asked, if any)."""
        out = []
        if self.degraded:
            out.append(f"job {self.job_id} ran DEGRADED ({self.strategy} plan: the planner or the cachestore was "
                       "lost, so it fell back; see the executor's log)")
        if self.budget_met is False:
            asked = f"reserve ratio {ratio:g}" if ratio is not None else "its KV budget"
            out.append(f"job {self.job_id}'s {self.strategy} plan could not promise {asked} at every step: it keeps "
                       f"at least {self.budget_floor_tokens} of the {self.prompt_tokens} prompt tokens per KV head "
                       f"(window, sinks, or no compression), and each generated token's row comes on top; "
                       f"measured at its end, after {self.generated_tokens} tokens, it held {self.reserve_ratio:.3f}")
        elif ratio is not None and ratio < 1 and self.reserve_ratio > ratio + 1e-3:     # (at 1: the last blocks, _blocks says)
            out.append(f"job {self.job_id} held reserve ratio {self.reserve_ratio:.3f}, above the {ratio:g} asked")
        if self.kv_at_risk:
            out.append(f"job {self.job_id}'s answer is AT RISK from its compression ({self.strategy}, reserve ratio "
                       f"{self.reserve_ratio:.3f}): {self.kv_risk:.0%} of it is not copied from the prompt, as answers "
                       f"its compressed cache got wrong were on the quality bench; check it against a larger ratio")
        return out

    @classmethod
    def of(cls, job_id: str, attempts: int, r: pb.JobResult) -> "Result":
        return cls(r.text, job_id, r.strategy, r.prompt_tokens, r.generated_tokens, r.kv_bytes, r.full_kv_bytes,
                   r.reserve_ratio, r.degraded, r.budget_met if r.HasField("budget_met") else None,
                   r.budget_floor_tokens, r.finish_reason, attempts, r.prefill_s, r.decode_tokens_per_s, r,
                   r.kv_risk, r.kv_at_risk)


class Streaming:
    """`Client.stream(...)`: iterate for the text as it is generated; `.result` once it ends."""

    def __init__(self, client: "Client", req: pb.GenerateRequest):
        self._client, self._req = client, req
        self.result: Result | None = None

    def __iter__(self) -> Iterator[str]:
        text = AttemptText()
        job_id = ""
        for ev in self._client._events(self._req):
            if ev is REPLAY:
                text.replay()
                continue
            job_id = ev.job_id
            kind = ev.WhichOneof("kind")
            if kind == "delta":
                new = text.feed(ev.attempt, ev.delta.text)
                if new:
                    yield new
            elif kind == "result":
                rest = text.finish(ev.result.text)
                if rest:
                    yield rest
                self.result = Result.of(job_id, ev.attempt, ev.result)


class Client:
    def __init__(self, address: str | Sequence[str] | None = None, api_key: str | None = None,
                 timeout_s: float = 3600.0, reattach: int = 5):
        """address: an executor's HOST:PORT, or several (comma-separated, or a list: a broken
        stream re-attaches on the others; default KVPLAN_EXECUTOR_ADDR, or 127.0.0.1:50052);
        api_key: sent as `authorization: Bearer <key>` (default KVPLAN_API_KEY); TLS as
        KVPLAN_TLS_* say (`kvcore.channels`); reattach: how many times in a row a broken stream
        re-attaches to its job (with backoff) before the error is raised."""
        import dataclasses
        from kvcore.channels import client_channel
        from kvcore.config import ClientConfig, SecurityConfig, from_env
        self.addresses = executor_addresses(address or from_env(ClientConfig).executor_addr)
        self.address = self.addresses[0]
        self.timeout_s, self.reattach = timeout_s, reattach
        sec = from_env(SecurityConfig)
        if api_key is not None:
            sec = dataclasses.replace(sec, api_key=api_key)
        self._channels = [client_channel(a, options=channel_options(), sec=sec) for a in self.addresses]
        self._stubs = [executor_pb2_grpc.ExecutorStub(ch) for ch in self._channels]
        self._stub = self._stubs[0]

    def generate(self, prompt: str = "", **kw) -> Result:
        """Run one job and return its Result. Keywords: messages, question, strategy, ratio,
        kv_tokens, max_new_tokens, temperature, top_p, seed, stop, logprobs."""
        s = self.stream(prompt, **kw)
        for _ in s:
            pass
        return s.result

    def stream(self, prompt: str = "", *, messages: list[dict[str, str]] | None = None, question: str = "",
               strategy: str = "", ratio: float | None = None, kv_tokens: int | None = None,
               max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float | None = None,
               seed: int | None = None, stop: Sequence[str] = (), logprobs: int | None = None) -> Streaming:
        """The job's text as it is generated (iterate), then `.result`. A budget (`ratio` or
        `kv_tokens`) without a strategy is planned by the planner's default, or `auto` when that
        is `full`. `stop`: stop sequences (the text ends before the first one generated);
        `logprobs`: each token's log-probability and this many top tokens' (`Result.raw.logprobs`)."""
        if seed is None and temperature > 0:
            seed = random.getrandbits(63)
        return Streaming(self, request(prompt, messages=messages, question=question, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, seed=seed, strategy=strategy,
                                       reserve_ratio=ratio, kv_tokens=kv_tokens, stop=stop, top_logprobs=logprobs))

    def _events(self, req: pb.GenerateRequest) -> Iterator[pb.JobEvent]:
        """The job's events until its result; re-attaches to the job when the stream breaks
        (`kvplan.client.follow`), REPLAY marking where its events start again."""
        try:
            for ev in follow(self._stubs, req, self.timeout_s, self.reattach):
                yield ev
                kind = ev.WhichOneof("kind") if ev is not REPLAY else None
                if kind == "status" and ev.status.state == pb.DONE and ev.status.HasField("result"):
                    yield pb.JobEvent(job_id=ev.job_id, attempt=ev.attempt, result=ev.status.result)
                    return                      # (its event log expired: the status carries the result)
                if kind == "status" and ev.status.state == pb.FAILED and ev.status.error_field:
                    raise _bad(ev.status.error_field, ev.status.error)      # refused once tokenized or planned
                if kind == "status" and ev.status.state in (pb.FAILED, pb.CANCELLED):
                    raise JobFailed(ev.status)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _error(self, e: grpc.RpcError) -> Exception:
        """A gRPC error as this SDK's own: ValueError, AuthenticationError, ConnectionError, or
        RuntimeError with the status's name and details."""
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            field, sep, _ = details.partition(": ")
            return _bad(field, details) if sep and " " not in field else ValueError(details)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return AuthenticationError(f"the executor at {self.address} refused the API key ({details}): pass "
                                       "api_key=, or set KVPLAN_API_KEY, to a key of `kvplan keys add`")
        if code == grpc.StatusCode.UNAVAILABLE:
            return ConnectionError(f"no executor answers at {', '.join(self.addresses)} ({details}); "
                                   "`kvplan up` starts a local cluster")
        return RuntimeError(f"{code.name}: {details}")

    def cancel(self, job_id: str) -> None:
        try:
            self._stub.CancelJob(pb.JobRef(job_id=job_id), timeout=30)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
