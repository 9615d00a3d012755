"""New rows into many groups' fp16 tails: the kernel writes what its torch reference writes (fp32
and fp16 rows, strided views, rounding of large and tiny values), in place where a tail has room
and into a tail grown by a chunk (never past the limit) where it has not, touches no other row,
and refuses rows past the limit before writing anything."""
import pytest
import torch

from kernels import cpu_extension
from kernels.tail_append import append_tails, append_tails_reference


def _built():
    if cpu_extension.module() is None:
        pytest.skip("the kernels could not be built here (no C++ compiler): the reference serves")


def _tails(caps, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(c, d, generator=gen).half() for c in caps], [torch.randn(c, d, generator=gen).half() for c in caps]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 2])
def test_the_kernel_writes_what_the_reference_writes(dtype, t):
    _built()
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(1, 4, t, 64, generator=gen) * torch.tensor([1e-6, 1.0, 7e4, 1.0]).view(1, 4, 1, 1)).to(dtype)
    v = torch.randn(1, 64, t, 4, generator=gen).to(dtype).permute(0, 3, 2, 1)          # strided [1, 4, t, 64]
    at, caps = [0, 5, 6, 8], [8, 8, 16, 8]          # group 3 is full: it grows to a chunk past its rows
    kts, vts = _tails(caps, 64, seed=2)
    before_k, before_v = [x.clone() for x in kts], [x.clone() for x in vts]
    got_k, got_v = append_tails(k[0], v[0], kts, vts, at, chunk=8, limit=31)
    want_k, want_v = append_tails_reference(k[0], v[0], [x.clone() for x in before_k], [x.clone() for x in before_v],
                                            at, chunk=8, limit=31)
    for g, a in enumerate(at):
        assert got_k[g].shape[0] == want_k[g].shape[0] == (16 if g == 3 else caps[g])
        for got, want, before, x in ((got_k[g], want_k[g], before_k[g], k[0, g]), (got_v[g], want_v[g], before_v[g], v[0, g])):
            assert torch.equal(_bits(got[:a + t]), _bits(want[:a + t]))       # bit for bit, inf included
            assert torch.equal(_bits(got[:a]), _bits(before[:a]))             # the used rows kept
            assert torch.equal(got[a:a + t], x.half())
            if g < 3:
                assert torch.equal(_bits(got[a + t:]), _bits(before[a + t:]))  # in place: the rest untouched
    assert got_k[0] is kts[0] and got_k[3] is not kts[3]                      # in place where there was room


def test_a_tail_grows_at_most_to_its_limit_and_past_it_nothing_is_written():
    _built()
    k = torch.randn(2, 2, 16)
    kts, vts = _tails([8, 8], 16, seed=3)
    got_k, _ = append_tails(k, k, kts, vts, [8, 0], chunk=8, limit=12)
    assert [t.shape[0] for t in got_k] == [12, 8]                               # 10 rows -> a chunk, capped at 12
    kts, vts = _tails([12, 8], 16, seed=4)
    before = [x.clone() for x in kts + vts]
    with pytest.raises(RuntimeError, match="group 0: rows 11..13 past its tail's limit of 12"):
        append_tails(k, k, kts, vts, [11, 0], chunk=8, limit=12)
    assert all(torch.equal(a, b) for a, b in zip(kts + vts, before))
    with pytest.raises(ValueError, match="group 0"):
        append_tails_reference(k, k, kts, vts, [11, 0], chunk=8, limit=12)
    assert all(torch.equal(a, b) for a, b in zip(kts + vts, before))
