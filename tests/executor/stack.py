"""For tests that run the real services in process: the embedded stack under some KVPLAN_* env,
and the full-KV bytes of the demo prompt (`kvplan.demo`) that KV budgets are sized in."""
from __future__ import annotations

import contextlib

import pytest

from executor import prompt as prompts
from kvcore import plan_cost
from kvplan.demo import DEMO_CONTEXT, DEMO_QUESTION
from kvplan.embedded import Embedded
from kvcore.plan import full_plan


def demo_full_bytes(lm, new_tokens: int) -> int:
    """The most a full-KV demo job of `new_tokens` holds (fp16, 512-token chunks)."""
    p = prompts.build(lm.tokenizer, [{"role": "user", "content": DEMO_CONTEXT}], DEMO_QUESTION)
    return plan_cost.plan_bytes(full_plan(lm.num_layers, "f"), lm.num_kv_heads, lm.num_query_heads, lm.head_dim,
                                len(p.context_ids), len(p.question_ids), new_tokens, 2, 512)


@contextlib.contextmanager
def embedded_with(model_cfg, env: dict[str, str]):
    """The embedded services with `env` set, the environment restored after."""
    mp = pytest.MonkeyPatch()
    for name, value in env.items():
        mp.setenv(name, value)
    try:
        with Embedded(model_cfg) as e:
            yield e
    finally:
        mp.undo()
