"""One OpenMP team a process: torch's intra-op threads for the one thread that computes (the
executor's engine thread), one thread for every other.

libgomp gives each thread that starts a parallel region a team of its own, kept until the thread
exits. Once a process holds more team threads than CPUs, libgomp's workers stop spinning between
regions (its "throttled" spin count: 100) and sleep on a futex instead, so each of a decode step's
~300 parallel regions (a layer's products, kernels, norms) waits for the kernel to wake a worker.
A team left in a loader or helper thread made a 2k-context decode step 28 -> 36 ms on a 2-core
AMD EPYC with AVX512-BF16 (avx512f avx512_bf16, no AMX) (docs/benchmarks.md, "Figures behind the code").

    solo(threads)   at a service's start, before its first torch op: every thread of the process
                    runs torch's ops on one thread (torch's own default for new threads too) ->
                    the count the computing thread will take (`threads`, else torch's default)
    own()           first thing in the thread that computes: that count (torch's setting, which
                    threads starting later would copy)
    one()           a helper thread started after `own` (a pool's initializer): one thread for it
                    alone (OpenMP's count is per thread: threadpoolctl sets it in the runtime
                    torch loaded)

A process that never calls `solo` (the tests, the benches, `kvplan run`) keeps torch's default, and
`own` changes nothing in it."""
from __future__ import annotations

import torch
from threadpoolctl import threadpool_limits

_compute: int | None = None       # what `solo` kept for the computing thread


def solo(threads: int = 0) -> int:
    """Every thread at one intra-op thread from now on -> the count `own` gives the computing thread."""
    global _compute
    _compute = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return _compute


def own() -> int:
    """The calling thread computes: torch's ops in it on the process's compute threads -> that count.
    (torch's count is also a process-wide setting some of its ops read, so it is set, not only this
    thread's OpenMP count; threads that start torch after this take `one()`.)"""
    n = _compute or torch.get_num_threads()
    torch.set_num_threads(n)
    return torch.get_num_threads()


def one() -> None:
    """The calling thread runs torch's ops on one thread (no OpenMP team of its own): for the helper
    threads of a process whose computing thread took `own()` (a thread pool's initializer)."""
    torch.get_num_threads()             # torch's per-thread setup first: it would reset the count set next
    threadpool_limits(1, user_api="openmp")
