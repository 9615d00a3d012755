"""The cost model against what the cache holds: for every layer kind, at fp16 and fp32 storage,
a job run step by step through the engine (context chunks, its question, then decode) never holds
more than `kvcore.plan_cost.plan_bytes` says after its context, and holds exactly that where the
form does not depend on the data (full, mean-mode eviction, quant); each layer's own bound
(`SeqCache.layer_bounds`: the pool's blocks, `kvcore.blocks`; a cache layer's `bytes_bound`,
`kvcore.cost`) holds at every later step, and is met exactly by those forms."""
import pytest
import torch

from executor.engine import KVBudget, LLMEngine, Sampling
from executor.prompt import Prompt
from kvcore import plan_cost
from kvcore.blocks import BLOCK_ROWS
from kvcore.plan import CompressionPlan
from tests.executor.engine.test_llm_engine import _plans     # a plan of every layer kind

EXACT = {"full", "snapkv-mean", "h2o", "quant"}           # bytes fixed by the plan, not by the data
CHUNK, NEW = 32, 12
PROMPT = Prompt(list(range(500, 611)), list(range(700, 706)))      # 111 context tokens, a 6-token question


def _steps(lm, plan: CompressionPlan, dtype: torch.dtype):
    """Run one job a step at a time -> (its predicted bytes, [(held bytes, each layer's bound of the
    rest of the job)] after every step once its context is compressed)."""
    engine = LLMEngine(lm, dtype, KVBudget(1 << 40), max_batched_tokens=CHUNK, prefill_chunk=CHUNK)
    sampling = Sampling(NEW, ignore_eos=True)
    seq = engine.sequence(PROMPT, plan, sampling)
    engine.add(seq)
    context, question = len(PROMPT.context_ids), len(PROMPT.question_ids)
    seen = []
    while engine.has_work():
        engine.step()
        if seq.done_tokens < context:
            continue
        fed = seq.done_tokens + max(0, len(seq.generated) - 1)                 # rows the cache holds
        rest = [min(CHUNK, context + question - a) for a in range(fed, context + question, CHUNK)]
        rest += [1] * (context + question + NEW - 1 - max(fed, context + question))
        seen.append((seq.kv_bytes(), seq.cache.layer_bounds(rest), [x.kv_bytes for x in seq.cache.layer_bytes()]))
    predicted = plan_cost.plan_bytes(seq.plan, lm.num_kv_heads, lm.num_query_heads, lm.head_dim, context, question,
                                     NEW, dtype.itemsize, CHUNK)
    return predicted, seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", list(_plans(2)))
@torch.inference_mode()
def test_the_cost_model_is_what_the_tensors_hold_at_every_step(tiny_model, name, dtype):
    predicted, seen = _steps(tiny_model, _plans(tiny_model.num_layers)[name], dtype)
    assert len(seen) >= NEW                                   # the question's step and every decode step
    held = [h for h, _, _ in seen]
    assert max(held) <= predicted
    if name in EXACT:
        assert max(held) == predicted
    for i, (_, bounds, _) in enumerate(seen):                 # a layer's bound holds for the rest of the job
        later = [per_layer for _, _, per_layer in seen[i:]]
        for j, bound in enumerate(bounds):
            assert max(x[j] for x in later) <= bound
            if name in EXACT:
                assert max(x[j] for x in later) == bound
    if name == "full":                                        # the dense rows in the storage dtype, in whole pool blocks
        assert predicted == -(-(111 + 6 + NEW - 1) // BLOCK_ROWS) * BLOCK_ROWS \
            * tiny_model.num_layers * tiny_model.num_kv_heads * 2 * tiny_model.head_dim * dtype.itemsize
