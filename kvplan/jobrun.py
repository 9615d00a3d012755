"""`kvplan generate` and `kvplan demo`: where a job runs (an explicit address, a `kvplan up`
cluster, or the embedded default), its request checked before any service starts or is called
(bad input exits 2 at once, naming the flag), its text streamed, and what the user must be told
about its answer — degraded, or a budget not held — warned on stderr whatever the output mode
(`--strict`: exit 3)."""
from __future__ import annotations

import contextlib
import json
import os
import sys

from kvcore.blocks import BLOCK_ROWS
from kvcore.config import ClientConfig, ClusterConfig, ModelConfig, from_env

STRICT_EXIT = 3
# request fields (the executor's checks name them) -> the flags that set them
FLAGS = {"budget.reserve_ratio": "--ratio", "budget.kv_tokens": "--kv-tokens", "budget.adaptive.floor_ratio": "--floor",
         "max_new_tokens": "--max-new-tokens",
         "temperature": "--temperature", "top_p": "--top-p", "prompt": "PROMPT", "question": "--question",
         "strategy": "--strategy", "stop": "--stop"}


class BadFlag(ValueError):
    """A flag's value the job cannot run with: exit code 2."""


@contextlib.contextmanager
def executor_address(ccfg: ClusterConfig, mcfg: ModelConfig, quiet: bool):
    """An explicit KVPLAN_EXECUTOR_ADDR, else a running `kvplan up` cluster, else embedded. A
    cluster that is up but unhealthy is an error (`cluster.Unhealthy`, exit 1), never a reason to
    run the job elsewhere: the embedded default has none of the cluster's keys or settings."""
    from kvplan import cluster
    if "KVPLAN_EXECUTOR_ADDR" in os.environ:
        yield from_env(ClientConfig).executor_addr
        return
    addr = cluster.running_executor(ccfg, mcfg)
    if addr:
        yield addr
        return
    from kvplan.embedded import Embedded
    from kvplan.ticker import Ticker
    if not quiet:
        print("kvplan: no cluster is up; running the embedded default (all services in this process)",
              file=sys.stderr)
    embedded = Embedded(mcfg)
    with Ticker("starting the embedded services (loading the model)", lines=False, follow_logs=True,
                tty=None if not quiet else False):
        embedded.__enter__()
    try:
        yield embedded.executor_addr
    finally:
        embedded.__exit__(None, None, None)


def generate(args, text: str, ccfg: ClusterConfig, mcfg: ModelConfig) -> int:
    from kvplan.client import ExecutorClient, result_dict
    from kvplan.progress import EventPrinter
    from kvplan.sdk import Result

    req = checked_request(args, text, embedded=embedded_default(ccfg, mcfg))
    with executor_address(ccfg, mcfg, quiet=args.json) as addr, \
            ExecutorClient(addr, from_env(ClientConfig).timeout_s) as client:
        printer = EventPrinter(stream_text=not args.json, progress=not args.no_progress)
        st = client.run(req, printer)
        printer.close()
    if st.result is None:
        state = st.status.state if st.status else 0
        if st.status is not None and st.status.error_field:          # refused once tokenized or planned
            field = st.status.error_field
            raise BadFlag(f"{FLAGS.get(field, field)}: {st.status.error.removeprefix(field + ': ')}")
        from protos import executor_pb2
        name = executor_pb2.JobState.Name(state)
        print(f"kvplan: job {st.job_id} ended {name}: {st.status.error if st.status else ''}", file=sys.stderr)
        return 1
    r = st.result
    if args.json:
        print(json.dumps({"job_id": st.job_id, **result_dict(r)}), flush=True)
    else:
        print(f"\n[{r.strategy} plan {r.plan_id}: {r.prompt_tokens} prompt + {r.generated_tokens} generated tokens; "
              f"KV {r.kv_bytes / 2**20:.2f} MiB of {r.full_kv_bytes / 2**20:.2f} MiB "
              f"(reserve ratio {r.reserve_ratio:.3f}{_blocks(r)}{_adaptive(r)}); prefill {r.prefill_s:.2f}s, "
              f"decode {r.decode_tokens_per_s:.1f} tok/s{'; DEGRADED' if r.degraded else ''}]", file=sys.stderr)
    warnings = Result.of(st.job_id, st.attempt, r).warnings(args.ratio)
    for w in warnings:                       # on stderr whatever the output mode: never silent
        print(f"kvplan: warning: {w}", file=sys.stderr)
    return STRICT_EXIT if warnings and args.strict else 0


def _blocks(r) -> str:
    """Why a cache holds more than the full cache of its tokens: whole pool blocks."""
    if r.reserve_ratio <= 1.0:
        return ""
    return (f", above 1: the pool holds whole blocks of {BLOCK_ROWS} rows per KV head and layer, "
            f"and {r.prompt_tokens + r.generated_tokens} tokens fill their last blocks only in part")


def _adaptive(r) -> str:
    """An adaptive budget's choice, as the result line says it."""
    if not r.budget_reason:
        return ""
    shrunk = "".join(f", shrunk to {s.ratio:g} after {s.generated_tokens} tokens" for s in r.shrinks)
    return f"; adaptive: {r.budget_ratio:g}, {r.budget_reason}{shrunk}"


def embedded_default(ccfg: ClusterConfig, mcfg: ModelConfig) -> bool:
    """Whether `generate` would run the embedded default (no address set, no cluster up); an
    unhealthy cluster is not (`executor_address` says so, after the request's own checks)."""
    from kvplan import cluster
    if "KVPLAN_EXECUTOR_ADDR" in os.environ:
        return False
    try:
        return cluster.running_executor(ccfg, mcfg) is None
    except cluster.Unhealthy:
        return False


def checked_request(args, text: str, embedded: bool):
    """The job's request with the executor's own field checks run here, before any service
    starts or is called: bad input exits 2 at once, naming the flag."""
    from executor import validation
    from kvplan.client import request
    from kvcore.request import InvalidRequest
    for flag, value, lo, hi in (("--seed", args.seed, 0, 2 ** 64 - 1), ("--max-new-tokens", args.max_new_tokens, 1, 2 ** 31 - 1),
                                ("--kv-tokens", args.kv_tokens, 1, 2 ** 63 - 1)):
        if value is not None and not lo <= value <= hi:
            raise BadFlag(f"{flag}: must be in [{lo}, {hi}], got {value}")
    if args.floor is not None and args.budget != "adaptive":
        raise BadFlag("--floor: the lowest ratio of an adaptive budget: give it with --budget adaptive "
                      f"(got --floor {args.floor:g} with {'--ratio' if args.ratio is not None else '--kv-tokens' if args.kv_tokens is not None else 'no --budget'})")
    req = request(text, question=args.question, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, seed=args.seed, strategy=args.strategy,
                  reserve_ratio=args.ratio, kv_tokens=args.kv_tokens, tenant=args.tenant,
                  adaptive=args.budget == "adaptive", floor_ratio=args.floor or 0.0, stop=args.stop)
    try:
        validation.check(req, 1)
    except InvalidRequest as e:
        raise BadFlag(f"{FLAGS.get(e.field, e.field)}: {str(e).removeprefix(e.field + ': ')}") from None
    if embedded and args.strategy:
        from planner.strategies import STRATEGIES
        if args.strategy not in STRATEGIES:
            raise BadFlag(f"--strategy: unknown strategy {args.strategy!r} (known: {', '.join(sorted(STRATEGIES))})")
    return req
