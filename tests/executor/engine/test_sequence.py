"""A sequence's stop sequences and log-probabilities, through the engine (the tiny model): the
text ends just before the first stop sequence generated (finish_reason "stop"), the streamed
deltas never show text the stop takes back, and each token comes with its log-probability and
top tokens when asked."""
import torch

from executor.engine import Sampling
from executor.prompt import Prompt
from executor.runner import Runner
from kvcore.plan import full_plan

PROMPT = Prompt(list(range(300, 340)), [])


def _run(tiny_model, sampling: Sampling):
    events = []
    run = Runner(tiny_model, torch.float32).run(PROMPT, full_plan(tiny_model.num_layers, "t"), sampling,
                                               emit=lambda kind, x: events.append(x) if kind == "delta" else None)
    return run, events


def test_a_stop_sequence_ends_the_text_before_it_and_is_never_streamed(tiny_model):
    free, events = _run(tiny_model, Sampling(30, ignore_eos=True))
    text = "".join(x[0] for x in events)                     # the text as it was detokenized, token by token
    assert len(text) > 12
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    stopped, events = _run(tiny_model, Sampling(30, ignore_eos=True, stop=("never in it \x00", stop)))
    assert stopped.finish_reason == "stop" and stopped.text == text[:cut]
    assert "".join(x[0] for x in events) == text[:cut]         # nothing past the cut was ever streamed
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < 30


def test_text_that_could_begin_a_stop_sequence_is_held_back_until_it_cannot(tiny_model):
    free, events = _run(tiny_model, Sampling(12, ignore_eos=True))
    text = "".join(x[0] for x in events)
    never = "\x00" * 5                                       # never generated: 4 characters held back at a time
    held, events = _run(tiny_model, Sampling(12, ignore_eos=True, stop=(never,)))
    streamed = "".join(x[0] for x in events)
    assert held.finish_reason == "length" and held.text == free.text
    assert streamed == text[:max(0, len(text) - 4)]           # the rest comes with the result's text


def test_each_token_has_its_logprob_and_top_tokens_when_asked(tiny_model):
    run, events = _run(tiny_model, Sampling(8, ignore_eos=True, logprobs=3))
    lps = [lp for x in events for lp in x[2]]
    assert [len(x[1]) for x in events] == [1] * 8 and len(lps) == 8
    for tok, (lp, ids, vals) in zip(run.token_ids, lps):
        assert ids[0] == tok and abs(vals[0] - lp) < 1e-6 and len(ids) == 3 and lp <= 0     # greedy: the top one
        assert vals == sorted(vals, reverse=True)
    _, plain = _run(tiny_model, Sampling(8, ignore_eos=True))
    assert all(x[2] == [] for x in plain)
