"""Eviction scoring helpers on small worked examples."""
import pytest
import torch

from kvcore import scoring


@pytest.mark.parametrize("spread", [scoring.spread, scoring.spread_reference], ids=["spread", "reference"])
def test_spread_carries_a_peak_over_the_next_span_tokens(spread):
    s = torch.tensor([[0., 0., 5., 0., 0., 0., 0., 1., 0., 0.],
                      [3., 0., 0., 0., 0., 0., 0., 0., 0., 2.]])
    got = spread(s, 3)
    step = scoring.SPAN_TIE_BREAK
    want = torch.tensor([[0., 0., 5., 5 * (1 - step), 5 * (1 - 2 * step), 5 * (1 - 3 * step), 0., 1., 1 - step, 1 - 2 * step],
                         [3., 3 * (1 - step), 3 * (1 - 2 * step), 3 * (1 - 3 * step), 0., 0., 0., 0., 0., 2.]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got[0, 2:6].diff() < 0).all() and (got[0, 7:].diff() < 0).all()         # a run falls off after its peak
    assert torch.equal(spread(s, 0), s)
    assert spread(torch.zeros(2, 0), 4).shape == (2, 0)


@pytest.mark.skipif(scoring._cpu_kernels() is None, reason="no C++ compiler here: the reference runs")
@pytest.mark.parametrize("span", [1, 3, 16])
def test_the_cpu_spread_is_the_reference_bit_for_bit(span):
    gen = torch.Generator().manual_seed(span)
    s = torch.rand(9, 4096, generator=gen)
    s[:, ::7] = 0.5                                                                   # equal peaks in one window
    s[1, 100:140] = float("-inf")                                                     # windows with nothing finite
    s[2, :3] = float("-inf")
    got = scoring._cpu_kernels().copy_span(s, span)
    assert torch.equal(got, scoring.spread_reference(s, span))


def test_spread_keeps_the_run_after_an_attended_token():
    """Top-4 by raw score splits the run after the peak; with a span of 3 the whole run is kept."""
    s = torch.tensor([[0.1, 0.2, 0.0, 9.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0]])
    plain = scoring.select(s, 10, 4, window=0, sinks=0, heads=1)
    spread = scoring.select(scoring.spread(s, 3), 10, 4, window=0, sinks=0, heads=1)
    assert plain.tolist() == [[0, 1, 3, 7]]
    assert spread.tolist() == [[3, 4, 5, 6]]


def test_a_budget_that_ends_inside_a_run_keeps_the_run_s_first_tokens():
    """Without the tie-break the 17 tokens of a run tie and topk keeps any of them; with it a
    cut run keeps a prefix starting at its peak, whatever the run's length or position."""
    gen = torch.Generator().manual_seed(0)
    for t, at, keep in [(300, 40, 5), (2000, 1234, 9), (4096, 7, 16)]:
        s = torch.rand(4, t, generator=gen) * 0.01
        s[:, at] = 1.0
        got = scoring.select(scoring.spread(s, 16), t, keep, window=0, sinks=0, heads=4)
        assert got.tolist() == [list(range(at, at + keep))] * 4


@pytest.mark.parametrize("spread", [scoring.spread, scoring.spread_reference], ids=["spread", "reference"])
def test_spread_leaves_infinite_scores_alone(spread):
    s = torch.tensor([[float("-inf"), 1.0, float("-inf"), float("-inf")]])
    got = spread(s, 1)
    assert got[0, 0] == float("-inf") and got[0, 3] == float("-inf") and not got.isnan().any()


def test_pool_is_a_same_length_average():
    s = torch.tensor([[0., 3., 0., 0.]])
    assert torch.allclose(scoring.pool(s, 3), torch.tensor([[1.5, 1.0, 1.0, 0.0]]))
    assert torch.equal(scoring.pool(s, 1), s)
