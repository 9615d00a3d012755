"""XKV Algorithm 1: the vectorized top-N equals the paper's greedy loop and brute force on small
inputs; floors, caps, short layers and unreachable R targets."""
import itertools

import numpy as np
import pytest

from planner.xkv import allocate, gains


def _greedy(scores, total=None, r_target=None):
    """The paper's loop (spec §2.6), literally: WAIT holds each layer's next gain, argmax takes the
    first maximum."""
    g = gains(scores)
    L = len(scores)
    caps = [s.shape[-1] for s in scores]
    gain = lambda i, k: g[i, k] if k < caps[i] else 0.0      # noqa: E731
    A, wait, r_total = [0] * L, [gain(i, 0) for i in range(L)], 0.0
    while (total is not None and sum(A) < total) or (r_target is not None and r_total / L < r_target - 1e-12):
        j = int(np.argmax(wait))
        if wait[j] == 0:
            break
        r_total += wait[j]
        A[j] += 1
        wait[j] = gain(j, A[j])
    return np.array(A)


def _brute(scores, total):
    g = gains(scores)
    best = -1.0
    for n in itertools.product(*[range(s.shape[-1] + 1) for s in scores]):
        if sum(n) == total:
            best = max(best, sum(g[i, :k].sum() for i, k in enumerate(n)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_topn_equals_the_greedy_loop_and_brute_force(seed):
    rng = np.random.default_rng(seed)
    scores = [rng.gamma(0.5, size=(2, int(rng.integers(3, 6)))) for _ in range(3)]
    for total in range(0, sum(s.shape[-1] for s in scores) + 1):
        got = allocate(scores, total=total, floor=0)
        assert got.keep.sum() == total
        assert got.keep.tolist() == _greedy(scores, total=total).tolist()
        assert got.retained.sum() == pytest.approx(_brute(scores, total))


def test_worked_example():
    # layer 0 concentrates its mass, layer 1 spreads it: the budget goes where the mass is
    w0 = np.array([[8.0, 1.0, 1.0, 0.0]])
    w1 = np.array([[3.0, 3.0, 2.0, 2.0]])
    a = allocate([w0, w1], total=4, floor=0)
    # gains: layer 0: .8 .1 .1 0; layer 1: .3 .3 .2 .2 -> top 4: .8, .3, .3, .2
    assert a.keep.tolist() == [1, 3]
    assert a.retained.tolist() == pytest.approx([0.8, 0.8])
    assert a.r_avg == pytest.approx(0.8)


def test_r_mode_takes_the_fewest_slots_reaching_the_target():
    rng = np.random.default_rng(9)
    scores = [rng.gamma(0.5, size=(3, 40)) for _ in range(4)]
    for r in (0.3, 0.6, 0.9):
        a = allocate(scores, r_target=r, floor=0)
        assert a.r_avg >= r - 1e-9
        fewer = allocate(scores, total=int(a.keep.sum()) - 1, floor=0)
        assert fewer.r_avg < r
        assert a.keep.tolist() == _greedy(scores, r_target=r).tolist()


def test_floor_caps_short_layers_and_unreachable_targets():
    scores = [np.array([[5.0, 0.0, 0.0]]), np.array([[1.0, 1.0]]), np.zeros((1, 0))]
    a = allocate(scores, total=2, floor=1)
    assert a.keep.tolist() == [1, 1, 0]                     # every layer with tokens gets its floor
    assert allocate(scores, total=100).keep.tolist() == [3, 2, 0]   # capped at each layer's tokens
    # zero-gain slots past a short layer's tokens are never handed out: the total is met elsewhere
    short = [np.array([[1.0]]), np.array([[1.0, 0.0, 0.0]])]
    assert allocate(short, total=3, floor=0).keep.tolist() == [1, 2]
    full = allocate(scores, r_target=1.5)                    # above what all tokens reach: stops
    assert full.keep.tolist() == [3, 2, 0]
    with pytest.raises(ValueError, match="exactly one"):
        allocate(scores)
    with pytest.raises(ValueError, match="non-negative"):
        allocate([np.array([[-1.0]])], total=1)
