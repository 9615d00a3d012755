"""Decode steps on CUDA as captured graphs (nano-vllm's `capture_cudagraph`): a step whose rows are
all one-row decodes (no SpeCache step, no prefill part) replays the graph of the smallest batch
bucket that holds it. Per bucket the graph holds static inputs — token ids, positions, each new
row's arena row, the step's stream indices — and the whole decoder: projections, the fused decoder
ops (`kernels.decoder_ops`, Triton on CUDA), the new K/V written into the arena, one paged
attention launch per layer over every stream whatever its forms (`kernels.paged_decode`: the forms
are data the kernel reads, so the graph does not change with the plans in the batch), the LM head.

The pool's tables live on the GPU as a mirror of the CPU ones (`BlockTables.device_tables`),
updated only where they changed; a graph gathers the step's streams' rows of them itself, so a
step copies a few hundred bytes to the GPU, replays, and reads back the sampled tokens' logits.
Padding rows (a bucket larger than the step) write to a scratch page and attend over nothing.

Shapes: B batch bucket, H query heads, H_kv KV heads, L layers, V vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.engine.block_tables import TABLES
from executor.engine.sequence import Phase
from kernels.kv_write import write_kv
from kernels.paged_decode import paged_decode

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass
class Graph:
    batch: int
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor          # [B] long
    pos: torch.Tensor          # [B] long
    rows: torch.Tensor         # [L, B, H_kv] long: each new row's arena K row
    streams: torch.Tensor      # [B·H_kv] long: stream indices (slot·H_kv + head) into the mirrored tables
    logits: torch.Tensor       # [B, V]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.max_batch = min(max_batch, BUCKETS[-1])
        self.graphs: dict[int, Graph] = {}
        self.pool = None                                   # the graphs' shared memory pool
        self.enabled = runner.lm.device.type == "cuda"

    def usable(self, segments) -> bool:
        """Whether a step runs as a graph: CUDA, every segment one decode row over the compressed
        cache, no more than the largest bucket."""
        return (self.enabled and 0 < len(segments) <= self.max_batch
                and all(seg.decode and seg.phase is Phase.AFTER and len(seg.ids) == 1 for seg in segments))

    @staticmethod
    def bucket(n: int) -> int:
        return next(b for b in BUCKETS if b >= n)

    def run(self, segments) -> torch.Tensor:
        """One decode step of `segments` through its bucket's graph -> logits [S, V]."""
        r, n = self.runner, len(segments)
        g = self.graphs.get(self.bucket(n)) or self.capture(self.bucket(n))
        slots = [seg.seq.cache.slot for seg in segments]
        writes = r.tables.extend(slots, [1] * n)                                      # [L, n, H_kv] rows
        r.tables.sync_device()
        dev = g.ids.device
        hk = r.lm.num_kv_heads
        g.ids[:n].copy_(torch.tensor([seg.ids[0] for seg in segments]), non_blocking=True)
        g.pos[:n].copy_(torch.tensor([seg.start for seg in segments]), non_blocking=True)
        g.rows[:, :n].copy_(writes.rows, non_blocking=True)
        streams = (torch.tensor(slots)[:, None] * hk + torch.arange(hk)).reshape(-1)
        g.streams[:n * hk].copy_(streams, non_blocking=True)
        if n < g.batch:                                                                 # padding: nothing to attend
            g.rows[:, n:].fill_(r.tables.scratch_row)
            g.streams[n * hk:].fill_(r.tables.empty_stream)
        g.graph.replay()
        del dev
        return g.logits[:n]

    @torch.inference_mode()
    def capture(self, batch: int) -> Graph:
        """Capture the decoder's step at `batch` rows (a warm-up run first, as CUDA graphs ask)."""
        r = self.runner
        lm, dev = r.lm, r.lm.device
        hk, hn, d = lm.num_kv_heads, lm.num_query_heads // lm.num_kv_heads, lm.head_dim
        ids = torch.zeros(batch, dtype=torch.long, device=dev)
        pos = torch.zeros(batch, dtype=torch.long, device=dev)
        rows = torch.full((lm.num_layers, batch, hk), r.tables.scratch_row, dtype=torch.long, device=dev)
        streams = torch.full((batch * hk,), r.tables.empty_stream, dtype=torch.long, device=dev)
        keep = torch.arange(batch, device=dev)
        tables = r.tables.device_tables()
        arena_rows = r.pool.rows(r.tables.dtype)

        def attend(layer, q, k, v):
            write_kv(arena_rows, rows[layer].reshape(-1), k.reshape(-1, d), v.reshape(-1, d), r.layout.rows)
            view = [tables[name][layer].index_select(0, streams) for name in TABLES]
            out, _ = paged_decode(q.view(batch * hk, hn, d), r.pool.arena, *view, r.layout, r.scaling,
                                  r.rope_tables, group_heads=hn)
            return out.view(batch, hk * hn, d).to(q.dtype)

        for _ in range(2):                                                              # warm-up: autotune, allocate
            r.model(ids, pos, keep, attend)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = r.model(ids, pos, keep, attend)
        if self.pool is None:
            self.pool = graph.pool()
        g = Graph(batch, graph, ids, pos, rows, streams, logits)
        self.graphs[batch] = g
        return g
