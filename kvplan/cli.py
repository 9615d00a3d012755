"""The `kvplan` command line.

    kvplan up | down | status                 local cluster as background processes
    kvplan generate [PROMPT] [options]        run a job (on the cluster, or embedded)
    kvplan demo                               the built-in demo job
    kvplan strategies [set NAME]              list / switch the planner's default strategy
    kvplan strategies define FILE [--activate] register a strategy definition (JSON/YAML); --activate: switch to it
    kvplan plan --strategy S --ratio R        plan a job in this process and print the per-layer plan
    kvplan serve planner|executor|cachestore  run one service in the foreground
    kvplan prepare-model                      convert the model once into the cache dir

Exit codes: 0 ok, 1 the job or a service failed, 2 bad input.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import grpc

from kvplan.config import ClientConfig, ClusterConfig, ConfigError, ModelConfig, from_env

DEMO_CONTEXT = (
    "The Meridian Line is a night train that leaves Lisbon at 21:40 and reaches Madrid at 07:15. "
    "Its dining car serves grilled sardines, and the conductor, Ines Rocha, has worked on the line "
    "for nineteen years. The train has eleven sleeping cars and one observation car at the rear."
)
DEMO_QUESTION = "Who is the conductor of the Meridian Line, and how long has she worked on it?"


class UsageError(Exception):
    """Bad input: exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplan", description="LLM serving with planned KV-cache compression")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="start redis (if installed), planner, cachestore, executor in the background")
    sub.add_parser("down", help="stop every process `kvplan up` started")
    sub.add_parser("status", help="health of each process of the local cluster")
    sub.add_parser("prepare-model", help="convert the model to fp16 safetensors in KVPLAN_CACHE_DIR")
    s = sub.add_parser("serve", help="run one service in the foreground")
    s.add_argument("service", choices=["planner", "executor", "cachestore"])

    for name, helptext in (("generate", "run one job and stream its text"), ("demo", "run the built-in demo job")):
        g = sub.add_parser(name, help=helptext)
        if name == "generate":
            g.add_argument("prompt", nargs="?", default=None, help="the context / prompt text")
            g.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin)")
            g.add_argument("--question", default="", help="appended after the compressed prompt")
        g.add_argument("--strategy", default="", help="planner strategy (default: the planner's active one)")
        budget = g.add_mutually_exclusive_group()
        budget.add_argument("--ratio", type=float, default=None, help="KV reserve ratio in (0, 1]")
        budget.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens")
        g.add_argument("--max-new-tokens", type=int, default=None)
        g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
        g.add_argument("--top-p", type=float, default=None)
        g.add_argument("--seed", type=int, default=None)
        g.add_argument("--tenant", default="")
        g.add_argument("--json", action="store_true", help="print one JSON object with the result statistics")
        g.add_argument("--no-progress", action="store_true", help="no prefill progress bar")

    st = sub.add_parser("strategies", help="list the planner's strategies, `strategies set NAME`, "
                                           "or `strategies define FILE`")
    st.add_argument("action", nargs="?", choices=["set", "define"])
    st.add_argument("name", nargs="?", help="set: a strategy's name; define: a definition file (JSON or YAML)")
    st.add_argument("--activate", action="store_true",
                    help="define: also make it the default for jobs that name none (else: usable by name only)")

    pl = sub.add_parser("plan", help="plan one job in this process (no service) and print the per-layer plan")
    pl.add_argument("--strategy", required=True, help="a shipped strategy's name, or a definition file")
    budget = pl.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ratio", type=float, default=None, help="KV reserve ratio in (0, 1]")
    budget.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens")
    prompt = pl.add_mutually_exclusive_group()
    prompt.add_argument("--tokens", type=int, default=2048, help="prompt length without a prompt file (2048)")
    prompt.add_argument("--prompt-file", type=Path, help="tokenize this prompt (probing strategies probe it here)")
    pl.add_argument("--new-tokens", type=int, default=0,
                    help="tokens the job will generate: the budget holds their rows too (default 0: the prompt's cache)")
    pl.add_argument("--predict", action="store_true",
                    help="probe the prompt file (any strategy) for the plan's predicted retained attention "
                         "and its copy-aware form")
    pl.add_argument("--json", action="store_true", help="print the plan in the proto's JSON form")
    pl.add_argument("--plot", type=Path, metavar="FILE.png", help="draw kept tokens per layer (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (UsageError, ConfigError) as e:
        print(f"kvplan: error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"kvplan: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    except RuntimeError as e:
        print(f"kvplan: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args) -> int:
    if args.cmd == "serve":
        return _serve(args.service)
    from kvplan import cluster
    ccfg, mcfg = from_env(ClusterConfig), from_env(ModelConfig)
    if args.cmd == "up":
        cluster.up(ccfg, mcfg)
        return 0
    if args.cmd == "down":
        cluster.down(ccfg, mcfg)
        return 0
    if args.cmd == "status":
        rows = cluster.status(ccfg, mcfg)
        if not rows:
            print("kvplan: no cluster is up")
            return 1
        for name, pid, addr, health in rows:
            print(f"{name:<11} {health:<12} {addr:<28} pid {pid}")
        return 0 if all(h in ("SERVING", "UP") for *_, h in rows) else 1
    if args.cmd == "prepare-model":
        from kvplan import model
        print(model.prepare(mcfg))
        return 0
    if args.cmd == "strategies":
        return _strategies(args)
    if args.cmd == "plan":
        return _plan(args, mcfg)
    if args.cmd == "demo":
        args.prompt, args.prompt_file, args.question = DEMO_CONTEXT, None, DEMO_QUESTION
    return _generate(args, ccfg, mcfg)


def _serve(service: str) -> int:
    from kvplan.launch import run
    return run(service)


@contextlib.contextmanager
def _executor_address(ccfg: ClusterConfig, mcfg: ModelConfig, quiet: bool):
    """An explicit KVPLAN_EXECUTOR_ADDR, else a running `kvplan up` cluster, else embedded."""
    from kvplan import cluster
    if "KVPLAN_EXECUTOR_ADDR" in os.environ:
        yield from_env(ClientConfig).executor_addr
        return
    addr = cluster.running_executor(ccfg, mcfg)
    if addr:
        yield addr
        return
    from kvplan.embedded import Embedded
    if not quiet:
        print("kvplan: no cluster is up; running the embedded default (all services in this process)",
              file=sys.stderr)
    with Embedded(mcfg) as e:
        yield e.executor_addr


def _planner_address(ccfg: ClusterConfig, mcfg: ModelConfig) -> str | None:
    """KVPLAN_PLANNER_ADDR, else a running `kvplan up` cluster's planner, else None."""
    from kvplan import cluster
    if "KVPLAN_PLANNER_ADDR" in os.environ:
        return from_env(ClientConfig).planner_addr
    for m in cluster.read_members(cluster.state_dir(ccfg, mcfg)):
        if m.name == "planner":
            return m.address
    return None


def _strategies(args) -> int:
    from kvplan.client import PlannerClient
    definition = _definition_file(args.name) if args.action == "define" else None
    addr = _planner_address(from_env(ClusterConfig), from_env(ModelConfig))
    if addr is None:                     # no planner to ask: what this install ships
        if args.action:
            print("kvplan: no planner is up (no `kvplan up` cluster, no KVPLAN_PLANNER_ADDR): "
                  f"nothing to {'switch' if args.action == 'set' else 'define'}", file=sys.stderr)
            return 1
        from kvplan.config import PlannerConfig
        from planner.strategies import STRATEGIES
        default = from_env(PlannerConfig).default_strategy
        print("kvplan: no planner is up; the strategies this install ships (* = the default for jobs "
              "that name none)", file=sys.stderr)
        for s in STRATEGIES.values():
            print(f"{'*' if s.name == default else ' '} {s.name:<16} v{s.version:<4} {s.description}")
        return 0
    with PlannerClient(addr) as pc:
        if args.action == "set":
            if not args.name:
                raise UsageError("strategies set: give a strategy NAME")
            info = pc.set_strategy(args.name)
            print(f"active strategy: {info.name} (v{info.version})")
            return 0
        if args.action == "define":
            info = pc.define_strategy(definition, activate=args.activate)
            print(f"defined{' and active' if info.active else ''}: {info.name} (v{info.version})"
                  + ("" if info.active else f"; jobs use it with --strategy {info.name} "
                                            f"(or: kvplan strategies set {info.name})"))
            return 0
        got = pc.strategies()
    for s in got.strategies:
        print(f"{'*' if s.active else ' '} {s.name:<16} v{s.version:<4} {s.description}")
    return 0


def _definition_file(name: str | None) -> str:
    """The text of a definition file, checked here (the planner checks it again)."""
    from planner.request import InvalidRequest
    from planner.strategies import parse
    if not name:
        raise UsageError("strategies define: give a definition FILE (JSON or YAML)")
    try:
        text = Path(name).read_text()
    except OSError as e:
        raise UsageError(f"strategies define: {e.strerror}: {name}") from None
    try:
        parse(text)
    except InvalidRequest as e:
        raise UsageError(f"{name}: {e}") from None
    return text


def _plan(args, mcfg: ModelConfig) -> int:
    from kvplan import planview
    try:
        if args.plot:
            planview.need_matplotlib()
        text = None
        if args.prompt_file is not None:
            args.prompt = None
            text = _read_prompt(args)
        plan, prompt_tokens = planview.make(args.strategy, mcfg, args.ratio, args.kv_tokens, args.tokens, text,
                                             args.predict, args.new_tokens)
    except planview.BadInput as e:
        raise UsageError(str(e)) from None
    print(planview.as_json(plan) if args.json else planview.table(plan, prompt_tokens))
    if args.plot:
        planview.plot(plan, prompt_tokens, args.plot)
    return 0


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise UsageError("give PROMPT or --prompt-file, not both")
        try:
            return sys.stdin.read() if str(args.prompt_file) == "-" else args.prompt_file.read_text()
        except OSError as e:
            raise UsageError(f"--prompt-file: {e.strerror}: {args.prompt_file}") from None
    if args.prompt is None:
        raise UsageError("give a PROMPT or --prompt-file")
    return args.prompt


def _generate(args, ccfg: ClusterConfig, mcfg: ModelConfig) -> int:
    from kvplan.client import ExecutorClient, request, result_dict
    from kvplan.progress import EventPrinter

    req = request(_read_prompt(args), question=args.question, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, seed=args.seed, strategy=args.strategy,
                  reserve_ratio=args.ratio, kv_tokens=args.kv_tokens, tenant=args.tenant)
    with _executor_address(ccfg, mcfg, quiet=args.json) as addr, \
            ExecutorClient(addr, from_env(ClientConfig).timeout_s) as client:
        printer = EventPrinter(stream_text=not args.json, progress=not args.no_progress)
        st = client.run(req, printer)
        printer.close()
    if st.result is None:
        state = st.status.state if st.status else 0
        from protos import executor_pb2
        name = executor_pb2.JobState.Name(state)
        print(f"kvplan: job {st.job_id} ended {name}: {st.status.error if st.status else ''}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"job_id": st.job_id, **result_dict(st.result)}))
    else:
        r = st.result
        print(f"\n[{r.strategy} plan {r.plan_id}: {r.prompt_tokens} prompt + {r.generated_tokens} generated tokens; "
              f"KV {r.kv_bytes / 2**20:.2f} MiB of {r.full_kv_bytes / 2**20:.2f} MiB "
              f"(reserve ratio {r.reserve_ratio:.3f}); prefill {r.prefill_s:.2f}s, "
              f"decode {r.decode_tokens_per_s:.1f} tok/s{'; DEGRADED' if r.degraded else ''}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
