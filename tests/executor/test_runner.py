"""The runner: chunked prefill is exact, greedy decoding is the model's argmax, cancel stops it."""
import torch

from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from executor.sampler import Sampler
from kvplan.plan import full_plan


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


def test_sampler_greedy_seeded_and_top_p():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert Sampler(0.0, 1.0, None)(logits) == 1
    a = [Sampler(1.0, 1.0, 7)(logits) for _ in range(5)]
    b = [Sampler(1.0, 1.0, 7)(logits) for _ in range(5)]
    assert a == b
    s = Sampler(1.0, 0.5, 1)      # p = .49, .44, .05, .02: the nucleus of 0.5 is tokens 1 and 3
    drawn = {s(logits) for _ in range(200)}
    assert drawn <= {1, 3} and drawn
