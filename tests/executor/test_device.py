"""Every tensor a job's cache creates is on the model's device: the job is driven through the
model with torch's default device set to `meta`, so a tensor made without naming its device
lands on `meta` and the job fails or leaves it in the cache (on CPU; on CUDA, the same job leaves
no tensor off the GPU)."""
import pytest
import torch

from cachestore.handle import LocalHandle
from executor import attention
from executor.cache import PlannedCache
from executor.engine.sequence import prefill_parts
from executor.layers.base import Phase
from executor.prompt import Prompt
from tests.executor.engine.test_llm_engine import _plans     # a plan of every layer kind

PROMPT = Prompt(list(range(500, 611)), list(range(700, 706)))
NEW = 6


def _job(lm, plan, dtype: torch.dtype) -> PlannedCache:
    """One job's prefill (context chunks, compression, question) and NEW decode steps, as the
    engine runs them (offload plans: a pre-decoding step, then speculative pairs)."""
    device = lm.device
    lm.model.set_attn_implementation(attention.register())       # as the engine's model runner does
    rotary = lm.model.model.rotary_emb
    cache = PlannedCache(plan, lm.num_layers, lm.num_kv_heads, lm.head_dim, dtype, lm.num_query_heads,
                         (rotary.inv_freq.float(), float(rotary.attention_scaling)),
                         LocalHandle() if plan.offload.enabled else None)
    cache.state.context_tokens = len(PROMPT.context_ids)

    def forward(ids, start, phase, step=None):                   # -> logits [len(ids), V]
        with cache.state.running(phase, step), attention.using(cache):
            out = lm.model(input_ids=torch.tensor([ids], device=device),
                           position_ids=torch.arange(start, start + len(ids), device=device)[None],
                           past_key_values=cache, use_cache=True)
        return out.logits[0]

    for part in prefill_parts(PROMPT, 32, cache.max_window):
        logits = forward(list(part.ids), part.start, part.phase)
    tok, pos, guess = int(logits[-1].argmax()), PROMPT.num_tokens, None
    for step in range(NEW):
        if not plan.offload.enabled:
            tok = int(forward([tok], pos, Phase.AFTER)[-1].argmax())
        else:
            if guess is None:
                guess = int(forward([tok], pos, Phase.PREDECODE, 0)[-1].argmax())
            logits = forward([tok, guess], pos, Phase.SPEC, step + 1)
            tok, guess = int(logits[0].argmax()), int(logits[1].argmax())
        pos += 1
    return cache


@pytest.mark.parametrize("name", list(_plans(2)))
@torch.inference_mode()
def test_every_tensor_a_job_creates_is_on_the_models_device(tiny_model, name):
    device = tiny_model.device
    with torch.device("meta"):                     # a tensor made without its device lands here
        cache = _job(tiny_model, _plans(tiny_model.num_layers)[name], torch.float16)
    held = [t for layer in cache.layers for t in layer.tensors()]
    assert held and {t.device for t in held} == {device}
    assert cache.kv_bytes() > 0
