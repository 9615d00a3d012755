"""The routing cache's cross-sequence decode: at each layer the decode rows of every sequence whose
layer has one form (dense fp16 rows, with or without per-head masks; quantized at one bit width)
attend in one kernel call, and each job's tokens and bytes are still the ones it gets alone."""
import random

import torch

from executor.engine import KVBudget, LLMEngine, Sampling, batch_cache
from executor.prompt import Prompt
from executor.runner import Runner
from kvplan.plan import CompressionPlan, Eviction, LayerPlan, Quant, full_plan

REPEAT = Eviction(keep_tokens=20, window=8, scorer="snapkv", gqa_mode="repeat", span_tokens=4, sink_tokens=2)
MEAN = Eviction(keep_tokens=24, window=8, scorer="snapkv", gqa_mode="mean")


def test_like_layers_of_many_sequences_decode_in_one_call_with_their_solo_tokens(tiny_model, monkeypatch):
    m, hk = tiny_model.num_layers, tiny_model.num_kv_heads

    def each(**parts):
        return CompressionPlan("p", "t", tuple(LayerPlan(i, **parts) for i in range(m)))
    plans = {"full-a": full_plan(m, "f"), "full-b": full_plan(m, "f"), "repeat": each(eviction=REPEAT),
             "quant4-a": each(eviction=MEAN, quant=Quant(bits=4, group_size=16, residual=8)),
             "quant4-b": each(eviction=MEAN, quant=Quant(bits=4, group_size=16, residual=8)),
             "quant4-c": each(quant=Quant(bits=4, group_size=16, residual=8)),
             "quant8": each(eviction=MEAN, quant=Quant(bits=8, group_size=16, residual=8))}
    rng = random.Random(3)
    prompts = {name: Prompt([rng.randint(100, 40000) for _ in range(rng.randint(60, 120))], []) for name in plans}
    solo = {name: Runner(tiny_model, torch.float16, prefill_chunk=32).run(prompts[name], plan, Sampling(10))
            for name, plan in plans.items()}

    calls: list[tuple[tuple, int]] = []                  # (form, groups) of every cross-sequence call
    for word, kernel in list(batch_cache.DECODE_KERNELS.items()):
        def counted(form, operands, q, scaling, kernel=kernel):
            calls.append((form, len(operands)))
            return kernel(form, operands, q, scaling)
        monkeypatch.setitem(batch_cache.DECODE_KERNELS, word, counted)
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), max_batched_tokens=1024, prefill_chunk=32)
    seqs = {name: engine.sequence(prompts[name], plan, Sampling(10)) for name, plan in plans.items()}
    for seq in seqs.values():
        engine.add(seq)
    engine.run_all()
    for name, seq in seqs.items():
        assert seq.generated == solo[name].token_ids, name
        assert seq.cache.layer_bytes() == solo[name].layers, name
    forms = {form for form, _ in calls}
    assert ("dense",) in forms and ("quant", 4, 16, 16) in forms and not any(f[:2] == ("quant", 8) for f in forms)
    # both full jobs and the masked repeat job in one call; the three 4-bit jobs in one call
    assert max(n for form, n in calls if form == ("dense",)) == 3 * hk
    assert max(n for form, n in calls if form[0] == "quant") == 3 * hk
