"""Runs a peer's script (`../shared/peers/llamacpp/run_peer.py`) with the module names it was written
against — the kvplan package's model and config modules (since moved to `kvcore.model` and
`kvcore.config`) and bench.serve's pct (now `bench.summary.pct`) — so the shared script runs
unchanged on this checkout.

    python -m bench.peer_shim SCRIPT [ARGS...]        (what `bench.peers run llamacpp` runs)"""
from __future__ import annotations

import runpy
import sys

import kvplan
from bench import serve, summary
from kvcore import config, model


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m bench.peer_shim SCRIPT [ARGS...]")
    for name, module in (("model", model), ("config", config)):
        sys.modules[f"kvplan.{name}"] = module
        setattr(kvplan, name, module)
    serve.pct = summary.pct
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
