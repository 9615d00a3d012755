"""SpindleKV codebook: the tiled incremental greedy against a literal Algorithm 1, its properties,
a worked example, GQA dedup, and the Triton degree kernel (in an
interpreter child process, see `tests.kernels.interp`) against its reference."""
from __future__ import annotations

import math
import sys

import pytest
import torch

import kernels
from kernels import codebook
from kernels._triton import INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err


def clustered(N: int, D: int, seed: int, theta: float = 0.95) -> torch.Tensor:   # [N, D]
    """Overlapping clusters whose pairwise cosines straddle theta, plus a few loners."""
    g = torch.Generator().manual_seed(seed)
    k = max(2, N // 6)
    centres = torch.nn.functional.normalize(torch.randn(k, D, generator=g), dim=1)          # [k, D]
    centres[1::2] = centres[0::2][: k // 2] + 0.3 * math.sqrt(1 - theta) * torch.randn(k // 2, D, generator=g)
    spread = math.sqrt((1 - theta) / D) * (0.4 + 1.2 * torch.rand(k, 1, generator=g))       # [k, 1]
    label = torch.randint(0, k, (N,), generator=g)                                           # [N]
    x = centres[label] + spread[label] * torch.randn(N, D, generator=g)
    return x * (0.5 + 3 * torch.rand(N, 1, generator=g))                                     # varied norms


def literal_algorithm_1(x, theta, weight=None, eps=codebook.DEFAULT_EPS):
    """Algorithm 1 as printed (with sum(G) for sum(S)): full G, mask-and-resum every round."""
    x32 = x.float()
    mag = torch.linalg.vector_norm(x32, dim=1)
    null = mag <= eps
    xn = x32 / mag.clamp_min(eps)[:, None]
    N = x.shape[0]
    G = ((xn @ xn.T) > theta) | torch.eye(N, dtype=torch.bool)          # [N, N]
    G &= ~null[:, None] & ~null[None, :]
    w = torch.ones(N) if weight is None else weight.float()
    ref = torch.full((N,), -1, dtype=torch.long)
    ref[null] = 0
    reps = []
    while G.any():
        s = G.float() @ w                                               # weighted degree incl. self
        i = int(s.argmax())
        eta = G[i].nonzero().squeeze(1)
        ref[eta] = len(reps)
        reps.append(i)
        keep = ~G[i]
        G &= keep[:, None] & keep[None, :]
    C = xn[reps] if reps else torch.eye(1, x.shape[1])
    return C, ref, mag


LITERAL_CASES = {   # name: (N, D, theta, weights, tile, dtype, seed)
    "N200_D16_theta095": (200, 16, 0.95, None, 1024, torch.float32, 1),
    "N200_D16_tile7": (200, 16, 0.95, None, 7, torch.float32, 2),
    "N257_D24_theta098_tile1": (257, 24, 0.98, None, 1, torch.float32, 3),
    "N150_D8_weighted": (150, 8, 0.95, "int", 16, torch.float32, 4),
    "N150_D8_weighted_tile3": (150, 8, 0.9, "int", 3, torch.float32, 5),
    "N300_D64_fp16": (300, 64, 0.95, None, 50, torch.float16, 6),
    "N120_D12_float_weights": (120, 12, 0.95, "float", 10, torch.float32, 7),
    "N90_D16_zero_rows": (90, 16, 0.95, "int", 8, torch.float32, 8),
}


def _literal_inputs(name):
    N, D, theta, weights, tile, dtype, seed = LITERAL_CASES[name]
    x = clustered(N, D, seed, theta)
    g = torch.Generator().manual_seed(seed)
    w = {None: None, "int": torch.randint(1, 5, (N,), generator=g).float(),
         "float": 0.25 + torch.rand(N, generator=g).mul(8).round() / 4}[weights]   # dyadic: exact sums
    if name.endswith("zero_rows"):
        x[[0, 17, 60]] = 0.0
    return x.to(dtype), theta, w, tile


@pytest.mark.parametrize("name", list(LITERAL_CASES))
def test_tiled_incremental_equals_literal(name):
    x, theta, w, tile = _literal_inputs(name)
    C, ref, mag = codebook.build_codebook(x, theta, w, tile=tile)
    C0, ref0, mag0 = literal_algorithm_1(x, theta, w)
    assert 1 < C.shape[0] < x.shape[0] * 0.9, f"degenerate test data: |C| = {C.shape[0]} of {x.shape[0]}"
    assert torch.equal(ref, ref0)
    assert torch.equal(C, C0)
    assert torch.equal(mag, mag0)
    assert C.dtype == mag.dtype == torch.float32 and ref.dtype == torch.int64


@pytest.mark.parametrize("name", list(LITERAL_CASES))
def test_codebook_properties(name):
    x, theta, w, tile = _literal_inputs(name)
    C, ref, mag = kernels.build_codebook(x, theta, w, tile=tile)
    N = x.shape[0]
    x32 = x.float()
    assert torch.equal(mag, torch.linalg.vector_norm(x32, dim=1)), "magnitudes must be exact"
    assert C.shape[0] <= N and bool(((ref >= 0) & (ref < C.shape[0])).all())
    assert torch.allclose(C.norm(dim=1), torch.ones(C.shape[0]), atol=1e-5), "entries are unit rows"
    live = mag > codebook.DEFAULT_EPS
    cos = (torch.nn.functional.normalize(x32, dim=1) * C[ref]).sum(1)                    # [N]
    assert bool((cos[live] > theta - 1e-6).all()), f"worst cosine {cos[live].min().item()} vs theta {theta}"
    err = (C[ref] * mag[:, None] - x32).norm(dim=1)
    assert bool((err <= math.sqrt(2 - 2 * theta) * mag + 1e-5).all()), "relative error bound sqrt(2 - 2 theta)"
    xn = x32 / mag.clamp_min(codebook.DEFAULT_EPS)[:, None]
    for e in range(C.shape[0]):   # every entry is the direction of one of its own members
        assert bool((xn[ref == e] == C[e]).all(1).any()), f"entry {e} is not a member's direction"


def _angles(*deg):   # [len(deg), 2] unit vectors at these angles
    r = torch.tensor(deg, dtype=torch.float64).deg2rad()
    return torch.stack([r.cos(), r.sin()], dim=1).float()


def test_worked_example_two_dimensions():
    # at 0, 10, 20, 90, 95 degrees with theta = cos 15 deg: edges 0-10, 10-20, 90-95
    x = _angles(0, 10, 20, 90, 95) * torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0])[:, None]
    theta = math.cos(math.radians(15))
    C, ref, mag = kernels.build_codebook(x, theta)
    # degrees 2, 3, 2, 2, 2: the 10-degree vector covers the first three; then 90 (first of a tie) the rest
    assert ref.tolist() == [0, 0, 0, 1, 1]
    assert torch.allclose(C, _angles(10, 90), atol=1e-6)
    assert torch.allclose(mag, torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0]))
    # weights 10 on the 95-degree vector: degrees 2, 3, 2, 11, 11 -> 90 first (first max), then 10
    C, ref, _ = kernels.build_codebook(x, theta, torch.tensor([1.0, 1, 1, 1, 10]))
    assert ref.tolist() == [1, 1, 1, 0, 0]
    assert torch.allclose(C, _angles(90, 10), atol=1e-6)


