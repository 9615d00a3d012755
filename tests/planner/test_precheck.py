"""A budget refused before the prefill (planner/precheck.py, issue 41): the plan from the stand-in
of a prompt's statistics refuses what the plan from its real statistics refuses, in the same
words, and holds what it holds; a strategy that compresses nothing on a model (MiniCache where
adjacent layers are unlike) is named as such."""
import dataclasses

import numpy as np
import pytest

from planner import fit, precheck
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES
from tests.planner.fakes import stats

SHAPE = ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64)


def _verdict(strategy: str, inp: PlanInput) -> str:
    """"" when a plan of `inp` holds its budget, else the refusal's words (as the service says them)."""
    s = STRATEGIES[strategy]
    plan = s.plan(inp, "p")
    return "" if fit.usable(plan, inp) else str(fit.refusal(lambda i: s.plan(i, "p"), inp, plan, precheck.note(s, plan)))


def _inputs(strategy: str, tokens: int, ratio: float, new: int, real, prefix):
    base = PlanInput(job_id="j", strategy=strategy, prompt_tokens=tokens, model=SHAPE, reserve_ratio=ratio,
                     new_tokens=new)
    return (dataclasses.replace(base, probe=lambda **kw: real),
            precheck.standin_input(base, lambda **kw: prefix))


@pytest.mark.parametrize("strategy", ["auto", "xkv", "spindlekv+xkv", "snapkv"])
@pytest.mark.parametrize("tokens, ratio, new", [(349, 0.2, 128), (349, 0.39, 128), (2954, 0.2, 128), (250, 0.5, 8),
                                                (280, 0.5, 8),
                                                (2954, 0.05, 128), (2954, 0.02, 24), (120, 0.9, 16)])
def test_the_stand_in_refuses_what_the_real_statistics_refuse_and_says_why_in_the_same_words(strategy, tokens, ratio, new):
    """Before: `auto --ratio 0.2` on a 349-token report was refused only after its prefill."""
    real, prefix = stats(t=tokens, heads=9 if strategy == "auto" else 3), stats(t=128, seed=1,
                                                                                heads=9 if strategy == "auto" else 3)
    at_real, at_standin = _inputs(strategy, tokens, ratio, new, real, prefix)
    early, late = _verdict(strategy, at_standin), _verdict(strategy, at_real)
    assert bool(early) == bool(late)
    assert early.split("; ")[0] == late.split("; ")[0]          # why; what fits may be less (the stand-in is kind)


def test_a_349_token_prompt_at_0_2_is_refused_and_a_long_one_is_not():
    prefix = stats(t=128)
    short, long = (PlanInput(job_id="j", strategy="auto", prompt_tokens=n, model=SHAPE, reserve_ratio=0.2,
                             new_tokens=128, probe=precheck.standin(lambda **kw: prefix, n)) for n in (349, 2954))
    assert "auto cannot hold reserve ratio 0.2 on this job (349 prompt tokens, 128 new tokens)" in _verdict("auto", short)
    assert _verdict("auto", long) == ""


def _layers(angle: float):
    s = stats(t=128, heads=3)
    return dataclasses.replace(s, k_angle=np.full(29, angle, np.float32), v_angle=np.full(29, angle, np.float32))


def test_minicache_on_unlike_layers_compresses_nothing_and_says_so():
    """Before: minicache was refused at every ratio below 1 on SmolLM2 — after a 13 s prefill —
    and `kvplan strategies` listed it without a word."""
    unlike, alike = _layers(0.5), _layers(0.1)             # angles arccos(cos)/π: cos 0 (SmolLM2's), cos 0.95
    mc = STRATEGIES["minicache"]
    assert precheck.cannot_compress(mc, SHAPE, lambda **kw: unlike) == \
        "its plans keep every layer whole; a budget below 1 is refused"
    assert precheck.cannot_compress(mc, SHAPE, lambda **kw: alike) == ""
    inp = PlanInput(job_id="j", strategy="minicache", prompt_tokens=2954, model=SHAPE, reserve_ratio=0.5,
                    new_tokens=128, probe=precheck.standin(lambda **kw: unlike, 2954))
    words = _verdict("minicache", inp)
    assert "minicache cannot hold reserve ratio 0.5" in words and "reserve ratio 1 fits" in words
    assert ("and minicache keeps at least 2954 (no pair of its adjacent layers is alike enough to merge on this "
            "model: minicache compresses nothing here; `kvplan strategies` marks it)") in words
    short = dataclasses.replace(inp, strategy="snapkv", prompt_tokens=37, probe=None)     # too short to evict: no note
    assert "(no pair" not in _verdict("snapkv", short) and _verdict("snapkv", short)


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "minicache"])
def test_every_other_shipped_strategy_compresses_and_full_is_not_marked(name):
    assert precheck.cannot_compress(STRATEGIES[name], SHAPE, lambda **kw: _layers(0.5)) == ""


def test_the_stand_in_has_the_prompts_length_uniform_scores_and_no_losses_unless_asked():
    got = precheck.standin(lambda **kw: stats(t=128), 3000)
    s = got()
    assert s.tokens == 3000 and s.window_scores.shape == (30, 9, 3000) and s.losses is None
    assert np.allclose(s.window_scores.sum(-1), 1.0, atol=1e-4)
    assert got(losses=True).losses.evict.shape == (30, 10)

