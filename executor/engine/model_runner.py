"""One forward per step over every scheduled row, like nano-vllm's: the segments packed into N rows
(each at its own positions), the decoder's own layers run here (norms, projections, RoPE, MLP:
the loaded model's modules, batched over all N rows), and at each layer one attention call for
every decode row whose layer is pooled — all forms, all sequences (`kernels.paged_decode`) —
with the step's block tables built once (`BlockTables.extend`, `decode_view`).

Rows that are not such decode rows attend per segment: a prefill part over its layer's dense
rows (or, after compression, its kept rows), a layer the pool does not hold through its own cache
layer (`executor.layers`, under the sequence's `CacheState` phase for this forward). A pooled
layer's last context chunk compresses it in place (`executor.engine.compression`) or gathers the
statistics its plan will come from.

Shapes: N packed rows; H query heads, H_kv KV heads, h_n = H / H_kv, D head dim; V vocabulary."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import psutil
import torch

from executor.attention import group_attention
from kvcore.attention import causal_attention
from executor.cache import PlannedCache
from executor.engine.compression import compress, gather
from executor.engine.block_tables import BlockTables, StepTables, Writes
from executor.engine.kv_pool import KVPool
from executor.engine.sampler import logprobs, sample
from executor.engine.scheduler import Output, Segment
from executor.engine.seq_cache import SeqCache
from kernels import cpu_extension
from kernels import decoder_ops as ops
from kernels.paged_decode import paged_decode
from kvcore import scoring
from kvcore.blocks import Layout
from kvplan.model import LoadedModel
from kvplan.plan import CompressionPlan

POOL_SHARE = 0.5          # of the memory available, the most a pool takes when the budget is larger


@dataclass
class StepPlan:
    """What one forward needs to know, built once: rows, positions, writes and decode tables."""
    segments: list[Segment]
    spans: list[tuple[int, int]]
    writes: Writes
    decode: list[int]                     # segments whose row attends in the batched call
    decode_rows: torch.Tensor | None      # [S_d] their rows
    tables: StepTables | None
    all_decode: bool = False              # every row is one of them, in segment order

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
        if lm.device.type == "cpu" and storage_dtype == torch.float16:
            cpu_extension.build()        # the decode kernels now (a first build compiles them), not at a job's first token

    @staticmethod
    def pool_bytes(budget_bytes: int, device: torch.device) -> int:
        """The pool for a KV budget: the budget, but never more than POOL_SHARE of the memory
        free on its device (a budget of "unlimited" in tests and benches)."""
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        return min(budget_bytes, int(POOL_SHARE * free))

    def new_legacy(self, plan: CompressionPlan, store=None) -> PlannedCache:
        """The cache layers of the plan's layers the pool does not hold (and the job's state)."""
        lm = self.lm
        return PlannedCache(plan, lm.num_layers, lm.num_kv_heads, lm.head_dim, self.storage_dtype,
                            lm.num_query_heads, self.rope, store)

    def new_cache(self, plan: CompressionPlan, store=None) -> SeqCache:
        """A sequence's cache; it takes its slot when admitted (`SeqCache.open`)."""
        lm, legacy = self.lm, self.new_legacy(plan, store)
        return SeqCache(plan, self.tables, legacy, lm.num_query_heads, lm.num_kv_heads, lm.model.dtype)

    def rebuild(self, cache: SeqCache, plan: CompressionPlan, store, queries: list, wait_s: float) -> None:
        """A dense running cache under a later plan (`SeqCache.rebuild`), its cache layers new."""
        legacy = self.new_legacy(plan, store)
        legacy.state.wait_s = wait_s
        cache.rebuild(plan, legacy, queries, self.scaling)

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
            want = [j for j, s in enumerate(seqs) if s.sampling.logprobs is not None]
            if want:                                  # the jobs that asked: their tokens' log-probabilities
                got = logprobs(picked[want], [ids[j] for j in want], max(seqs[j].sampling.logprobs for j in want))
                lps = {sampled[j][0]: (lp, top[:seqs[j].sampling.logprobs], vals[:seqs[j].sampling.logprobs])
                       for j, (lp, top, vals) in zip(want, got)}
        guesses = [i for i, seg in enumerate(segments) if seg.phase in ("predecode", "spec")]
        best = {i: int(logits[at + keep - 1].argmax()) for i in guesses for at, keep in [rows[i]]}
        return [Output(tokens.get(i), best.get(i), lps.get(i)) for i in range(len(segments))]

    def pages_due(self, segments: list[Segment]) -> int:
        """Pages the step's new rows take in the pool (`BlockTables.pages_due`)."""
        caches = [seg.seq.cache for seg in segments]
        return self.tables.pages_due([c.slot for c in caches], [len(seg.ids) for seg in segments])

    def plan_step(self, segments: list[Segment]) -> StepPlan:
        spans, at = [], 0
        for seg in segments:
            spans.append((at, at + len(seg.ids)))
            at += len(seg.ids)
        caches = [seg.seq.cache for seg in segments]
        writes = self.tables.extend([c.slot for c in caches], [len(seg.ids) for seg in segments])
        decode = [i for i, seg in enumerate(segments)
                  if seg.decode and seg.phase == "after" and len(seg.ids) == 1 and any(caches[i].pooled)]
        tables = rows = None
        if decode:
            tables = self.tables.decode_view([caches[i].slot for i in decode], self.lm.device)
            rows = torch.tensor([spans[i][0] for i in decode], device=self.lm.device)
        return StepPlan(segments, spans, writes, decode, rows, tables, len(decode) == len(segments))

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """-> the logits of every segment's last `keep` rows, in segment order: [K, V]."""
        ids, pos, keep = [], [], []
        for seg in segments:
            ids += seg.ids
            pos += range(seg.start, seg.start + len(seg.ids))
            keep += range(len(ids) - seg.keep, len(ids))
        step = self.plan_step(segments)
        dev = self.lm.device
        with self._phases(segments):
            logits = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                                torch.tensor(keep or [len(ids) - 1], device=dev),
                                lambda layer, q, k, v: self.attend(step, layer, q, k, v))
        caches = [seg.seq.cache for seg in segments]
        self.tables.flush([c.slot for c in caches if any(c.pooled)])
        for seg, c in zip(segments, caches):
            c.tokens_seen += len(seg.ids) if seg.phase != "predecode" else 0
        return logits[:len(keep)]

    def model(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, attend) -> torch.Tensor:
        """The decoder over rows ids, pos [N] -> logits of rows `keep` [K, V]; attend(layer, q
        [N, H, D], k, v [N, H_kv, D]) -> [N, H, D] is each layer's attention. The loaded model's
        weights and modules; its per-row ops fused (`kernels.decoder_ops`)."""
        lm = self.lm
        m = lm.model.model
        n, h, hk, d = ids.shape[0], lm.num_query_heads, lm.num_kv_heads, lm.head_dim
        x = m.embed_tokens(ids)                                                        # [N, hidden] residual
        cos, sin = m.rotary_emb(x, pos[None])                                          # [1, N, D]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()                            # [N, D]
        layers = m.layers
        y = ops.rms_norm(x, layers[0].input_layernorm.weight, self.eps)
        for i, layer in enumerate(layers):
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
        if step.all_decode and step.tables.all_paged[layer]:        # a decode step: every row in one call
            hk = self.lm.num_kv_heads
            return paged_decode(q.view(-1, q.shape[1] // hk, q.shape[2]), self.pool.arena, *step.tables.layers[layer],
                                self.layout, self.scaling).view(q.shape).to(q.dtype)
        out = torch.empty_like(q)
        batched = set()
        if step.decode:
            batched = self._decode(step, layer, q, out)
        for i, seg in enumerate(step.segments):
            if i in batched:
                continue
            a, b = step.spans[i]
            cache = seg.seq.cache
            if cache.pooled[layer]:
                out[a:b] = self._pooled(seg, layer, q[a:b])
            else:
                out[a:b] = self._own(cache.legacy.layers[layer], q[a:b], k[a:b], v[a:b])
        return out

    def _decode(self, step: StepPlan, layer: int, q: torch.Tensor, out: torch.Tensor) -> set[int]:
        """The decode rows whose layer is pooled, in one kernel call -> their segments."""
        st, hk = step.tables, self.lm.num_kv_heads
        hn, d = q.shape[1] // hk, q.shape[2]
        if st.all_paged[layer]:
            sel, rows, tables = step.decode, step.decode_rows, st.layers[layer]
        else:
            which = st.paged[layer].nonzero()[:, 0]
            if not which.numel():
                return set()
            sel = [step.decode[i] for i in which.tolist()]
            rows = step.decode_rows[which.to(step.decode_rows.device)]
            streams = (which[:, None] * hk + torch.arange(hk)).reshape(-1).to(st.dtable.device)
            tables = [t.index_select(0, streams) for t in st.layers[layer]]
        res = paged_decode(q.index_select(0, rows).view(-1, hn, d), self.pool.arena, *tables,
                           self.layout, self.scaling)                                   # [S_d·H_kv, h_n, D]
        out.index_copy_(0, rows, res.view(len(sel), -1, d).to(q.dtype))
        return set(sel)

    def _pooled(self, seg: Segment, layer: int, q: torch.Tensor) -> torch.Tensor:
        """A pooled layer's rows of one segment (its K/V already written): q [m, H, D] -> [m, H, D]."""
        cache = seg.seq.cache
        lp, s, tables = cache.plan.layers[layer], cache.slot, self.tables
        if seg.phase == "after" and (lp.eviction is not None or lp.quant is not None):
            return self._compressed(cache, layer, q)
        k, v = tables.dense(layer, s)                                                  # [H_kv, T, D] stored
        k, v = k.to(q.dtype), v.to(q.dtype)
        qh = q.transpose(0, 1)                                                         # [H, m, D]
        out = causal_attention(qh[None], k[None], v[None], self.scaling)[0]           # [m, H, D]
        context = seg.phase in ("context", "compress", "stats")
        if context and lp.eviction is not None and lp.eviction.scorer == "h2o":
            cache.acc[layer] = scoring.accumulate_attention(cache.acc.get(layer), qh, k, self.scaling)
        if seg.phase == "compress":
            compress(tables, layer, s, lp, qh, k, v, self.scaling, cache.acc.pop(layer, None))
        elif seg.phase == "stats":
            gather(cache.state.stats, cache.state.queries, qh, k, v, self.scaling, self.rope)
        return out

    def _compressed(self, cache: SeqCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Rows after compression (a question's part, or a lone decode row outside the batched
        call): every kept row seen, the new rows causal. q [m, H, D] -> [m, H, D]."""
        m, h, d = q.shape
        hk = self.lm.num_kv_heads
        hn, outs = h // hk, []
        for g in range(hk):
            k, v = self.tables.stream(layer, cache.slot, g)                            # [U, D] fp32
            u = k.shape[0]
            cols = torch.arange(u, device=q.device)
            mask = (cols[None, :] < u - m) | (cols[None, :] - (u - m) <= torch.arange(m, device=q.device)[:, None])
            qg = q[:, g * hn:(g + 1) * hn].transpose(0, 1).float()                     # [h_n, m, D]
            outs.append(group_attention(qg, k.to(q.device), v.to(q.device), mask.expand(hn, m, u), self.scaling))
        return torch.cat(outs).transpose(0, 1).to(q.dtype)

    def _own(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A layer the pool does not hold, through its cache layer: q [m, H, D], k, v [m, H_kv, D]."""
        keys, values = layer.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return layer.attend(q.transpose(0, 1)[None], keys, values, self.scaling)[0]

    @contextlib.contextmanager
    def _phases(self, segments: list[Segment]):
        """Each sequence's cache state under its segment's phase for this forward (`CacheState.running`:
        AFTER again once it ends, whatever happens); an offload decode's step number with it."""
        with contextlib.ExitStack() as stack:
            for seg in segments:
                step = seg.seq.steps + 1 if seg.phase == "spec" else 0 if seg.phase == "predecode" else None
                stack.enter_context(seg.seq.cache.state.running(seg.phase, step))
            yield


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
