"""`kvplan.pipeline()`: the whole system in this process, for notebooks and scripts, in
kvpress's shape:

    pipe = kvplan.pipeline()
    r = pipe(context, question="Who signed it?", strategy="auto", ratio=0.2)
    print(r.text, r.reserve_ratio)

The first call starts the embedded default (planner, cachestore and executor servicers on
ephemeral loopback ports, `kvplan.embedded`) and keeps it until `close()` or the end of the
process; every call is a `kvplan.Client` job on it, so it measures what a cluster would. The
start loads the model (a first run in a fresh cache also converts it and builds the CPU
kernels: about a minute), so it says so on stderr while it runs (`kvplan.ticker`).
"""
from __future__ import annotations

import atexit
import dataclasses
import sys
import threading

from kvplan.sdk import Client, Result


class Pipeline:
    def __init__(self, model: str | None = None):
        """model: a local HF model folder (default: KVPLAN_MODEL, or SmolLM2-135M-Instruct)."""
        self.model = model
        self._embedded = None
        self._client: Client | None = None
        self._lock = threading.Lock()

    def __call__(self, context: str, question: str = "", *, strategy: str = "", ratio: float | None = None,
                 kv_tokens: int | None = None, max_new_tokens: int | None = None, temperature: float = 0.0,
                 seed: int | None = None) -> Result:
        """Answer `question` about `context`: the context's KV cache is planned (and compressed)
        first, the question is appended after it. Without a question the context is the prompt."""
        return self.client.generate(context, question=question, strategy=strategy, ratio=ratio, kv_tokens=kv_tokens,
                                    max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    @property
    def client(self) -> Client:
        with self._lock:
            if self._client is None:
                from kvcore.config import ModelConfig, from_env
                from kvplan.embedded import Embedded
                from kvplan.ticker import Ticker
                cfg = from_env(ModelConfig)
                if self.model:
                    cfg = dataclasses.replace(cfg, model=self.model)
                with Ticker("starting the embedded planner, cachestore and executor", follow_logs=True) as t:
                    self._embedded = Embedded(cfg).__enter__()
                print(f"kvplan: the embedded services are up ({t.elapsed_s:.0f}s)", file=sys.stderr)
                self._client = Client(self._embedded.executor_addr)
                atexit.register(self.close)
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._embedded.__exit__(None, None, None)
                self._client = self._embedded = None

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline(model: str | None = None) -> Pipeline:
    return Pipeline(model)
