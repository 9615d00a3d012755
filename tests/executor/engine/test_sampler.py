"""Sampling a step's rows: greedy is the argmax, a seeded row draws the same tokens again, top-p
keeps only the nucleus, and a row's log-probabilities are the model's own (log-softmax of its
logits, before temperature and top-p), the sampled token's and the top k's."""
import math

import torch

from executor.engine.sampler import generator, logprobs, sample

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9]])          # p = .02, .49, .05, .44 at temperature 1


def _draw(temperature: float, top_p: float, seed: int | None, n: int = 1) -> list[int]:
    gen = generator(seed)
    return [sample(LOGITS, torch.tensor([temperature]), torch.tensor([top_p]), [gen])[0] for _ in range(n)]


def test_greedy_seeded_and_top_p():
    assert sample(LOGITS, torch.tensor([0.0]), torch.tensor([1.0]), [None]) == [1]
    assert _draw(1.0, 1.0, 7, 5) == _draw(1.0, 1.0, 7, 5)
    drawn = set(_draw(1.0, 0.5, 1, 200))           # the nucleus of 0.5: tokens 1 and 3
    assert drawn <= {1, 3} and drawn


def test_logprobs_are_the_models_own_with_the_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    (lp1, ids1, vals1), (lp2, ids2, vals2) = logprobs(logits, [3, 0], 2)
    norm = math.log(sum(math.exp(x) for x in (0.0, 3.0, 1.0, 2.9)))
    assert math.isclose(lp1, 2.9 - norm, rel_tol=1e-5) and ids1 == [1, 3]
    assert math.isclose(vals1[0], 3.0 - norm, rel_tol=1e-5) and vals1[1] == lp1
    assert ids2 == [0, 1] or ids2 == [0, 2] or ids2 == [0, 3]      # ties after the first
    assert math.isclose(lp2, vals2[0]) and lp2 < 0
    assert logprobs(logits, [1, 0], 0) == [(lp, [], []) for lp, _, _ in logprobs(logits, [1, 0], 1)]
