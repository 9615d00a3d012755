"""Eviction scoring helpers on small worked examples."""
import torch

from executor import scoring


def test_spread_carries_a_peak_over_the_next_span_tokens():
    s = torch.tensor([[0., 0., 5., 0., 0., 0., 0., 1., 0., 0.],
                      [3., 0., 0., 0., 0., 0., 0., 0., 0., 2.]])
    got = scoring.spread(s, 3)
    assert got.tolist() == [[0., 0., 5., 5., 5., 5., 0., 1., 1., 1.],
                            [3., 3., 3., 3., 0., 0., 0., 0., 0., 2.]]
    assert torch.equal(scoring.spread(s, 0), s)
    assert scoring.spread(torch.zeros(2, 0), 4).shape == (2, 0)


def test_spread_keeps_the_run_after_an_attended_token():
    """Top-4 by raw score splits the run after the peak; with a span of 3 the whole run is kept."""
    s = torch.tensor([[0.1, 0.2, 0.0, 9.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0]])
    plain = scoring.select(s, 10, 4, window=0, sinks=0, heads=1)
    spread = scoring.select(scoring.spread(s, 3), 10, 4, window=0, sinks=0, heads=1)
    assert plain.tolist() == [[0, 1, 3, 7]]
    assert spread.tolist() == [[3, 4, 5, 6]]


def test_pool_is_a_same_length_average():
    s = torch.tensor([[0., 3., 0., 0.]])
    assert torch.allclose(scoring.pool(s, 3), torch.tensor([[1.5, 1.0, 1.0, 0.0]]))
    assert torch.equal(scoring.pool(s, 1), s)
