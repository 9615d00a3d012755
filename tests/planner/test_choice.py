"""The per-layer option choice against brute force on small knapsacks."""
import itertools

import numpy as np
import pytest

from planner.choice import choose


def _brute(loss, cost, budget):
    best = None
    for combo in itertools.product(range(loss.shape[1]), repeat=loss.shape[0]):
        c = sum(cost[i, o] for i, o in enumerate(combo))
        lo = sum(loss[i, o] for i, o in enumerate(combo))
        if c <= budget + 1e-9 and np.isfinite(lo) and (best is None or lo < best[0] - 1e-12):
            best = (lo, combo)
    return best


def test_worked_example():
    # layer 0 loses a lot when squeezed, layer 1 barely: the bytes go to layer 0
    loss = np.array([[0.0, 0.5, 0.9], [0.0, 0.01, 0.02]])
    cost = np.array([[10.0, 5.0, 2.0], [10.0, 5.0, 2.0]])
    got = choose(loss, cost, 12.0)
    assert got.option.tolist() == [0, 2] and got.bytes == 12.0 and got.loss == pytest.approx(0.02)


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    """Whole-byte costs and a budget the units divide: the DP is exact, whatever the losses."""
    rng = np.random.default_rng(seed)
    m, o = 4, 5
    cost = rng.integers(1, 16, (m, o)).astype(float)
    loss = rng.uniform(0, 1, (m, o))
    loss[rng.uniform(size=(m, o)) < 0.15] = np.inf
    loss[:, 0] = rng.uniform(0, 1, m)                                          # one allowed option each
    budget = float(rng.integers(int(cost.min(1).sum()), int(cost.max(1).sum()) + 1))
    got = choose(loss, cost, budget, resolution=int(budget))                   # 1 byte per unit
    want = _brute(loss, cost, budget)
    assert got.bytes <= budget
    assert got.loss == pytest.approx(want[0])


def test_forbidden_options_and_impossible_budgets():
    loss = np.array([[np.inf, 0.1, 0.5], [0.0, 0.2, 0.4]])
    cost = np.array([[1.0, 5.0, 10.0], [1.0, 5.0, 10.0]])
    got = choose(loss, cost, 6.0)
    assert got.option[0] != 0 and got.bytes <= 6.0
    got = choose(loss, cost, 1.0)                      # nothing fits: the cheapest allowed each
    assert got.option.tolist() == [1, 0]
    with pytest.raises(ValueError, match="alike"):
        choose(loss, cost[:, :2], 1.0)
    with pytest.raises(ValueError, match="allowed"):
        choose(np.full((1, 2), np.inf), np.ones((1, 2)), 1.0)
