"""Cachestore transfers against a plain memcpy of the same bytes, in one run:

- memcpy: `dst.copy_(src)` of the K and V bytes in this process (the yardstick);
- shm: the executor's read of a job's rows from the shared-memory segment by offset into its own
  buffer (what the `shm` transport does; the rows were written there the same way);
- gRPC: the same rows through `GetStream`'s chunks over loopback into the same buffers (the
  `grpc` transport);
- prefetch: one decode step's gathers (30 layers × 3 KV heads × 32 rows × 64 dims, SmolLM2's
  shape), one-sided from the mapping and, for comparison, by the cachestore (`PrefetchLayer`).

    python -m bench.transfer [--mib 64] [--repeats 5]

A real `python -m cachestore` process on free ports; medians of the repeats. Writes
bench/results/transfer.json (top-level `shm_over_memcpy`, `grpc_bytes_per_s`, ...) and prints a
markdown table. Targets: shm >= 0.5x memcpy; gRPC >= 1 GB/s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from cachestore.process import spawn

RESULTS = Path(__file__).parent / "results"
HEAD_DIM, LAYERS, KV_HEADS, TOP_K = 64, 30, 3, 32


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per measurement (K and V together)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    nbytes = args.mib << 20
    rows = nbytes // (2 * HEAD_DIM * 2)                                     # fp16 K + V rows of one head
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, rows, HEAD_DIM, generator=g).half()                  # [H=1, N, D]
    v = torch.randn(1, rows, HEAD_DIM, generator=g).half()

    dk, dv = torch.empty_like(k), torch.empty_like(v)
    memcpy_s = timed(lambda: (dk.copy_(k), dv.copy_(v)), args.repeats)

    with spawn(capacity_bytes=8 << 30, timeout_s=120) as (_, client):
        client.transport = "auto"
        shm = client.open("bench", "transfer-shm", 1, 1, HEAD_DIM, torch.float16, rows, 1)
        shm.put(0, k, v)
        got = shm.read(0)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
        shm_s = timed(lambda: (dk.copy_(shm.seg.k[0]), dv.copy_(shm.seg.v[0])), args.repeats)   # read by offset

        client.transport = "grpc"
        remote = client.open("bench", "transfer-grpc", 1, 1, HEAD_DIM, torch.float16, rows, 1)
        for a in range(0, rows, 1 << 16):                                   # Put in 8 MiB pieces (message limit)
            remote.put(0, k[:, a:a + (1 << 16)], v[:, a:a + (1 << 16)])
        got = remote.read(0)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
        grpc_s = timed(lambda: remote.read_into(0, 0, dk[0], dv[0]), args.repeats)          # into the same buffers
        assert torch.equal(dk, k) and torch.equal(dv, v)
        remote.release()
        shm.release()

        client.transport = "auto"
        step = client.open("bench", "transfer-step", LAYERS, KV_HEADS, HEAD_DIM, torch.float16, 4096, TOP_K)
        ctx_k = torch.randn(KV_HEADS, 4096, HEAD_DIM, generator=g).half()
        for layer in range(LAYERS):
            step.put(layer, ctx_k, ctx_k)
        idx = torch.randint(0, 4096, (KV_HEADS, TOP_K), generator=g)

        def one_step():
            for layer in range(LAYERS):
                step._gather(layer, idx)
        step_s = timed(one_step, args.repeats)            # one-sided: gathered from the mapping by offset
        step.one_sided = False
        rpc_step_s = timed(one_step, args.repeats)        # the cachestore gathers into the staging slot
        step.release()

    out = dict(bench="transfer", machine=platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
               bytes=2 * k.nbytes, repeats=args.repeats,
               memcpy_bytes_per_s=2 * k.nbytes / memcpy_s, shm_bytes_per_s=2 * k.nbytes / shm_s,
               grpc_bytes_per_s=2 * k.nbytes / grpc_s, shm_over_memcpy=memcpy_s / shm_s, grpc_over_memcpy=memcpy_s / grpc_s,
               prefetch=dict(layers=LAYERS, kv_heads=KV_HEADS, top_k=TOP_K, head_dim=HEAD_DIM, step_s=step_s,
                             us_per_layer=1e6 * step_s / LAYERS, by_cachestore_step_s=rpc_step_s,
                             by_cachestore_us_per_layer=1e6 * rpc_step_s / LAYERS))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transfer.json").write_text(json.dumps(out, indent=1))
    gb = lambda x: f"{x / 1e9:.2f} GB/s"
    print(f"| path | bytes | throughput | vs memcpy |\n|---|---:|---:|---:|\n"
          f"| memcpy (in process) | {2 * k.nbytes >> 20} MiB | {gb(out['memcpy_bytes_per_s'])} | 1.00× |\n"
          f"| shared memory (read by offset) | {2 * k.nbytes >> 20} MiB | {gb(out['shm_bytes_per_s'])} | "
          f"{out['shm_over_memcpy']:.2f}× |\n"
          f"| gRPC stream (loopback) | {2 * k.nbytes >> 20} MiB | {gb(out['grpc_bytes_per_s'])} | "
          f"{out['grpc_over_memcpy']:.2f}× |\n\n"
          f"prefetch, one decode step ({LAYERS} layers × {KV_HEADS} KV heads × {TOP_K} rows): one-sided "
          f"{1e3 * step_s:.1f} ms ({out['prefetch']['us_per_layer']:.0f} µs a layer); gathered by the cachestore "
          f"(a PrefetchLayer call a layer) {1e3 * rpc_step_s:.1f} ms ({1e6 * rpc_step_s / LAYERS:.0f} µs a layer)\n"
          f"targets: shm >= 0.5× memcpy, gRPC >= 1 GB/s; {args.out / 'transfer.json'}")


if __name__ == "__main__":
    main()
