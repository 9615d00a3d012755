"""The Triton kernels of the GPU step against their torch references on CUDA, at SmolLM2-135M's shapes
(hidden 576, MLP 1,536, 9 query heads, 3 KV heads, head dim 64; bf16 rows, fp16 KV pages):

- the decoder's fused ops (`kernels.decoder_ops_triton`): RMSNorm, RMSNorm with the residual add,
  RoPE on q and on k, SiLU·up, at a decode step's rows (one per sequence) and a prefill's
  (sequences × tokens);
- varlen paged prefill (`kernels.paged_prefill`): the sequences' whole prompts in one call, and a
  chunk of each continuing its stored context; beside the reference, SDPA (flash) over the same
  rows already gathered contiguous (the yardstick a paged kernel cannot beat, gather not counted);
  the whole prompts again at other tilings (`--tiles`), so one run on a lent GPU also tunes it;
- `kvcore.statistics.LayerStatistics.add` (what `auto` plans from) for one layer of one prompt on
  CUDA against the same on the CPU.

Per row: the max relative error against the reference (max |out - ref| / max |ref|, the reference
in fp32), the eager time of each, the time replayed from a CUDA graph (what a captured step pays:
no launch overhead), and the kernel's achieved GB/s or TFLOP/s.

    python -m bench.gpu_kernels [--seqs 16] [--tokens 3500] [--limit-s 55] [--tiles BM BN WARPS STAGES ...]
    python -m bench.gpu_kernels --interpret      # the CPU check: tiny shapes under TRITON_INTERPRET=1

A watchdog ends the process after --limit-s seconds whatever it is doing (traceback on stderr);
rows are written as they come, so a cut run still leaves them. Writes gpu_kernels.json under
bench/results/ (in its folder gpu_kernels, --interpret: quick; --out: elsewhere) and prints a
markdown table."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, PAGE_ROWS = 576, 1536, 9, 3, 64, 16
TILES = [(128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 3)]     # prefill tilings timed beside the launcher's (64, 64, 4, 2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def eager_s(fn, budget_s: float) -> float:
    """Median seconds of one call over ~budget_s (after a warm-up call), synchronised."""
    fn()
    sync()
    times = []
    end = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < end and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_s(fn, calls: int) -> float | None:
    """Seconds of one call replayed from a CUDA graph holding `calls` calls (None: not CUDA, or
    the call cannot be captured)."""
    if not torch.cuda.is_available():
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()                                                   # warm (compiled, allocator primed) off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        sync()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        stop.record()
        sync()
        return start.elapsed_time(stop) / 1e3 / (3 * calls)
    except Exception as e:                                         # noqa: BLE001  (reported, not fatal)
        print(f"  (graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decoder_cases(n: int, dev, dtype, graph_calls: int) -> list[dict]:
    """The four ops at n rows: dicts of name, shape, kernel and reference thunks, bytes moved, the calls
    a CUDA graph of each holds."""
    from kernels import decoder_ops as ops
    from kernels import decoder_ops_triton as dt
    g = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(n, HIDDEN, generator=g, device=dev).to(dtype)
    delta = torch.randn(n, HIDDEN, generator=g, device=dev).to(dtype)
    w = (torch.rand(HIDDEN, generator=g, device=dev) + 0.5).to(dtype)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g, device=dev).to(dtype)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g, device=dev).to(dtype)
    pos = torch.randint(0, 4096, (n,), generator=g, device=dev).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    gate = torch.randn(n, MLP, generator=g, device=dev).to(dtype) * 3
    up = torch.randn(n, MLP, generator=g, device=dev).to(dtype)
    item = x.element_size()
    res_k, res_r = x.clone(), x.clone()
    calls = graph_calls if n <= 4096 else 2                         # a graph's outputs stay allocated: few big ones

    def rope_ref(t):
        t.copy_(ops.rope_reference(t, cos, sin))
    return [
        dict(op="rms_norm", shape=f"{n}×{HIDDEN}", kernel=lambda: dt.rms_norm(x, w, 1e-5),
             ref=lambda: ops.rms_norm_reference(x, w, 1e-5),
             exact=lambda: ops.rms_norm_reference(x.float(), w.float(), 1e-5),
             bytes=2 * n * HIDDEN * item, graph_calls=calls),
        dict(op="add_rms_norm", shape=f"{n}×{HIDDEN}", kernel=lambda: dt.add_rms_norm(res_k, delta, w, 1e-5),
             ref=lambda: ops.rms_norm_reference(res_r.add_(delta), w, 1e-5),
             first=lambda: (dt.add_rms_norm(x.clone(), delta, w, 1e-5),
                            ops.rms_norm_reference((x.float() + delta.float()).to(dtype).float(), w.float(), 1e-5)),
             bytes=4 * n * HIDDEN * item, graph_calls=calls),
        dict(op="rope_ q", shape=f"{n}×{HEADS}×{HEAD_DIM}", kernel=lambda: dt.rope_(q, cos, sin), ref=lambda: rope_ref(q),
             first=lambda: (dt.rope_(q.clone(), cos, sin), ops.rope_reference(q.float(), cos.float(), sin.float())),
             bytes=2 * q.numel() * item, graph_calls=calls),
        dict(op="rope_ k", shape=f"{n}×{KV_HEADS}×{HEAD_DIM}", kernel=lambda: dt.rope_(k, cos, sin), ref=lambda: rope_ref(k),
             first=lambda: (dt.rope_(k.clone(), cos, sin), ops.rope_reference(k.float(), cos.float(), sin.float())),
             bytes=2 * k.numel() * item, graph_calls=calls),
        dict(op="silu_mul", shape=f"{n}×{MLP}", kernel=lambda: dt.silu_mul(gate, up),
             ref=lambda: torch.nn.functional.silu(gate) * up,
             exact=lambda: torch.nn.functional.silu(gate.float()) * up.float(), bytes=3 * n * MLP * item,
             graph_calls=calls),
    ]


def prefill_cases(seqs: int, tokens: int, chunk: int, dev, dtype, tiles: list[tuple]) -> list[dict]:
    """Whole prompts (seqs × tokens new rows) and one chunk each over a stored context, bf16 queries;
    the whole prompts again at each of `tiles` (block_m, block_n, warps, stages) beside the launcher's."""
    from kernels import paged_prefill as pp
    g = torch.Generator(device=dev).manual_seed(1)
    mb = -(-tokens // PAGE_ROWS)
    pages = seqs * KV_HEADS * mb
    arena = torch.randn(pages * 2 * PAGE_ROWS * HEAD_DIM, generator=g, device=dev).half().view(torch.uint8)
    table = torch.randperm(pages, generator=g, device=dev).view(seqs, KV_HEADS, mb).int()
    kv_len = torch.full((seqs,), tokens, dtype=torch.int32, device=dev)
    rows = arena.view(torch.float16).view(-1, HEAD_DIM)
    at = torch.arange(tokens, device=dev)
    first = table[:, :, at // PAGE_ROWS].long() * (2 * PAGE_ROWS) + at % PAGE_ROWS      # [S, H_kv, L]
    k_flat, v_flat = rows[first].to(dtype), rows[first + PAGE_ROWS].to(dtype)             # contiguous copies (SDPA's)
    out = []
    for name, n in (("paged_prefill", tokens), ("paged_prefill chunk", chunk)):
        starts = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * n
        q = torch.randn(seqs * n, HEADS, HEAD_DIM, generator=g, device=dev).to(dtype)
        args = (q, arena, table, kv_len, starts, PAGE_ROWS, HEAD_DIM ** -0.5)
        qs = q.view(seqs, n, HEADS, HEAD_DIM).transpose(1, 2)                             # [S, H, n, D]
        mask = None if n == tokens else (at[None, :] <= (tokens - n + torch.arange(n, device=dev))[:, None])

        def sdpa(qs=qs, mask=mask, n=n):
            return torch.nn.functional.scaled_dot_product_attention(qs, k_flat, v_flat, attn_mask=mask,
                                                                    is_causal=mask is None, enable_gqa=True)
        pairs = seqs * (n * (tokens - n) + n * (n + 1) // 2)                               # causal (query, key) pairs
        exact = lambda args=args: pp.paged_prefill_reference(args[0].float(), *args[1:])     # noqa: E731
        out.append(dict(op=name, shape=f"{seqs}×{n} over {tokens}", kernel=lambda args=args: pp.paged_prefill_triton(*args),
                        ref=lambda args=args: pp.paged_prefill_reference(*args), exact=exact,
                        peer=sdpa, flops=4 * pairs * HEADS * HEAD_DIM))
        for bm, bn, warps, stages in tiles if n == tokens else ():
            out.append(dict(op=f"paged_prefill {bm}×{bn} w{warps} s{stages}", shape=f"{seqs}×{n} over {tokens}",
                            kernel=lambda args=args, t=(bm, bn, warps, stages): pp.paged_prefill_triton(*args, *t),
                            exact=exact, flops=4 * pairs * HEADS * HEAD_DIM))
    return out


def statistics_case(tokens: int, dev) -> dict:
    """One layer's `LayerStatistics.add` with auto's losses: on `dev` against the CPU."""
    from kvcore.statistics import LayerStatistics
    g = torch.Generator().manual_seed(2)
    layer = (torch.randn(HEADS, 64, HEAD_DIM, generator=g), torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=g),
             torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=g), torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=g))
    on_dev = [t.to(dev) for t in layer]

    def add(ts):
        st = LayerStatistics("mean", True, shares=False)
        st.add(*ts, HEAD_DIM ** -0.5)
        return st
    return dict(op="LayerStatistics.add", shape=f"1 layer, {tokens} tokens", kernel=lambda: add(on_dev),
                ref=lambda: add(layer), first=lambda: (torch.tensor(add(on_dev).result().losses.evict),
                                                       torch.tensor(add(layer).result().losses.evict)))


