"""The codebook press's candidates: the bytes a `Candidate` states for each rank k are the bytes the
pool's coded form of the tokens kept at k takes (an entry per codebook entry needed or per row of
an exact part, and every row's fields), and the rows are the tokens kept."""
import torch

from executor.presses.candidate import META_BYTES, Candidate, CodedPart, first_rank
from kernels import build_codebook


def _clustered(n: int, d: int, directions: int, gen) -> torch.Tensor:
    dirs = torch.nn.functional.normalize(torch.randn(directions, d, generator=gen), dim=-1)
    return dirs[torch.randint(directions, (n,), generator=gen)] * (1 + torch.rand(n, 1, generator=gen))   # [n, D]


def test_stated_bytes_are_the_coded_forms_bytes_at_every_rank():
    gen = torch.Generator().manual_seed(3)
    u, d, itemsize = 60, 16, 2
    k, v = _clustered(u, d, 5, gen), torch.randn(u, d, generator=gen)
    pos = torch.arange(u)
    min_rank = torch.cat([torch.full((6,), -1), torch.randperm(u - 6, generator=gen)])     # 6 always kept
    codes = build_codebook(k, 0.95, None)
    parts = {"k": CodedPart("k", 0.95, 4, codes, first_rank(codes[1], min_rank)), "v": CodedPart("v", 0.95, 0, None)}
    cand = Candidate(pos, k, v, torch.ones(u), min_rank, parts, itemsize)
    row = d * itemsize
    for k_star in (0, 1, 7, 30, u - 6):
        ks = torch.tensor([k_star])
        sel = cand.kept(k_star)
        rows = int(sel.sum())
        assert int(cand.rows(ks)[0]) == rows == 6 + k_star
        entries = len(torch.unique(codes[1][sel]))                       # the K entries the kept rows point at
        coded = min(entries, rows) * row + rows * row + META_BYTES * rows  # K: the smaller form; V exact
        assert int(cand.bytes(ks, ("k", "v"))[0]) == coded
        assert int(cand.bytes(ks, ())[0]) == 2 * rows * row + META_BYTES * rows
        assert cand.coded_parts(k_star, ("k", "v")) == (("k",) if entries < rows else ())
    assert cand.coded_parts(u - 6, ("k", "v")) == ("k",)                                    # 5 directions: codes pay


def test_first_rank_counts_only_the_entries_some_row_points_at():
    index, rank = torch.tensor([3, 0, 3, 5]), torch.tensor([4, 2, 1, 9])
    assert first_rank(index, rank).tolist() == [1, 2, 9]                                      # entries 0, 3, 5
