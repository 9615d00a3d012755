"""Per-layer budgets: the uniform split and SpindleKV's corrected linear pyramid (spec §2.5, §3.3)."""
import numpy as np
import pytest

from planner.allocation import (ALLOCATIONS, BETA, context_ratio, pyramid_keep_counts, pyramid_ratios, uniform,
                                uniform_keep_counts)

ALPHA = (1 + BETA) / 2


def test_worked_example_of_spec_3_3():
    m, l, l_w, r = 30, 4096, 32, 0.40
    assert context_ratio(r, l, l_w) == pytest.approx(0.395276, abs=1e-6)
    rc = pyramid_ratios(r, l, l_w, m)
    assert rc.shape == (m,)
    assert rc[0] == pytest.approx(0.740551, abs=1e-6) and rc[-1] == pytest.approx(0.05, abs=1e-12)
    assert np.diff(rc) == pytest.approx(np.full(m - 1, -0.023812), abs=1e-6)
    k = pyramid_keep_counts(r, l, l_w, m)
    table = {0: 3009, 1: 2912, 5: 2525, 10: 2041, 14: 1654, 15: 1558, 20: 1074, 25: 590, 29: 203}
    assert {lam: int(k[lam]) for lam in table} == table
    assert k.mean() == pytest.approx(1605.9, abs=0.05)
    assert (k + l_w).mean() == pytest.approx(1637.9, abs=0.05)
    assert (k + l_w).mean() / l == pytest.approx(0.39988, abs=1e-5)


def _r_for(rc, l=1000, l_w=0):
    return (rc * (l - l_w) + l_w) / l


@pytest.mark.parametrize("rc, ends", [(0.8, (1.0, 0.6)), (1.0, (1.0, 1.0)), (0.6, (1.0, 0.2)),
                                      (0.3, (0.55, 0.05)), (0.5, (0.95, 0.05))])
def test_end_points_with_the_corrected_alpha_branch(rc, ends):
    got = pyramid_ratios(_r_for(rc), 1000, 0, 30)
    assert (got[0], got[-1]) == pytest.approx(ends, abs=1e-12)


def test_continuous_at_alpha():
    below = pyramid_ratios(_r_for(ALPHA - 1e-9), 1000, 0, 30)
    above = pyramid_ratios(_r_for(ALPHA + 1e-9), 1000, 0, 30)
    assert below == pytest.approx(above, abs=1e-8)
    assert (below[0], below[-1]) == pytest.approx((1.0, BETA), abs=1e-8)


@pytest.mark.parametrize("rc", [0.01, 0.05, 0.06, 0.2, 0.395, ALPHA, 0.53, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("m", [1, 2, 7, 30])
def test_layer_average_is_the_context_ratio(rc, m):
    l, l_w = 4096, 32
    r = _r_for(rc, l, l_w)
    ratios = pyramid_ratios(r, l, l_w, m)
    assert ratios.mean() == pytest.approx(rc, abs=1e-12)
    assert np.all(np.diff(ratios) <= 1e-15) and np.all((0 <= ratios) & (ratios <= 1))
    k = pyramid_keep_counts(r, l, l_w, m)
    assert k.dtype == np.int64 and np.all((0 <= k) & (k <= l - l_w))
    assert rc * (l - l_w) - 1 < k.mean() <= rc * (l - l_w) + 1e-9   # flooring loses < 1 token per layer


def test_flat_schedule_at_or_below_beta():
    assert pyramid_ratios(_r_for(0.03), 1000, 0, 30) == pytest.approx(np.full(30, 0.03))
    assert pyramid_ratios(_r_for(BETA), 1000, 0, 30) == pytest.approx(np.full(30, BETA))
    # a budget below the window: no context at all, the window alone is kept
    assert np.all(pyramid_ratios(0.005, 4096, 32, 30) == 0) and np.all(pyramid_keep_counts(0.005, 4096, 32, 30) == 0)


def test_budget_over_the_prompt_keeps_everything():
    assert np.all(pyramid_ratios(1.5, 4096, 32, 30) == 1.0)
    assert np.all(pyramid_keep_counts(1.0, 4096, 32, 30) == 4064)


@pytest.mark.parametrize("l", [0, 1, 20, 32])
def test_prompts_no_longer_than_the_window_keep_everything(l):
    assert context_ratio(0.3, l, 32) == 1.0
    for alloc in ALLOCATIONS.values():
        assert np.all(alloc(0.3, l, 32, 30) == 0)   # no context; the window is the whole prompt


def test_uniform_split():
    assert uniform(10, 3).tolist() == [4, 3, 3]
    assert uniform(90, 30).tolist() == [3] * 30
    assert uniform(0, 5).tolist() == [0] * 5
    assert int(uniform(1234, 30).sum()) == 1234
    with pytest.raises(ValueError):
        uniform(5, 0)


def test_uniform_keep_counts():
    assert uniform_keep_counts(0.4, 4096, 32, 30).tolist() == [1606] * 30    # ⌊0.4·4096⌋ − 32
    assert uniform_keep_counts(1638 / 4096, 4096, 32, 30).tolist() == [1606] * 30   # a kv_tokens budget, exactly
    assert uniform_keep_counts(0.001, 4096, 32, 30).tolist() == [0] * 30
    assert uniform_keep_counts(1.0, 4096, 32, 30).tolist() == [4064] * 30