def measure(case: dict, budget_s: float) -> dict:
    if "first" in case:
        got, want = case["first"]()
    else:
        got, want = case["kernel"](), case["exact"]()
    row = dict(op=case["op"], shape=case["shape"], max_rel_err=rel_err(got, want))
    row["kernel_s"] = eager_s(case["kernel"], budget_s)
    if case.get("ref"):                                            # (a tile sweep's rows: the kernel alone)
        row["ref_s"] = eager_s(case["ref"], budget_s)
        row["ref_over_kernel"] = row["ref_s"] / row["kernel_s"]
    if "peer" in case:
        row["sdpa_s"] = eager_s(case["peer"], budget_s)
    if case.get("graph_calls"):                                    # the decoder ops: what a captured step pays
        row["kernel_graph_s"] = graph_s(case["kernel"], case["graph_calls"])
        row["ref_graph_s"] = graph_s(case["ref"], case["graph_calls"])
    t = row.get("kernel_graph_s") or row["kernel_s"]
    if "bytes" in case:
        row["kernel_GBps"] = case["bytes"] / t / 1e9
    if "flops" in case:
        row["kernel_TFLOPs"] = case["flops"] / row["kernel_s"] / 1e12
    if row.get("ref_graph_s") and row.get("kernel_graph_s"):
        row["ref_over_kernel_graph"] = row["ref_graph_s"] / row["kernel_graph_s"]
    return row


