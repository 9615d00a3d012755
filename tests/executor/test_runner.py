"""The runner: chunked prefill is exact, greedy decoding is the model's argmax, cancel stops it."""
import pytest
import torch

from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvcore.plan import full_plan


def test_chunked_prefill_gives_the_same_tokens_as_one_shot(tiny_model):
    prompt = Prompt(list(range(100, 160)), list(range(300, 311)))
    plan = full_plan(tiny_model.num_layers, "t")
    one = Runner(tiny_model, torch.float32, prefill_chunk=1000).run(prompt, plan, Sampling(12))
    events = []
    chunked = Runner(tiny_model, torch.float32, prefill_chunk=7).run(
        prompt, plan, Sampling(12), emit=lambda k, x: events.append((k, x)))
    assert chunked.token_ids == one.token_ids and len(one.token_ids) > 0
    progress = [x for k, x in events if k == "progress"]
    assert progress[-1] == (71, 71) and len(progress) == 9 + 2      # 60 in 7s, then 11 in 7s
    deltas = "".join(x[0] for k, x in events if k == "delta")
    assert deltas == chunked.text


@torch.inference_mode()
def test_greedy_matches_argmax_of_a_plain_forward(tiny_model):
    ids = list(range(200, 230))
    run = Runner(tiny_model, torch.float32).run(Prompt(ids, []), full_plan(tiny_model.num_layers, "t"), Sampling(3))
    seq = list(ids)
    for tok in run.token_ids:
        logits = tiny_model.model(input_ids=torch.tensor([seq])).logits[0, -1]
        assert int(logits.argmax()) == tok
        seq.append(tok)
    assert run.prompt_tokens == 30 and run.layers[0].kept_tokens == 30 + len(run.token_ids) - 1


def test_cancel_stops_decoding(tiny_model):
    calls = {"n": 0}

    def cancelled():
        calls["n"] += 1
        return calls["n"] > 3 + 1      # after prefill (1 chunk) and three decode steps

    run = Runner(tiny_model, torch.float32).run(Prompt(list(range(50, 60)), []), full_plan(2, "t"),
                                                Sampling(200), cancelled=cancelled)
    assert run.finish_reason == "cancelled" and len(run.token_ids) == 4


def _evict_plan(m: int, scorer: str, codebook=None):
    from kvcore.plan import CompressionPlan, Eviction, LayerPlan
    ev = Eviction(keep_tokens=40, window=8, scorer=scorer, gqa_mode="repeat", span_tokens=4)
    return CompressionPlan("p", "test", tuple(LayerPlan(i, eviction=ev, codebook=codebook) for i in range(m)))


def test_a_shared_prefix_gives_the_same_run_as_a_full_prefill(tiny_model):
    """The benches prefill a prompt's leading chunks once and start each plan's run there: the
    tokens, the bytes and the kept tokens must be those of a run that prefilled everything."""
    from kvcore.plan import Codebook
    runner = Runner(tiny_model, torch.float16, prefill_chunk=32)
    prompt = Prompt(list(range(1000, 1100)), list(range(2000, 2005)))
    prefix = runner.prefix_of(prompt, max_window=8)
    assert prefix.tokens == 64 and len(prefix.keys) == tiny_model.num_layers
    for plan in (full_plan(tiny_model.num_layers, "f"), _evict_plan(tiny_model.num_layers, "snapkv"),
                 _evict_plan(tiny_model.num_layers, "snapkv", Codebook(0.6, 0.5))):
        assert prefix.seeds(runner.new_cache(plan), [(0, 32), (32, 64), (64, 100)])
        cold = runner.run(prompt, plan, Sampling(8))
        warm = runner.run(prompt, plan, Sampling(8), prefix=prefix)
        assert warm.token_ids == cold.token_ids and warm.layers == cold.layers
    h2o = _evict_plan(tiny_model.num_layers, "h2o")
    assert not prefix.seeds(runner.new_cache(h2o), [(0, 32), (32, 64), (64, 100)])   # H2O scores the prefix
    assert runner.run(prompt, h2o, Sampling(8), prefix=prefix).token_ids == runner.run(prompt, h2o, Sampling(8)).token_ids


@pytest.mark.parametrize("strategy", ["streaming_llm", "h2o", "snapkv", "pyramidkv", "spindlekv"])
def test_a_plan_told_the_added_rows_holds_its_ratio_to_the_jobs_last_token(tiny_model, strategy):
    """The budget covers what the job adds after its prompt (question, decode rows, spare store
    rows: planner.budget): measured on the tensors at the end, the job is within its ratio; the
    same plan made for the prompt alone is not."""
    from planner.request import ModelShape, PlanInput
    from planner.strategies import STRATEGIES
    lm = tiny_model
    shape = ModelShape(lm.num_layers, lm.num_kv_heads, lm.num_query_heads, lm.head_dim)
    runner = Runner(lm, torch.float16, prefill_chunk=64)
    prompt = Prompt(list(range(1000, 1180)), list(range(2000, 2007)))
    ratios = {}
    for told in (True, False):
        inp = PlanInput("j", strategy, len(prompt.context_ids), shape, reserve_ratio=0.5,
                        suffix_tokens=len(prompt.question_ids) if told else 0, new_tokens=20 if told else 0)
        res = runner.run(prompt, STRATEGIES[strategy].plan(inp, "p"), Sampling(20, seed=0))
        assert sum(x.full_kv_bytes for x in res.layers) == lm.num_layers * lm.num_kv_heads * 2 * lm.head_dim * 2 * (
            prompt.num_tokens + len(res.token_ids) - 1)            # the last token is never fed back
        ratios[told] = sum(x.kv_bytes for x in res.layers) / sum(x.full_kv_bytes for x in res.layers)
    if strategy == "spindlekv":     # priced at an entry a row (the most a codebook holds) in whole pages:
        assert ratios[True] <= 0.5 and ratios[True] <= ratios[False]    # the prompt's plan already holds here
    else:
        assert ratios[True] <= 0.5 < ratios[False]