def test_degrees_are_updated_after_each_pick():
    # chain at 0, 10, 20, 30, 40, 50 deg, theta = cos 15: degrees 2, 3, 3, 3, 3, 2. Pick 10 (covers 0-20);
    # then 30 has degree 2 (20 is gone) and 40 has 3 -> the greedy must pick 40, not the stale first max 30
    x = _angles(0, 10, 20, 30, 40, 50)
    C, ref, _ = kernels.build_codebook(x, math.cos(math.radians(15)))
    assert ref.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.allclose(C, _angles(10, 40), atol=1e-6)


def test_zero_norm_vectors_join_entry_zero():
    x = torch.tensor([[0.0, 0.0], [0.0, 2.0], [0.0, 0.0], [3.0, 0.0]])
    C, ref, mag = kernels.build_codebook(x, 0.9)
    assert ref.tolist() == [0, 0, 0, 1] and torch.allclose(C, torch.eye(2).flip(0))
    assert torch.equal(C[ref] * mag[:, None], x), "zero vectors reconstruct exactly"
    C, ref, mag = kernels.build_codebook(torch.zeros(3, 4), 0.9)
    assert torch.equal(C, torch.eye(1, 4)) and ref.tolist() == [0, 0, 0] and mag.tolist() == [0, 0, 0]
    C, ref, mag = kernels.build_codebook(torch.zeros(0, 4), 0.9)
    assert C.shape == (0, 4) and ref.shape == mag.shape == (0,)


