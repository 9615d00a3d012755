"""The `kvplan` command line.

    kvplan up | down | status                 local cluster as background processes (up: also starts
                                              again what of a running one is dead)
    kvplan restart SERVICE                    stop one member of the local cluster and start it again
    kvplan generate [PROMPT] [options]        run a job (on the cluster, or embedded)
    kvplan demo                               one question under full and under auto at 0.2, bytes side by side
    kvplan strategies [set NAME]              list / switch the planner's default strategy
    kvplan strategies define FILE [--activate] register a strategy definition (JSON/YAML); --activate: switch to it
    kvplan plan --strategy S --ratio R        plan a job in this process and print the per-layer plan
    kvplan serve planner|executor|cachestore|http   run one service in the foreground
    kvplan prepare-model                      convert the model once into the cache dir (and build the CPU kernels)
    kvplan keys add --tenant T --role R       make an API key (printed once; its hash joins the keys file)

Exit codes: 0 ok, 1 the job or a service failed, 2 bad input (checked before any service
starts), 3 `generate --strict` and the job ran degraded or did not hold its budget.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc

from kvplan import __version__
from kvplan import keyscmd
from kvcore import keyfile
from kvcore.config import ClientConfig, ClusterConfig, ConfigError, ModelConfig, from_env


class UsageError(Exception):
    """Bad input: exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplan", description="LLM serving with planned KV-cache compression")
    p.add_argument("--version", action="version", version=f"kvplan {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="start redis (if installed), planner, cachestore, executor and the HTTP API "
                              "in the background")
    sub.add_parser("down", help="stop every process `kvplan up` started")
    sub.add_parser("status", help="health of each process of the local cluster (exit 1 unless all serve)")
    r = sub.add_parser("restart", help="stop one member of the local cluster and start it again")
    r.add_argument("service", choices=["redis", "planner", "cachestore", "executor", "http"])
    sub.add_parser("prepare-model", help="convert the model to fp16 safetensors in KVPLAN_CACHE_DIR")
    s = sub.add_parser("serve", help="run one service in the foreground")
    s.add_argument("service", choices=["planner", "executor", "cachestore", "http"])
    sub.add_parser("demo", help="one question answered under full and under auto at 0.2, KV bytes side by side")

    g = sub.add_parser("generate", help="run one job and stream its text")
    g.add_argument("prompt", nargs="?", default=None, help="the context / prompt text")
    g.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin)")
    g.add_argument("--question", default="", help="appended after the compressed prompt")
    g.add_argument("--strategy", default="",
                   help="planner strategy (default: the planner's active one; with a budget and a `full` default: auto)")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--ratio", type=float, default=None, help="KV reserve ratio in (0, 1]")
    budget.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens")
    budget.add_argument("--budget", choices=["adaptive"], default=None,
                        help="adaptive: the largest reserve ratio the executor's free KV memory leaves room for "
                             "(1.0 when idle), not below --floor")
    g.add_argument("--floor", type=float, default=None,
                   help="with --budget adaptive (only): the lowest reserve ratio (default 0: none)")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text before the first TEXT generated (repeatable)")
    g.add_argument("--tenant", default="")
    g.add_argument("--json", action="store_true", help="print one JSON object with the result statistics")
    g.add_argument("--no-progress", action="store_true", help="no prefill progress bar")
    g.add_argument("--strict", action="store_true",
                   help="exit 3 when the job ran degraded or did not hold its budget (warned on stderr always)")

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
    pl.add_argument("--question", default="", help="with --prompt-file: appended after the compressed prompt, "
                                                  "as generate's (its rows come out of the budget too)")
    pl.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=int, default=None,
                    help="tokens the job will generate: the budget holds their rows too (default: generate's, "
                         "KVPLAN_DEFAULT_MAX_NEW_TOKENS, 128)")
    pl.add_argument("--predict", action="store_true",
                    help="probe the prompt file (any strategy) for the plan's predicted retained attention "
                         "and its copy-aware form")
    pl.add_argument("--json", action="store_true", help="print the plan in the proto's JSON form")
    pl.add_argument("--plot", type=Path, metavar="FILE.png", help="draw kept tokens per layer (needs matplotlib)")
    b = sub.add_parser("bench", help="run a benchmark from a checkout: `kvplan bench serve [flags]` "
                                     "(python -m bench.serve --help)", add_help=False)
    b.add_argument("bench", choices=["serve"], help="which benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="its flags")
    keyscmd.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code = _dispatch(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:              # `kvplan strategies | head`: the reader left; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141                       # as a process killed by SIGPIPE
    except (UsageError, ConfigError) as e:
        print(f"kvplan: error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        hint = ""
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = ("\nkvplan: hint: no kvplan service answered at the configured address: `kvplan up` starts a "
                    "local cluster (`kvplan status` shows it); without KVPLAN_*_ADDR and without a cluster, "
                    "`generate` runs the embedded default")
        print(f"kvplan: error: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    except RuntimeError as e:
        print(f"kvplan: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args) -> int:
    if args.cmd == "serve":
        return _serve(args.service)
    if args.cmd == "bench":
        try:
            from bench import serve
        except ImportError:
            raise UsageError("the benchmarks live in the repository's bench/ folder: run kvplan from a checkout") from None
        serve.main(args.rest)
        return 0
    from kvplan import cluster
    ccfg, mcfg = from_env(ClusterConfig), from_env(ModelConfig)
    keyfile.use_cluster_key(cluster.state_dir(ccfg, mcfg))     # no KVPLAN_API_KEY: the `kvplan up` admin key
    if args.cmd == "keys":
        return keyscmd.run(args, cluster.state_dir(ccfg, mcfg), UsageError)
    if args.cmd == "up":
        cluster.up(ccfg, mcfg)
        return 0
    if args.cmd == "down":
        cluster.down(ccfg, mcfg)
        return 0
    if args.cmd == "restart":
        cluster.restart(ccfg, mcfg, args.service)
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
        from kernels import cpu_extension
        from kvcore import model
        print(model.prepare(mcfg))
        print(f"CPU decode kernels: {'built' if cpu_extension.build() else 'not built (the torch references serve)'}")
        return 0
    if args.cmd == "strategies":
        return _strategies(args)
    if args.cmd == "plan":
        return _plan(args, mcfg)
    if args.cmd == "demo":
        from kvplan import demo
        from kvplan.jobrun import executor_address
        with executor_address(ccfg, mcfg, quiet=False) as addr:
            return demo.run(addr, from_env(ClientConfig).timeout_s)
    from kvplan import jobrun
    text = _read_prompt(args)
    try:
        return jobrun.generate(args, text, ccfg, mcfg)
    except jobrun.BadFlag as e:
        raise UsageError(str(e)) from None


def _serve(service: str) -> int:
    if service == "http":
        from kvplan.gateway import run as run_http
        return run_http()
    import importlib
    return importlib.import_module(f"{service}.__main__").main()     # as `python -m SERVICE`


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
        from kvcore.config import PlannerConfig
        from planner.strategies import STRATEGIES
        default = from_env(PlannerConfig).default_strategy
        print("kvplan: no planner is up; the strategies this install ships (* = the default for jobs "
              "that name none)", file=sys.stderr)
        cannot = _cannot_compress_here(STRATEGIES.values())
        for s in STRATEGIES.values():
            print(_strategy_row(s.name == default, s.name, s.version, s.description, cannot.get(s.name, "")))
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
        got = pc.strategies(check_model=True)
    for s in got.strategies:
        print(_strategy_row(s.active, s.name, s.version, s.description, s.cannot_compress))
    return 0


def _strategy_row(active: bool, name: str, version: str, description: str, cannot_compress: str) -> str:
    return (f"{'*' if active else ' '} {name:<16} v{version:<4} {description}"
            + (f"  [cannot compress this model: {cannot_compress}]" if cannot_compress else ""))


def _cannot_compress_here(strategies) -> dict[str, str]:
    """Without a planner: name -> why it compresses nothing on the model, as a planner says it
    (`planner.precheck`), when the model is here already (never converted for a listing)."""
    from kvcore import model
    from kvplan.ticker import Ticker
    from planner import precheck
    from planner.probe import Prober
    mcfg = from_env(ModelConfig)
    if not model.is_prepared(mcfg):
        return {}
    with Ticker("loading the model to see which strategies compress it", lines=False):
        shape, probe = precheck.reference(Prober(mcfg))
        return {s.name: precheck.cannot_compress(s, shape, probe) for s in strategies}


def _definition_file(name: str | None) -> str:
    """The text of a definition file, checked here (the planner checks it again)."""
    from kvcore.request import InvalidRequest
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
    from kvplan.ticker import Ticker
    with Ticker("planning", lines=False) as ticker:          # a status line on a terminal: loading, probing
        try:
            if args.plot:
                ticker.say("loading matplotlib")
                planview.need_matplotlib()
            text = None
            if args.prompt_file is not None:
                args.prompt = None
                text = _read_prompt(args)
            if args.new_tokens is None:           # what `generate` asks when not told (the executor's default)
                from kvcore.config import ExecutorConfig
                args.new_tokens = from_env(ExecutorConfig).default_max_new_tokens
            plan, prompt_tokens, refused = planview.make(args.strategy, mcfg, args.ratio, args.kv_tokens, args.tokens,
                                                          text, args.predict, args.new_tokens, say=ticker.say,
                                                          question=args.question)
        except planview.BadInput as e:
            raise UsageError(str(e)) from None
        ticker.echo(planview.as_json(plan) if args.json else planview.table(plan, prompt_tokens))
        if refused:                          # the plan is shown; a job asking this budget would be refused
            ticker.echo(f"kvplan: warning: a job asking this would be refused: {refused}", sys.stderr)
        if args.plot:
            ticker.say(f"drawing {args.plot}")
            asked = f"ratio {args.ratio:g}" if args.ratio is not None else f"{args.kv_tokens} KV tokens"
            planview.plot(plan, prompt_tokens, args.plot,
                          asked + (f", {args.new_tokens} new tokens" if args.new_tokens else ""))
    if args.plot:
        print(f"kvplan: wrote {args.plot} ({ticker.elapsed_s:.0f}s)", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
