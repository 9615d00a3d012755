"""Ragged decode attention: the reference against torch sdpa per head on the kept rows, and the
Triton kernel (interpreter child process, see `tests.kernels.interp`) against the reference."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import ragged_attention as ra
from kernels._triton import INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err

# name: (rows per head, D, k/v dtype, layout, block_t)
CASES = {
    "D24_mixed_counts": ([5, 1, 37, 0, 12, 64, 33], 24, torch.float32, "contiguous", 16),
    "D64_fp16_kv": ([17, 3, 1, 40], 64, torch.float16, "contiguous", 32),
    "D5_bf16_one_row_heads": ([1, 1, 1, 2], 5, torch.bfloat16, "contiguous", 4),
    "D24_row_strided_kv": ([9, 30, 2], 24, torch.float32, "row_stride_40", 8),
    "all_heads_empty": ([0, 0, 0], 16, torch.float32, "contiguous", 16),
    "large_logits": ([50, 7], 32, torch.float32, "scaled_x30", 16),
}


def _inputs(name):
    counts, D, dtype, layout, block_t = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    H, T = len(counts), sum(counts)
    offsets = torch.tensor([0] + counts).cumsum(0)                                       # [H+1] int64
    q = torch.randn(H, D, generator=g)                                                   # [H, D]
    if layout == "row_stride_40":
        k = torch.randn(T, 40, generator=g)[:, 3:3 + D].to(dtype)                       # [T, D] stride (40, 1)
        v = torch.randn(T, 40, generator=g)[:, 7:7 + D].to(dtype)
    else:
        k = torch.randn(T, D, generator=g).to(dtype)                                     # [T, D]
        v = torch.randn(T, D, generator=g).to(dtype)
    if layout == "scaled_x30":
        q = q * 30                                                                        # logits ~ +-100s
    return (q, k, v, offsets, D ** -0.5), block_t


def _dense_per_head(q, k, v, offsets, scaling):   # [H, D] via sdpa on each head's own rows
    out = torch.zeros(q.shape, dtype=torch.float32)
    for h in range(q.shape[0]):
        a, b = int(offsets[h]), int(offsets[h + 1])
        if b > a:
            out[h] = F.scaled_dot_product_attention(q[h].float()[None, None, None], k[a:b].float()[None, None],
                                                    v[a:b].float()[None, None], scale=scaling)[0, 0, 0]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_dense_attention_per_head(name):
    args, _ = _inputs(name)
    out = kernels.ragged_decode_attention(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert rel_err(out, _dense_per_head(*args)) < 1e-5
    counts = args[3].diff()
    assert bool((out[counts == 0] == 0).all()), "a head without rows gives zeros"
    one = counts == 1
    assert torch.allclose(out[one], args[2].float()[args[3][:-1][one]]), "one row: out is that row's v"


def test_dispatch_rejects_bad_offsets():
    q, k, v = torch.randn(2, 4), torch.randn(5, 4), torch.randn(5, 4)
    for bad in ([0, 3, 4], [1, 3, 5], [0, 4, 3, 5][:3], [0, 6, 5]):
        with pytest.raises(ValueError, match="offsets must rise"):
            kernels.ragged_decode_attention(q, k, v, torch.tensor(bad), 0.5)
    with pytest.raises(ValueError, match="offsets must be int64"):
        kernels.ragged_decode_attention(q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), 0.5)
    with pytest.raises(ValueError, match="same D"):
        kernels.ragged_decode_attention(q, k[:, :3], v[:, :3], torch.tensor([0, 2, 5]), 0.5)


# ---- the Triton kernel, under the interpreter ----

def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(ra._ragged_decode_kernel).__name__}
    for name in CASES:
        args, block_t = _inputs(name)
        out = torch.full(args[0].shape, float("nan"))                    # [H, D] poisoned
        ra.ragged_decode_attention_triton(*args, out=out, block_t=block_t)
        results[name] = out
    args, _ = _inputs("D24_mixed_counts")
    results["dispatch"] = (kernels.use_triton(args[0]), kernels.ragged_decode_attention(*args))
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_ragged_attention")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted, name):
    args, _ = _inputs(name)
    out = interpreted[name]
    ref = ra.ragged_decode_attention_reference(*args)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any(), "kernel left poisoned (unwritten) elements"
    assert rel_err(out, ref) < 1e-5


def test_dispatch_uses_triton_under_interpreter(interpreted):
    used, out = interpreted["dispatch"]
    args, _ = _inputs("D24_mixed_counts")
    assert used is True and rel_err(out, _dense_per_head(*args)) < 1e-5


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, o: (q, k[:, ::2], v[:, ::2], o), "k must be"),
    (lambda q, k, v, o: (q, k.T.contiguous().T, v, o), "unit column stride"),
    (lambda q, k, v, o: (q, k.double(), v, o), "fp16/bf16/fp32"),
    (lambda q, k, v, o: (q, k, v[:-1], o), "one shape"),
    (lambda q, k, v, o: (q, k, v, o.int()), "offsets must be int64"),
    (lambda q, k, v, o: (q, k, v, o[:-1]), "offsets must be int64"),
])
def test_launcher_rejects_bad_args(bad, message):
    args = bad(torch.randn(2, 8), torch.randn(6, 8), torch.randn(6, 8), torch.tensor([0, 2, 6]))
    with pytest.raises(AssertionError, match=message):
        ra.ragged_decode_attention_triton(*args, 0.3)


if __name__ == "__main__":
    _child(sys.argv[1])