def test_gqa_dedup_with_multiplicity_equals_unfolded_copies():
    xu = clustered(160, 16, seed=11)                                    # [U, D] group-unique tokens
    mult = torch.randint(1, 4, (160,), generator=torch.Generator().manual_seed(11))   # [U] heads keeping each
    C_u, ref_u, mag_u = kernels.build_codebook(xu, 0.95, mult.float())
    C_f, ref_f, mag_f = kernels.build_codebook(xu.repeat_interleave(mult, 0), 0.95)  # copies adjacent
    assert torch.equal(C_u, C_f)
    assert torch.equal(ref_u.repeat_interleave(mult), ref_f)
    assert torch.equal(mag_u.repeat_interleave(mult), mag_f)


def test_gqa_copies_in_per_head_layout_share_one_entry():
    xu = clustered(120, 16, seed=12)                                    # [U, D]
    g = torch.Generator().manual_seed(12)
    kept = [torch.randperm(120, generator=g)[:80].sort().values for _ in range(3)]   # 3 query heads
    tok = torch.cat(kept)                                               # [3 * 80] token id per copy
    C, ref, _ = kernels.build_codebook(xu[tok], 0.95)
    for t in tok.unique():
        assert ref[tok == t].unique().numel() == 1, f"copies of token {int(t)} split across entries"


def test_long_input_never_materialises_the_graph(monkeypatch):
    x = clustered(3000, 32, seed=16)
    largest = [0]
    matmul = torch.Tensor.__matmul__

    def spy(a, b):
        out = matmul(a, b)
        largest[0] = max(largest[0], out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    C, ref, mag = kernels.build_codebook(x, 0.95, tile=64)
    monkeypatch.undo()
    assert 0 < largest[0] <= 64 * 3000, f"a product of {largest[0]} cosines exceeds the 64 x N tile"
    cos = (torch.nn.functional.normalize(x, dim=1) * C[ref]).sum(1)
    assert 100 < C.shape[0] < 2000 and bool((cos > 0.95 - 1e-6).all())


def test_degree_reference_chunking_is_invisible():
    x = torch.nn.functional.normalize(clustered(50, 8, seed=13), dim=1)
    rows, cols = torch.arange(50), torch.arange(3, 47)
    w = torch.randint(1, 4, (44,)).float()
    full = codebook.codebook_degree_reference(x, rows, cols, w, 0.9, max_elems=10 ** 9)
    assert torch.equal(codebook.codebook_degree_reference(x, rows, cols, w, 0.9, max_elems=1), full)
    literal = ((((x @ x[cols].T) > 0.9) | (rows[:, None] == cols[None, :])).float() * w).sum(1)
    assert torch.equal(full, literal)


def test_mergeable_share_worked_example_and_sampled_bound():
    theta = math.cos(math.radians(15))
    # 0-10, 10-20 and 90-95 degrees are edges; 45 and 200 degrees have no neighbour: 5 of 7
    x = _angles(0, 10, 20, 45, 90, 95, 200)
    assert kernels.mergeable_share(x, theta) == pytest.approx(5 / 7)     # all rows sampled: exact
    assert kernels.mergeable_share(x[:1], theta) == 0.0
    g = torch.Generator().manual_seed(3)
    loners = torch.nn.functional.normalize(torch.randn(2000, 64, generator=g), dim=1)   # near-orthogonal
    assert kernels.mergeable_share(loners, 0.9) < 0.03                   # sampled: 0 plus its error bar
    twins = torch.cat([loners, loners * 2.0])                            # every row has a twin
    assert kernels.mergeable_share(twins, 0.9) == 1.0


def test_dispatch_rejects_bad_args():
    with pytest.raises(ValueError, match="x must be"):
        kernels.build_codebook(torch.zeros(4, dtype=torch.long).view(2, 2), 0.9)
    with pytest.raises(ValueError, match="weight must be"):
        kernels.build_codebook(torch.zeros(4, 2), 0.9, torch.ones(3))
    with pytest.raises(ValueError, match="weight must be"):
        kernels.build_codebook(torch.zeros(2, 2), 0.9, torch.tensor([1.0, 0.0]))


# ---- the Triton degree kernel, under the interpreter ----

DEGREE_CASES = {   # name: (N, D, rows, cols, weights, theta, block_r, block_m, block_d, seed)
    "N37_D24_all": (37, 24, "all", "all", "int", 0.2, 32, 64, None, 21),
    "N37_D24_subsets_float_w": (37, 24, 23, 29, "float", 0.0, 16, 16, None, 22),
    "N70_D64_four_d_blocks": (70, 64, "all", 51, "int", 0.1, 16, 32, 16, 23),
    "N5_D3": (5, 3, "all", "all", "int", 0.5, 32, 64, None, 24),
    "N37_D24_no_cols": (37, 24, "all", 0, "int", 0.2, 32, 64, None, 25),
    "N37_D24_no_rows": (37, 24, 0, "all", "int", 0.2, 32, 64, None, 26),
    "N45_D12_clustered_095": (45, 12, "all", "all", "int", 0.95, 32, 16, None, 27),
}


def _degree_inputs(name):
    N, D, nr, nc, weights, theta, br, bm, bd, seed = DEGREE_CASES[name]
    g = torch.Generator().manual_seed(seed)
    x = clustered(N, D, seed) if "clustered" in name else torch.randn(N, D, generator=g)
    xn = torch.nn.functional.normalize(x, dim=1).contiguous()                                  # [N, D]
    rows = torch.arange(N) if nr == "all" else torch.randperm(N, generator=g)[:nr]             # [R]
    cols = torch.arange(N) if nc == "all" else torch.randperm(N, generator=g)[:nc]             # [M]
    w = (torch.randint(1, 5, cols.shape, generator=g).float() if weights == "int"
         else torch.rand(cols.shape, generator=g))                                               # [M]
    return xn, rows, cols, w, theta, dict(block_r=br, block_m=bm, block_d=bd)


def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(codebook._degree_kernel).__name__}
    for name in DEGREE_CASES:
        xn, rows, cols, w, theta, blocks = _degree_inputs(name)
        out = torch.full(rows.shape, float("nan"))                       # [R] poisoned
        codebook.codebook_degree_triton(xn, rows, cols, w, theta, out, **blocks)
        results[name] = out
    x = clustered(70, 16, seed=31)
    w = torch.randint(1, 4, (70,)).float()
    results["build"] = (x, w, kernels.use_triton(x), kernels.build_codebook(x, 0.95, w))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_codebook")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(DEGREE_CASES))
