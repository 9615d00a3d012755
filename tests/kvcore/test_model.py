"""Model loading in the compute dtype and the engine over it in bf16 — the dtype `auto` picks on a CPU
with AVX512-BF16 or AMX (kvcore.host) — with the real model: weights bf16 and packed, the KV pool
still fp16, and the answers right (greedy bf16 tokens need not equal fp32's; the facts must be there),
uncompressed and under auto's compression at 0.5 (at 0.2 this 250-token prompt loses the facts in
fp32 and in bf16 alike: that is the plan's doing, not the dtype's)."""
import dataclasses

import pytest
import torch

from executor import prompt as prompts
from executor.engine import Sampling
from executor.runner import Runner
from kvcore import model as models
from kvcore import packed_linear
from kvcore.packed_linear import FusedLinear, PackedLinear
from planner.probe import Prober
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not packed_linear.packs_bf16(),
                                 reason="oneDNN packs no bf16 on this CPU (AVX2 only): auto computes in fp32 here")]

FACTS = ("The lighthouse on Corvo island was built in 1911 and its lamp was first lit by Maria Sousa. "
         "The ferry to Flores leaves at 08:30 on weekdays and carries at most 140 passengers. "
         "The island's only bakery, run by the Mendes family, sells sweet bread shaped like a seagull. ")
ASK = {"When does the ferry leave?": "08:30", "Who runs the bakery?": "Mendes",      # what fp32 answers right
       "What is the capital of France?": "Paris"}


@pytest.fixture(scope="module")
def bf16_model(model_cfg, real_model_dir):
    return models.load(dataclasses.replace(model_cfg, compute_dtype="bfloat16"))


def test_a_bf16_load_is_bf16_packed_and_stores_fp16_kv(bf16_model):
    lm = bf16_model
    assert lm.model.dtype == torch.bfloat16
    assert sum(type(m) is PackedLinear for m in lm.model.modules()) == 2 * lm.num_layers + 1     # o, down; the head
    assert sum(type(m) is FusedLinear for m in lm.model.modules()) == 2 * lm.num_layers         # qkv, gate_up
    runner = Runner(lm, torch.float16)
    assert runner.engine.runner.pool.arena.dtype == torch.uint8
    assert runner.engine.runner.layout.itemsize == 2                    # fp16 rows in the pool whatever computes


@pytest.mark.parametrize("strategy, ratio, missed", [("full", 1.0, 0), ("auto", 0.5, 1)])
def test_bf16_answers_the_facts(bf16_model, strategy, ratio, missed):
    """bf16 answers what fp32 answers right: every fact under full; under auto within one case of
    fp32 (issue 39's bar: bf16's products round otherwise on each host — AMX tiles, AVX512-BF16 —
    and one borderline answer of a compressed cache may turn; on an AMX Xeon auto at 0.5 misses
    the ferry's hour in bf16)."""
    lm = bf16_model
    runner = Runner(lm, torch.float16)
    shape = ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim)
    prober = Prober(lm=lm)
    wrong = []
    for question, answer in ASK.items():
        p = prompts.build(lm.tokenizer, [{"role": "user", "content": FACTS * 4 + "\n\n" + question}], "")
        ids = list(p.context_ids)
        plan = STRATEGIES[strategy].plan(PlanInput("t", strategy, len(ids), shape, reserve_ratio=ratio, new_tokens=16,
                                                   probe=lambda ids=ids, **kw: prober.probe(ids, **kw)), "t")
        res = runner.run(p, plan, Sampling(16), budget=ratio)
        if answer not in res.text:
            wrong.append((question, res.text))
    assert len(wrong) <= missed, (strategy, wrong)