def table(rows: list[dict]) -> str:
    def us(x):
        return "—" if x is None else f"{x * 1e6:,.1f}"

    def times(x):
        return "—" if x is None else f"{x:.1f}×"
    lines = ["| op | shape | max rel err | kernel µs | ref µs | ref / kernel | graph: kernel µs | graph: ref µs "
             "| graph: ref / kernel | kernel GB/s or TFLOP/s | SDPA µs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rate = f"{r['kernel_GBps']:,.0f} GB/s" if "kernel_GBps" in r else \
            f"{r['kernel_TFLOPs']:,.1f} TFLOP/s" if "kernel_TFLOPs" in r else "—"
        lines.append(f"| {r['op']} | {r['shape']} | {r['max_rel_err']:.1e} | {us(r['kernel_s'])} | {us(r.get('ref_s'))} "
                     f"| {times(r.get('ref_over_kernel'))} | {us(r.get('kernel_graph_s'))} | {us(r.get('ref_graph_s'))} "
                     f"| {times(r.get('ref_over_kernel_graph'))} | {rate} | {us(r.get('sdpa_s'))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=16, help="sequences: a decode step's rows, the prefill's segments")
    ap.add_argument("--tokens", type=int, default=3500, help="prompt tokens of each sequence")
    ap.add_argument("--chunk", type=int, default=512, help="new rows of each sequence in the chunk case")
    ap.add_argument("--limit-s", type=float, default=55.0, help="the watchdog: the process ends after this")
    ap.add_argument("--budget-s", type=float, default=0.25, help="seconds of eager repeats per measurement")
    ap.add_argument("--graph-calls", type=int, default=20, help="calls one CUDA graph holds")
    ap.add_argument("--tiles", type=int, nargs=4, action="append", metavar=("BM", "BN", "WARPS", "STAGES"),
                    help="a paged prefill tiling to time beside the launcher's (repeatable; default: three)")
    ap.add_argument("--interpret", action="store_true", help="CPU check: TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"                           # before any kernels import
        args.seqs, args.tokens, args.chunk, args.budget_s = 2, 40, 16, 0.0
        args.tiles = args.tiles or [(16, 16, 1, 1)]
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench.gpu_kernels: no CUDA device here (--interpret checks the bench on the CPU)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
    faulthandler.dump_traceback_later(args.limit_s, exit=True, file=sys.__stderr__)   # never hangs the device script
    try:
        return run(args, dev)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run(args, dev: torch.device) -> int:
    out_dir = args.out or RESULTS / ("quick" if args.interpret else "gpu_kernels")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_kernels.json"
    meta = dict(bench="gpu_kernels", device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, machine=platform.machine(), seqs=args.seqs, tokens=args.tokens,
                chunk=args.chunk, dtype="bfloat16")
    t0 = time.perf_counter()
    cases = decoder_cases(args.seqs, dev, torch.bfloat16, args.graph_calls) \
        + decoder_cases(args.seqs * args.tokens, dev, torch.bfloat16, args.graph_calls) \
        + prefill_cases(args.seqs, args.tokens, args.chunk, dev, torch.bfloat16, args.tiles or TILES) \
        + [statistics_case(args.tokens, dev)]
    rows = []
    for case in cases:
        rows.append(measure(case, args.budget_s))
        print(f"  {case['op']} {case['shape']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        path.write_text(json.dumps(dict(meta, rows=rows, seconds=time.perf_counter() - t0), indent=1))
    print(table(rows) + f"\n\n{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