def test_degree_kernel_matches_reference(interpreted, name):
    xn, rows, cols, w, theta, _ = _degree_inputs(name)
    out = interpreted[name]
    ref = codebook.codebook_degree_reference(xn, rows, cols, w, theta)     # [R]
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any(), "kernel left poisoned (unwritten) elements"
    if DEGREE_CASES[name][4] == "int":
        assert torch.equal(out, ref), "integer weights: degrees are exact counts"
    assert rel_err(out, ref) < 1e-6
    if rows.numel() and cols.numel():
        assert 0 < int((out > 0).sum()), "degenerate case: no hits"


def test_build_codebook_with_triton_degrees_equals_reference(interpreted):
    x, w, used, (C, ref, mag) = interpreted["build"]
    assert used is True
    C0, ref0, mag0 = codebook.build_codebook(x, 0.95, w)
    assert torch.equal(ref, ref0) and torch.equal(C, C0) and torch.equal(mag, mag0)
    assert 1 < C.shape[0] < 60


@pytest.mark.parametrize("bad, message", [
    (lambda xn, r, c, w: (xn.double(), r, c, w), "fp32"),
    (lambda xn, r, c, w: (xn.T, r, c, w), "unit column stride"),
    (lambda xn, r, c, w: (xn, r.int(), c, w), "rows must be torch.int64"),
    (lambda xn, r, c, w: (xn, r, c[::2], w[::2]), "contiguous"),
    (lambda xn, r, c, w: (xn, r, c, w[1:]), "w must be"),
    (lambda xn, r, c, w: (xn, r, c, w.half()), "w must be torch.float32"),
])
def test_degree_launcher_rejects_bad_args(bad, message):
    xn = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    args = bad(xn, torch.arange(8), torch.arange(8), torch.ones(8))
    with pytest.raises(AssertionError, match=message):
        codebook.codebook_degree_triton(*args, 0.5)


if __name__ == "__main__":
    _child(sys.argv[1])
