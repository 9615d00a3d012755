"""Container health check: `python -m kvplan.healthcheck HOST:PORT [--service NAME | --http]`.

Asks `grpc.health.v1` at HOST:PORT once (with --http: the HTTP API's GET /health, which is 200
when its executor is SERVING); exits 0 if it answers SERVING, 1 otherwise: NOT_SERVING while a
service warms up, DOWN when nothing answers, or a bad argument (never 2, which Docker reserves).
Used by the healthchecks in docker-compose.yml.
"""
from __future__ import annotations

import argparse
import sys

from kvcore.serving import check_health


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # Docker reserves health-check exit code 2 (argparse's usage error): anything wrong is 1.
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m kvplan.healthcheck", description="Exit 0 if the gRPC service at HOST:PORT reports SERVING, else 1.")
    p.add_argument("address", help="HOST:PORT of a kvplan gRPC service")
    p.add_argument("--service", default="", help="health service name, e.g. kvplan.v1.Executor; default: the server as a whole")
    p.add_argument("--timeout", type=float, default=2.0, help="deadline of the Check call in seconds (default 2)")
    p.add_argument("--http", action="store_true", help="HOST:PORT is the HTTP API: GET /health")
    args = p.parse_args(argv)
    host, sep, port = args.address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        p.error(f"address must be HOST:PORT, got {args.address!r}")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.http:
        status = http_health(args.address, args.timeout)
    else:
        status = check_health(args.address, timeout_s=args.timeout, service=args.service)
    what = f"{args.address}" + (f" ({args.service})" if args.service else "")
    if status == "SERVING":
        print(f"{what}: SERVING")
        return 0
    if status == "DOWN":
        print(f"{what}: DOWN (no health answer within {args.timeout:g}s: nothing listening, or an unknown --service)",
              file=sys.stderr)
    else:
        print(f"{what}: {status}", file=sys.stderr)
    return 1


def http_health(address: str, timeout_s: float = 2.0) -> str:
    """The HTTP API's health: "SERVING" (200), "NOT_SERVING" (another status: its executor is not
    SERVING), or "DOWN" (no answer)."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout_s) as r:
            return "SERVING" if r.status == 200 else "NOT_SERVING"
    except urllib.error.HTTPError:
        return "NOT_SERVING"
    except OSError:
        return "DOWN"


if __name__ == "__main__":
    sys.exit(main())
