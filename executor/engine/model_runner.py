"""One forward per step over every scheduled row, like nano-vllm's: the segments packed into N rows
(each at its own positions), the decoder's own layers run here (norms, projections, RoPE, MLP:
the loaded model's modules, batched over all N rows), and at each layer one attention call for
every decode row of the step — all storage forms, all sequences (`kernels.paged_decode`; a second
call only for SpeCache's two-row steps) — with the step's tables built once
(`BlockTables.extend`, `decode_view`).

Prefill parts attend per segment: a context chunk over its layer's dense rows (H2O accumulating
the attention it pays; the last chunk then compresses the layer with its plan's press,
`executor.presses`, or gathers the statistics a later plan comes from); a part after the context
(the question, or a recomputed sequence's generated tokens) over the stream's rows as they are
stored, its own rows causal.

Shapes: N packed rows; H query heads, H_kv KV heads, h_n = H / H_kv, D head dim; V vocabulary."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import psutil
import torch

from executor.engine.block_tables import TABLES, BlockTables, StepTables, Writes
from executor.engine.compression import gather
from executor.engine.cuda_graph import DecodeGraphs
from executor.engine.kv_pool import KVPool
from executor.engine.sampler import logprobs, sample
from executor.engine.scheduler import Output, Segment
from executor.engine.seq_cache import SeqCache
from executor.engine.sequence import Phase
from executor.presses import offload
from executor.presses.context import PressContext
from executor.presses.registry import PRESSES, check, kind
from kernels import cpu_extension
from kernels import decoder_ops as ops
from kernels import decode_layers as fused_layers
from kernels import paged_prefill as prefill_kernel
from kernels.paged_decode import paged_decode
from kvcore import scoring
from kvcore.attention import causal_attention
from kvcore.blocks import Layout
from kvcore.model import LoadedModel
from kvcore.plan import CompressionPlan

POOL_SHARE = 0.5          # of the memory available, the most a pool takes when the budget is larger


@dataclass
class DecodeGroup:
    """Decode segments of one row count (1, or SpeCache's 2), attended in one call per layer."""
    index: list[int]                      # their segments
    rows: torch.Tensor                    # [S_d, r] their rows in the step
    tables: StepTables


@dataclass
class PagedPrefill:
    """Context chunks that attend in one paged prefill call per layer (`kernels.paged_prefill`)."""
    index: list[int]                      # their segments
    rows: torch.Tensor                    # [N'] their rows in the step
    slots: torch.Tensor                   # [S'] their sequences' slots
    kv_len: torch.Tensor                  # [S'] int32 rows each stream holds (its new rows the last)
    q_start: torch.Tensor                 # [S' + 1] int32
    width: int                            # pages of the longest


@dataclass
class StepPlan:
    """What one forward needs to know, built once: rows, writes and decode tables."""
    segments: list[Segment]
    spans: list[tuple[int, int]]
    writes: Writes
    groups: list[DecodeGroup]
    prefills: list[int]                   # segments that attend per segment
    paged: PagedPrefill | None = None     # context chunks that attend together


class ModelRunner:
    def __init__(self, lm: LoadedModel, storage_dtype: torch.dtype, budget_bytes: int, max_seqs: int = 64):
        self.lm, self.storage_dtype = lm, storage_dtype
        m = lm.model.model
        self.scaling = float(m.layers[0].self_attn.scaling)          # softmax scale of every layer
        self.eps = float(m.layers[0].input_layernorm.variance_epsilon)
        self.silu = getattr(lm.model.config, "hidden_act", "silu") == "silu"     # LlamaMLP's act (else its own module)
        self.rope = (m.rotary_emb.inv_freq.float(), float(m.rotary_emb.attention_scaling))
        self.layout = Layout(lm.head_dim, storage_dtype.itemsize)
        self.pool = KVPool(self.layout, self.pool_bytes(budget_bytes, lm.device), lm.device)
        self.tables = BlockTables(self.pool, lm.num_layers, lm.num_kv_heads, max_seqs + 8, lm.max_context + 64)
        self.rope_tables = self._rope_tables(lm.max_context + 64)
        self.press = PressContext(self.tables, lm.num_query_heads, self.scaling, self.rope, self.rope_tables)
        self.graphs = DecodeGraphs(self, max_seqs)
        self.weights = fused_layers.Weights.of(lm.model) \
            if lm.device.type == "cpu" and storage_dtype == torch.float16 and lm.decode_layers else None
        if lm.device.type == "cpu" and storage_dtype == torch.float16:
            cpu_extension.build()        # the decode kernels now (a first build compiles them), not at a job's first token

    @staticmethod
    def pool_bytes(budget_bytes: int, device: torch.device) -> int:
        """The pool for a KV budget: the budget, but never more than POOL_SHARE of the memory
        free on its device (a budget of "unlimited" in tests and benches)."""
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        return min(budget_bytes, int(POOL_SHARE * free))

    def _rope_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D] fp32 of every position: what coded pre-RoPE keys are turned by."""
        m = self.lm.model.model
        x = torch.zeros(1, 1, self.lm.head_dim, device=self.lm.device)
        cos, sin = m.rotary_emb(x, torch.arange(positions, device=self.lm.device)[None])
        return cos[0].float().contiguous(), sin[0].float().contiguous()

    def new_cache(self, plan: CompressionPlan) -> SeqCache:
        """A sequence's cache; it takes its slot when admitted (`SeqCache.open`). A plan the pool
        cannot hold is refused here, before any work (`executor.presses.registry.check`)."""
        lm = self.lm
        check(plan, lm.num_layers, lm.num_query_heads, lm.num_kv_heads, self.layout)
        return SeqCache(plan, self.tables, lm.num_kv_heads, lm.head_dim)

    @torch.inference_mode()
    def rebuild(self, seq, plan: CompressionPlan, queries: list[torch.Tensor]) -> None:
        """A dense running cache (every layer full: a plan that came after the context, or a
        shrink) under `plan`: each layer's context rows [0, C) compressed with the context's last
        queries [m] of [H, W, D] by its press, the rows fed since [C, T) joining after them, in
        layer order (a merged pair's lower first)."""
        c, dtype = seq.context_tokens, self.lm.model.dtype
        seq.cache.plan = plan
        for i, lp in enumerate(plan.layers):
            k, v = self.tables.dense(i, seq.cache.slot)                               # [H_kv, T, D] stored dtype
            k, v = k.to(dtype), v.to(dtype)
            later = (k[:, c:], v[:, c:]) if k.shape[1] > c else (None, None)
            PRESSES[kind(plan, i)](self.press, seq, i, lp, queries[i], k[:, :c], v[:, :c], *later)

    # -- a step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, segments: list[Segment]) -> list[Output]:
        logits = self.forward(segments)                                             # [K, V]
        rows, at = [], 0
        for seg in segments:
            rows.append((at, seg.keep))
            at += seg.keep
        sampled = [(i, at) for i, (seg, (at, _)) in enumerate(zip(segments, rows)) if seg.sample]
        tokens, lps = {}, {}
        if sampled:
            seqs = [segments[i].seq for i, _ in sampled]
            picked = logits[torch.tensor([r for _, r in sampled], device=logits.device)]   # [S, V] first kept row
            temps = torch.tensor([s.sampling.temperature for s in seqs], dtype=torch.float32, device=logits.device)
            top_p = torch.tensor([s.sampling.top_p for s in seqs], dtype=torch.float32, device=logits.device)
            ids = sample(picked, temps, top_p, [s.gen for s in seqs])
            tokens = {i: tok for (i, _), tok in zip(sampled, ids)}
            for j, s in enumerate(seqs):
                if s.step_logits is not None:
                    s.step_logits.append(picked[j].float().cpu())
            want = [j for j, s in enumerate(seqs) if s.sampling.logprobs is not None]
            if want:                                  # the jobs that asked: their tokens' log-probabilities
                got = logprobs(picked[want], [ids[j] for j in want], max(seqs[j].sampling.logprobs for j in want))
                lps = {sampled[j][0]: (lp, top[:seqs[j].sampling.logprobs], vals[:seqs[j].sampling.logprobs])
                       for j, (lp, top, vals) in zip(want, got)}
        guesses = [i for i, seg in enumerate(segments) if seg.phase in (Phase.PREDECODE, Phase.SPEC)]
        best = {i: int(logits[at + keep - 1].argmax()) for i in guesses for at, keep in [rows[i]]}
        return [Output(tokens.get(i), best.get(i), lps.get(i)) for i in range(len(segments))]

    @staticmethod
    def stored(seg: Segment) -> int:
        """Rows of a segment its streams keep: all, but for SpeCache's steps (its guess, its
        pre-decoding row: none)."""
        return 0 if seg.phase is Phase.PREDECODE else 1 if seg.phase is Phase.SPEC else len(seg.ids)

    def pages_due(self, segments: list[Segment]) -> int:
        """Pages the step's new rows take in the pool (`BlockTables.pages_due`)."""
        return self.tables.pages_due([seg.seq.cache.slot for seg in segments], [self.stored(s) for s in segments])

    def plan_step(self, segments: list[Segment]) -> StepPlan:
        spans, at = [], 0
        for seg in segments:
            spans.append((at, at + len(seg.ids)))
            at += len(seg.ids)
        slots = [seg.seq.cache.slot for seg in segments]
        writes = self.tables.extend(slots, [len(seg.ids) for seg in segments], [self.stored(s) for s in segments])
        groups, prefills = [], []
        by_rows: dict[int, list[int]] = {}
        for i, seg in enumerate(segments):
            if seg.decode:
                by_rows.setdefault(len(seg.ids), []).append(i)
            else:
                prefills.append(i)
        dev = self.lm.device
        for r, index in sorted(by_rows.items()):
            rows = torch.tensor([[spans[i][0] + j for j in range(r)] for i in index], device=dev)
            groups.append(DecodeGroup(index, rows, self.tables.decode_view([slots[i] for i in index], dev)))
        paged = None
        if prefill_kernel.fast(dev) and self.storage_dtype == torch.float16:   # the kernels read fp16 pages
            # context chunks: one call a layer; a context's last chunk (its statistics or its
            # press) and H2O's chunks (their attention summed) also stay in `prefills` for what
            # follows their attention
            index = [i for i in prefills if segments[i].phase.context]
            prefills = [i for i in prefills if i not in index or segments[i].phase is not Phase.CONTEXT
                        or self._h2o(segments[i].seq)]
            if index:
                lens = [int(self.tables.dend[0, slots[i], 0]) for i in index]
                counts = [len(segments[i].ids) for i in index]
                rows = torch.cat([torch.arange(*spans[i]) for i in index]).to(dev)
                paged = PagedPrefill(index, rows, torch.tensor([slots[i] for i in index]),
                                     torch.tensor(lens, dtype=torch.int32, device=dev),
                                     torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=dev),
                                     max(-(-max(lens) // self.layout.rows), 1))
        return StepPlan(segments, spans, writes, groups, prefills, paged)

    @staticmethod
    def _h2o(seq) -> bool:
        return any(lp.eviction is not None and lp.eviction.scorer == "h2o" for lp in seq.cache.plan.layers)

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """-> the logits of every segment's last `keep` rows, in segment order: [K, V]. A decode
        step on CUDA replays a captured graph (`executor.engine.cuda_graph`)."""
        if self.graphs.usable(segments):
            logits = self.graphs.run(segments)
            self.tables.flush([seg.seq.cache.slot for seg in segments])
            for seg in segments:
                seg.seq.cache.tokens_seen += 1
            return logits
        ids, pos, keep = [], [], []
        for seg in segments:
            ids += seg.ids
            pos += range(seg.start, seg.start + len(seg.ids))
            keep += range(len(ids) - seg.keep, len(ids))
        step = self.plan_step(segments)
        dev = self.lm.device
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                            torch.tensor(keep or [len(ids) - 1], device=dev),
                            lambda layer, q, k, v: self.attend(step, layer, q, k, v), self._layers(step))
        self.tables.flush([seg.seq.cache.slot for seg in segments])
        for seg in segments:
            seg.seq.cache.tokens_seen += self.stored(seg)
        return logits[:len(keep)]

    def _layers(self, step: StepPlan):
        """A CPU step of one-row decodes only (no SpeCache rows, no prefill part): its layers in one
        call (`kernels.decode_layers`) -> layers(x, y, cos, sin) -> x; else None (the loop)."""
        if self.weights is None or step.prefills or step.paged is not None or len(step.groups) != 1 \
                or step.writes.valid is not None or step.groups[0].rows.shape[1] != 1 \
                or any(seg.phase is not Phase.AFTER for seg in step.segments):
            return None
        lm, grp = self.lm, step.groups[0]
        tables = [getattr(grp.tables, name) for name in TABLES]
        return lambda x, y, cos, sin: fused_layers.decode_layers(
            x, y, cos, sin, self.weights, self.eps, lm.num_query_heads, lm.num_kv_heads,
            self.pool.rows(self.storage_dtype), step.writes.rows, self.pool.arena, tables, self.layout,
            self.scaling, self.rope_tables)

    def model(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, attend, fused=None) -> torch.Tensor:
        """The decoder over rows ids, pos [N] -> logits of rows `keep` [K, V]; attend(layer, q
        [N, H, D], k, v [N, H_kv, D]) -> [N, H, D] is each layer's attention. The loaded model's
        weights and modules; its per-row ops fused (`kernels.decoder_ops`); `fused` (a decode
        step on the CPU, `_layers`): all layers in one call instead of the loop."""
        lm = self.lm
        m = lm.model.model
        n, h, hk, d = ids.shape[0], lm.num_query_heads, lm.num_kv_heads, lm.head_dim
        x = m.embed_tokens(ids)                                                        # [N, hidden] residual
        cos, sin = m.rotary_emb(x, pos[None])                                          # [1, N, D]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()                            # [N, D]
        layers = m.layers
        y = ops.rms_norm(x, layers[0].input_layernorm.weight, self.eps)
        if fused is not None:
            y = fused(x, y, cos, sin)
        for i, layer in enumerate(layers if fused is None else ()):
            a, mlp = layer.self_attn, layer.mlp
            q = ops.rope_(a.q_proj.forward(y).view(n, h, d), cos, sin)
            k = ops.rope_(a.k_proj.forward(y).view(n, hk, d), cos, sin)
            v = a.v_proj.forward(y).view(n, hk, d)
            o = a.o_proj.forward(attend(i, q, k, v).reshape(n, h * d))
            y = ops.add_rms_norm(x, o, layer.post_attention_layernorm.weight, self.eps)
            o = mlp.down_proj.forward(ops.silu_mul(mlp.gate_proj.forward(y), mlp.up_proj.forward(y))) \
                if self.silu else mlp(y)
            w = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
            y = ops.add_rms_norm(x, o, w, self.eps) if w is not None else x.add_(o)
        return lm.model.lm_head(m.norm(y.index_select(0, keep)))

    # -- attention ------------------------------------------------------------------------------
    def attend(self, step: StepPlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's attention for every row of the step -> [N, H, D]."""
        self.tables.write(step.writes, layer, k, v)
        out = torch.empty_like(q)
        for grp in step.groups:
            self._decode(step, grp, layer, q, k, v, out)
        if step.paged is not None:
            pp = step.paged
            table = self.tables.dtable[layer].index_select(0, pp.slots)[..., :pp.width].to(q.device)   # [S', H_kv, MB]
            res = prefill_kernel.paged_prefill(q.index_select(0, pp.rows).contiguous(), self.pool.arena, table,
                                               pp.kv_len, pp.q_start, self.layout.rows, self.scaling)
            out.index_copy_(0, pp.rows, res.to(q.dtype))
        attended = set(step.paged.index) if step.paged is not None else set()
        for i in step.prefills:
            a, b = step.spans[i]
            if i in attended:
                self._after_attention(step.segments[i], layer, q[a:b])
            else:
                out[a:b] = self._prefill(step.segments[i], layer, q[a:b])
        return out

    def _decode(self, step: StepPlan, grp: DecodeGroup, layer: int, q, k, v, out) -> None:
        """A group's decode rows in one kernel call over every form: q rows [S_d, r] -> out."""
        lm = self.lm
        hk, hn, d = lm.num_kv_heads, lm.num_query_heads // lm.num_kv_heads, lm.head_dim
        segs = [step.segments[i] for i in grp.index]
        spec = [seg.seq for seg in segs if seg.phase is Phase.SPEC]
        if spec:                                                          # the rows prefetched for this step
            offload.place(self.press, spec, layer, [seq.steps + 1 for seq in spec])
        s, r = grp.rows.shape
        flat = grp.rows.reshape(-1)
        qg = q.index_select(0, flat).view(s, r, hk, hn, d).permute(0, 2, 1, 3, 4).reshape(s * hk, r * hn, d)
        res, lse = paged_decode(qg, self.pool.arena, *grp.tables.layer(layer), self.layout, self.scaling,
                                self.rope_tables, group_heads=hn)                 # [S_d·H_kv, r·h_n, D]
        if any(seg.phase in (Phase.SPEC, Phase.PREDECODE) for seg in segs):
            self._speculate(segs, layer, qg, res, lse, k, v, grp)
        res = res.view(s, hk, r, hn, d).permute(0, 2, 1, 3, 4).reshape(s * r, hk * hn, d)
        out.index_copy_(0, flat, res.to(q.dtype))

    def _speculate(self, segs: list[Segment], layer: int, qg, res, lse, k_new, v_new, grp: DecodeGroup) -> None:
        """SpeCache after a decode call (res, lse [S_d·H_kv, r·h_n, …] in place), for all its
        sequences at once: the guess row (the second of a SPEC step) adds its own row, which is
        not stored; the real row's K/V goes to the store; the guess's attention (or a pre-decoding
        row's) picks the next step's rows to prefetch. k_new, v_new [N, H_kv, D]: the step's new rows."""
        hk, hn, d = self.lm.num_kv_heads, self.lm.num_query_heads // self.lm.num_kv_heads, self.lm.head_dim
        s = len(segs)
        q4, r4, l3 = qg.view(s, hk, -1, d), res.view(s, hk, -1, d), lse.view(s, hk, -1)    # [S_d, H_kv, r·h_n, …]
        spec = [j for j, seg in enumerate(segs) if seg.phase is Phase.SPEC]
        pre = [j for j, seg in enumerate(segs) if seg.phase is Phase.PREDECODE]
        if spec:
            at = torch.tensor(spec, device=qg.device)
            real, guess = grp.rows[at, 0], grp.rows[at, 1]                                  # [S']
            self._own_row(r4, l3, at, q4.index_select(0, at)[:, :, hn:], k_new[guess], v_new[guess])
            kr, vr = k_new[real].to(self.storage_dtype), v_new[real].to(self.storage_dtype)   # [S', H_kv, D]
            seqs = [segs[j].seq for j in spec]
            for i, seq in enumerate(seqs):
                seq.store.put(layer, kr[i][:, None], vr[i][:, None])
            offload.select(self.press, seqs, layer, q4.index_select(0, at)[:, :, hn:],
                           l3.index_select(0, at)[:, :, hn:], [seq.steps + 2 for seq in seqs])
        if pre:
            at = torch.tensor(pre, device=qg.device)
            offload.select(self.press, [segs[j].seq for j in pre], layer, q4.index_select(0, at)[:, :, :hn],
                           l3.index_select(0, at)[:, :, :hn], [1] * len(pre))

    def _own_row(self, r4, l3, at, q, k, v) -> None:
        """The guess rows of sequences `at` [S'] attend to their own new row too (it is not in the
        pool): q [S', H_kv, h_n, D], k, v [S', H_kv, D]; their outputs in r4 [S_d, H_kv, r·h_n, D]
        and log-sum-exps in l3 [S_d, H_kv, r·h_n] (the guess's h_n heads the last) merged in place."""
        hn = q.shape[2]
        own = torch.einsum("shjd,shd->shj", q.float(), k.float()) * self.scaling                # [S', H_kv, h_n]
        lse = l3.index_select(0, at)[:, :, hn:]
        m = torch.maximum(lse, own)
        wa, wb = torch.exp(lse - m), torch.exp(own - m)
        res = r4.index_select(0, at)[:, :, hn:]
        r4[at, :, hn:] = (res * wa[..., None] + wb[..., None] * v.float()[:, :, None, :]) / (wa + wb)[..., None]
        l3[at, :, hn:] = m + torch.log(wa + wb)

    def _prefill(self, seg: Segment, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One segment's prefill rows of a layer (their K/V already written): q [m, H, D] -> [m, H, D]."""
        seq, slot = seg.seq, seg.seq.cache.slot
        qh = q.transpose(0, 1)                                                         # [H, m, D]
        if not seg.phase.context:
            return self._after(seg, layer, qh)
        k, v = self.tables.dense(layer, slot)                                          # [H_kv, T, D] stored
        k, v = k.to(q.dtype), v.to(q.dtype)
        out = causal_attention(qh[None], k[None], v[None], self.scaling)[0]           # [m, H, D]
        self._after_attention(seg, layer, q, (k, v))
        return out

    def _after_attention(self, seg: Segment, layer: int, q: torch.Tensor, kv: tuple | None = None) -> None:
        """What a context chunk does after its attention (rows q [m, H, D], the stream's K/V kv
        [H_kv, T, D] each, read from the pool where not given): an H2O layer sums the chunk's
        attention; the context's last chunk presses the layer, or gathers its statistics for the plan."""
        seq, slot = seg.seq, seg.seq.cache.slot
        lp = seq.cache.plan.layers[layer]
        h2o = lp.eviction is not None and lp.eviction.scorer == "h2o"
        if not h2o and (seg.phase not in (Phase.COMPRESS, Phase.STATS) or
                        seg.phase is Phase.COMPRESS and kind(seq.cache.plan, layer) == "full"):   # rows stay as they are
            return
        qh = q.transpose(0, 1)                                                         # [H, m, D]
        k, v = kv if kv is not None else (t.to(q.dtype) for t in self.tables.dense(layer, slot))
        if h2o:
            seq.acc[layer] = scoring.accumulate_attention(seq.acc.get(layer), qh, k, self.scaling)
        if seg.phase is Phase.COMPRESS:
            plan = seq.cache.plan
            PRESSES[kind(plan, layer)](self.press, seq, layer, lp, qh, k, v)
            seq.acc.pop(layer, None)
        elif seg.phase is Phase.STATS:
            gather(seq.stats, seq.queries, qh, k, v, self.scaling, self.rope)

    def _after(self, seg: Segment, layer: int, qh: torch.Tensor) -> torch.Tensor:
        """Rows after the context (the question, or a recomputed sequence's generated tokens) over
        every row the stream holds, their own rows causal: qh [H, m, D] -> [m, H, D]. An offload
        layer reads its exact rows back from the store for this call (the low-bit copy where the
        store has failed)."""
        seq, slot, m = seg.seq, seg.seq.cache.slot, qh.shape[1]
        lm = self.lm
        hk, hn = lm.num_kv_heads, lm.num_query_heads // lm.num_kv_heads
        rows = seq.store.read(layer) if seq.offload and seq.store is not None else None
        outs = []
        for g in range(hk):
            if rows is not None:
                kd, vd = self.tables.dense(layer, slot)
                k = torch.cat([rows[0][g].float(), kd[g, -m:].float()]).to(qh.device)
                v = torch.cat([rows[1][g].float(), vd[g, -m:].float()]).to(qh.device)
                heads = torch.full((k.shape[0],), 0xFF, dtype=torch.uint8)
            else:
                k, v, heads = self.tables.stream(layer, slot, g, self.rope_tables)          # [U, D] fp32
            u = k.shape[0]
            cols = torch.arange(u, device=qh.device)
            causal = (cols[None, :] < u - m) | (cols[None, :] - (u - m) <= torch.arange(m, device=qh.device)[:, None])
            seen = (heads.to(qh.device)[None, :] & (1 << torch.arange(hn, device=qh.device)).to(torch.uint8)[:, None]) > 0
            mask = causal[None] & seen[:, None, :]                                          # [h_n, m, U]
            qg = qh[g * hn:(g + 1) * hn].float()
            logits = (qg @ k.T) * self.scaling
            outs.append(torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ v)   # [h_n, m, D]
        if rows is not None:
            kd, vd = self.tables.dense(layer, slot)
            seq.store.put(layer, kd[:, -m:], vd[:, -m:])
        return torch.cat(outs).transpose(0, 1).to(qh.dtype)
