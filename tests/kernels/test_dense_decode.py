"""The fused fp16 decode attention kernel against its torch reference: row counts around the
split-K block, head dims, 1-3 query heads per KV head, rows that are a view of larger storage;
the same result whatever the thread count; bad shapes named; and a full cache layer's decode row
through the kernel against the same layer converting its rows."""
import pytest
import torch

from kernels import dense_decode as dd


def _built():
    if not dd.handles(torch.empty(1, dtype=torch.float16)):
        pytest.skip("the kernel could not be built here (no C++ compiler): the reference serves")


def _inputs(g: int, h: int, t: int, d: int, seed: int, spare: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(g, h, d, generator=gen)
    k = (torch.randn(g, t + spare, d, generator=gen) * 2).half()[:, :t]       # a view of the used rows
    v = torch.randn(g, t + spare, d, generator=gen).half()[:, :t]
    return q, k, v


@pytest.mark.parametrize("g, h, t, d", [(3, 3, 1, 64), (3, 3, 255, 64), (3, 3, 256, 64), (3, 3, 257, 64),
                                        (3, 3, 2000, 64), (1, 1, 40, 32), (2, 2, 700, 48), (4, 1, 513, 128)])
def test_the_kernel_matches_its_reference(g, h, t, d):
    _built()
    q, k, v = _inputs(g, h, t, d, seed=t + d, spare=37)
    got = dd.dense_decode(q, k, v, d ** -0.5)
    want = dd.dense_decode_reference(q, k, v, d ** -0.5)
    assert got.shape == (g, h, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_the_result_does_not_depend_on_the_thread_count():
    _built()
    q, k, v = _inputs(3, 3, 1500, 64, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dd.dense_decode(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = dd.dense_decode(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_shapes_are_named():
    q, k, v = _inputs(3, 3, 10, 64, seed=1)
    with pytest.raises(ValueError, match="q must be"):
        dd.dense_decode(q[0], k, v, 0.125)
    with pytest.raises(ValueError, match="k, v"):
        dd.dense_decode(q, k, v[:, :5], 0.125)


def test_fp32_rows_and_a_disabled_kernel_take_the_reference():
    q, k, v = _inputs(3, 3, 300, 64, seed=2)
    want = dd.dense_decode_reference(q, k, v, 0.125)
    assert torch.equal(dd.dense_decode(q, k.float(), v.float(), 0.125), want)
    dd.ENABLED = False
    try:
        assert torch.equal(dd.dense_decode(q, k, v, 0.125), want)
    finally:
        dd.ENABLED = True


def test_groups_of_different_lengths_with_masks_match_the_reference_and_their_own_calls():
    """Many groups in one call (a layer of every sequence in a step): each group's rows and mask
    its own, each result the reference's and bit for bit what a call of that group alone gives."""
    _built()
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 255, 256, 700, 3000, 40]
    q = torch.randn(len(lengths), 3, 64, generator=gen)
    ks = [(torch.randn(t + 5, 64, generator=gen) * 2).half()[:t] for t in lengths]     # views of larger storage
    vs = [torch.randn(t, 64, generator=gen).half() for t in lengths]
    masks = [torch.rand(3, t, generator=gen) > 0.4 for t in lengths]
    for m in masks:
        m[:, 0] = True                                                     # every head sees a row
    masks[2] = None                                                        # a group that sees every row
    got = dd.dense_decode_groups(q, ks, vs, masks, 0.125)
    for i, (k, v, m) in enumerate(zip(ks, vs, masks)):
        want = dd.dense_decode_reference(q[i:i + 1], k[None], v[None], 0.125, None if m is None else m[None])[0]
        torch.testing.assert_close(got[i], want, atol=2e-5, rtol=1e-4)
        alone = dd.dense_decode_groups(q[i:i + 1], [k], [v], None if m is None else [m], 0.125)[0]
        assert torch.equal(got[i], alone), i
    with pytest.raises(ValueError, match="group 1: mask"):
        dd.dense_decode_groups(q[:2], ks[:2], vs[:2], [None, torch.ones(3, 7, dtype=torch.bool)], 0.125)
