"""A codebook layer's candidates: the bytes a `Candidate` states for each rank k are the bytes the
group it stores at that k really holds, coded or dense, and the rows are the tokens kept."""
import torch

from executor.layers.candidate import Candidate, CodedPart, first_rank
from executor.layers.groups import CodedRows, DenseGroup
from kernels import build_codebook


def _clustered(n: int, d: int, directions: int, gen) -> torch.Tensor:
    dirs = torch.nn.functional.normalize(torch.randn(directions, d, generator=gen), dim=-1)
    return dirs[torch.randint(directions, (n,), generator=gen)] * (1 + torch.rand(n, 1, generator=gen))   # [n, D]


def test_stated_bytes_are_the_stored_groups_bytes_at_every_rank():
    gen = torch.Generator().manual_seed(3)
    u, d, dtype = 60, 16, torch.float16
    k, v = _clustered(u, d, 5, gen), torch.randn(u, d, generator=gen)
    pos = torch.arange(u)
    min_rank = torch.cat([torch.full((6,), -1), torch.randperm(u - 6, generator=gen)])     # 6 always kept
    codes = build_codebook(k, 0.95, None)
    parts = {"k": CodedPart("k", 0.95, 4, codes, first_rank(codes[1], min_rank)), "v": CodedPart("v", 0.95, 0, None)}
    cand = Candidate(pos, k, v, torch.ones(u), min_rank, parts, dtype.itemsize)
    for k_star in (0, 1, 7, 30, u - 6):
        ks = torch.tensor([k_star])
        sel = cand.kept(k_star)
        assert int(cand.rows(ks)[0]) == int(sel.sum()) == 6 + k_star
        coded = CodedRows(codes[0], codes[1][sel], codes[2][sel], 0.95, dtype)
        held_k = sum(t.nbytes for t in coded.tensors()) + 4 * int(sel.sum())                 # + int32 positions
        dense = DenseGroup(k[sel], v[sel], pos[sel], dtype)
        assert int(cand.part_bytes("k", ks, coded=False)[0]) == dense.k.nbytes
        assert int(cand.part_bytes("k", ks, coded=True)[0]) == min(held_k, dense.k.nbytes)
        assert int(cand.part_bytes("v", ks, coded=True)[0]) == dense.v.nbytes                 # never codable
        assert int(cand.bytes(ks, ())[0]) == sum(t.nbytes for t in dense.tensors())
        assert cand.coded_parts(k_star, ("k", "v")) == (("k",) if held_k < dense.k.nbytes else ())
    assert cand.coded_parts(u - 6, ("k", "v")) == ("k",)                                    # 5 directions: codes pay


def test_first_rank_counts_only_the_entries_some_row_points_at():
    index, rank = torch.tensor([3, 0, 3, 5]), torch.tensor([4, 2, 1, 9])
    assert first_rank(index, rank).tolist() == [1, 2, 9]                                      # entries 0, 3, 5
