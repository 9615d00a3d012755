"""The model runner's step: at each layer the decode rows of every sequence — full, evicted per KV
head or per query head, quantized at 2, 4 or 8 bits under eviction or not — attend in one paged
kernel call whatever their forms, and each job's tokens and bytes are still the ones it gets
alone. The runner's own decoder forward gives the loaded model's logits."""
import random

import torch

from executor.engine import KVBudget, LLMEngine, Sampling, model_runner
from executor.prompt import Prompt
from executor.engine.sequence import Phase
from executor.runner import Runner
from kvcore.plan import CompressionPlan, Eviction, LayerPlan, Quant, full_plan

REPEAT = Eviction(keep_tokens=20, window=8, scorer="snapkv", gqa_mode="repeat", span_tokens=4, sink_tokens=2)
MEAN = Eviction(keep_tokens=40, window=8, scorer="snapkv", gqa_mode="mean")


def test_every_pooled_form_of_many_sequences_decodes_in_one_call_per_layer_with_solo_tokens(tiny_model, monkeypatch):
    m, hk = tiny_model.num_layers, tiny_model.num_kv_heads

    def each(**parts):
        return CompressionPlan("p", "t", tuple(LayerPlan(i, **parts) for i in range(m)))
    plans = {"full-a": full_plan(m, "f"), "full-b": full_plan(m, "f"), "evicted": each(eviction=MEAN),
             "quant4": each(eviction=MEAN, quant=Quant(bits=4, group_size=32, residual=8)),
             "quant2": each(quant=Quant(bits=2, group_size=32, residual=8)),
             "quant8": each(eviction=MEAN, quant=Quant(bits=8, group_size=32, residual=4)),
             "repeat": each(eviction=REPEAT)}                   # per query head: coded rows with head bits
    rng = random.Random(3)
    prompts = {name: Prompt([rng.randint(100, 40000) for _ in range(rng.randint(80, 120))], []) for name in plans}
    solo = {name: Runner(tiny_model, torch.float16, prefill_chunk=32).run(prompts[name], plan, Sampling(40))
            for name, plan in plans.items()}

    calls: list[int] = []                                # streams of every paged call
    real, fused = model_runner.paged_decode, model_runner.fused_layers.decode_layers

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    def counted_steps(*args):                            # a decode step's layers in one call: [L, G, …] tables
        calls.append(args[11][0].shape[1])
        return fused(*args)
    monkeypatch.setattr(model_runner, "paged_decode", counted)
    monkeypatch.setattr(model_runner.fused_layers, "decode_layers", counted_steps)
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), max_batched_tokens=1024, prefill_chunk=32)
    seqs = {name: engine.sequence(prompts[name], plan, Sampling(40)) for name, plan in plans.items()}
    for seq in seqs.values():
        engine.add(seq)
    engine.run_all()
    for name, seq in seqs.items():
        assert seq.generated == solo[name].token_ids, name
        assert seq.cache.layer_bytes() == solo[name].layers, name
    assert max(calls) == 7 * hk                          # seven jobs, every form, one call
    assert engine.runner.pool.bytes_in_use == 0          # every page back once they ended
    quant = seqs["quant2"].cache.layer_bytes()
    assert all(x.kind == "quant" and x.kv_bytes < x.full_kv_bytes for x in quant)
    assert all(solo[n].layers for n in ("quant2", "quant4", "quant8"))


def test_decode_steps_through_the_layers_in_one_call_give_the_loops_logits_bit_for_bit(tiny_model):
    """Every form at once, decoding together: a decode step's layers in one C++ call
    (`kernels.decode_layers`) against the Python loop over the same ops (KVPLAN_DECODE_LAYERS=false)."""
    import dataclasses
    m = tiny_model.num_layers

    def each(**parts):
        return CompressionPlan("p", "t", tuple(LayerPlan(i, **parts) for i in range(m)))
    plans = [full_plan(m, "f"), each(eviction=MEAN, quant=Quant(bits=4, group_size=32, residual=8)),
             each(quant=Quant(bits=8, group_size=32, residual=4)), each(eviction=REPEAT)]
    rng = random.Random(5)
    prompts = [Prompt([rng.randint(100, 40000) for _ in range(rng.randint(60, 140))], []) for _ in plans]
    runs = {}
    for on in (True, False):
        engine = LLMEngine(dataclasses.replace(tiny_model, decode_layers=on), torch.float16, KVBudget(1 << 40),
                           max_batched_tokens=1024, prefill_chunk=32)
        seqs = [engine.sequence(p, plan, Sampling(24, ignore_eos=True)) for p, plan in zip(prompts, plans)]
        for seq in seqs:
            seq.step_logits = []
            engine.add(seq)
        engine.run_all()
        runs[on] = seqs
        assert (engine.runner.weights is not None) == (on and model_runner.cpu_extension.module() is not None)
    for a, b in zip(runs[True], runs[False]):
        assert a.generated == b.generated
        assert torch.equal(torch.stack(a.step_logits), torch.stack(b.step_logits))


def test_the_runners_decoder_gives_the_models_logits(tiny_model):
    ids = list(range(100, 160))
    runner = Runner(tiny_model, torch.float16, prefill_chunk=64)
    cache = runner.new_cache(full_plan(tiny_model.num_layers, "f"))
    ours = runner.forward(ids, 0, cache, Phase.CONTEXT, keep=len(ids))                 # [T, V]
    cache.close()
    with torch.inference_mode():
        ref = tiny_model.model(input_ids=torch.tensor([ids])).logits[0]                  # plain transformers
    assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-3), (ours - ref).abs().max()
