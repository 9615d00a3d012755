"""One forward per step over every scheduled row: the segments packed into one [1, N] input
(each at its own positions), the model's dense layers batched over all N rows, attention per
sequence through its own cache (`BatchCache`), then the step's tokens sampled in one batch.

Each sequence's cache phase is set for the forward and reset after it, whatever happens."""
from __future__ import annotations

import contextlib

import torch

from executor import attention
from executor.cache import PlannedCache
from executor.engine.sampler import sample
from executor.engine.batch_cache import BatchCache
from executor.engine.scheduler import Output, Segment
from kernels import dense_decode
from kvplan.model import LoadedModel
from kvplan.plan import CompressionPlan


class ModelRunner:
    def __init__(self, lm: LoadedModel, storage_dtype: torch.dtype):
        self.lm, self.storage_dtype = lm, storage_dtype
        lm.model.set_attn_implementation(attention.register())     # every layer attends through its cache
        self.scaling = float(lm.model.model.layers[0].self_attn.scaling)     # softmax scale of every layer
        if storage_dtype == torch.float16 and lm.device.type == "cpu":
            dense_decode.build()          # the fp16 decode kernel now (a first build: ~1 min), not at a job's first token

    def new_cache(self, plan: CompressionPlan, store=None) -> PlannedCache:
        lm = self.lm
        rotary = lm.model.model.rotary_emb
        return PlannedCache(plan, lm.num_layers, lm.num_kv_heads, lm.head_dim, self.storage_dtype,
                            lm.num_query_heads, (rotary.inv_freq.float(), float(rotary.attention_scaling)), store)

    @torch.inference_mode()
    def run(self, segments: list[Segment]) -> list[Output]:
        logits = self.forward(segments)                                             # [K, V]
        rows, at = [], 0
        for seg in segments:
            rows.append((at, seg.keep))
            at += seg.keep
        sampled = [(i, at) for i, (seg, (at, _)) in enumerate(zip(segments, rows)) if seg.sample]
        tokens = {}
        if sampled:
            seqs = [segments[i].seq for i, _ in sampled]
            picked = logits[torch.tensor([r for _, r in sampled], device=logits.device)]   # [S, V] first kept row
            temps = torch.tensor([s.sampling.temperature for s in seqs], dtype=torch.float32, device=logits.device)
            top_p = torch.tensor([s.sampling.top_p for s in seqs], dtype=torch.float32, device=logits.device)
            ids = sample(picked, temps, top_p, [s.gen for s in seqs])
            tokens = {i: tok for (i, _), tok in zip(sampled, ids)}
        outs = []
        for i, (seg, (at, keep)) in enumerate(zip(segments, rows)):
            guess = int(logits[at + keep - 1].argmax()) if seg.phase in ("predecode", "spec") else None
            outs.append(Output(tokens.get(i), guess))
        return outs

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """-> the logits of every segment's last `keep` rows, in segment order: [K, V]."""
        ids, pos, spans, keep = [], [], [], []
        for seg in segments:
            a = len(ids)
            ids += seg.ids
            pos += range(seg.start, seg.start + len(seg.ids))
            spans.append((a, len(ids)))
            keep += range(len(ids) - seg.keep, len(ids))
        cache = BatchCache([seg.seq.cache for seg in segments], spans, self.lm.num_layers)
        with self._phases(segments), attention.using(cache):
            dev = self.lm.device
            out = self.lm.model(input_ids=torch.tensor([ids], device=dev), position_ids=torch.tensor([pos], device=dev),
                                past_key_values=cache, use_cache=True,                                   # [1, N]
                                logits_to_keep=torch.tensor(keep or [len(ids) - 1], device=dev))
        return out.logits[0, :len(keep)]

    @contextlib.contextmanager
    def _phases(self, segments: list[Segment]):
        """Each sequence's cache under its segment's phase for this forward (`CacheState.running`:
        AFTER again once it ends, whatever happens); an offload decode's step number with it."""
        with contextlib.ExitStack() as stack:
            for seg in segments:
                step = seg.seq.steps + 1 if seg.phase == "spec" else 0 if seg.phase == "predecode" else None
                stack.enter_context(seg.seq.cache.state.running(seg.phase, step))
            yield
