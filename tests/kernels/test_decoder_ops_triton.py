"""The decoder's fused per-row ops as Triton kernels (`kernels.decoder_ops_triton`) against their torch
references: under the interpreter on the CPU (a child process, `tests.kernels.interp`) on odd shapes,
fp32/bf16/fp16 rows, strided rows, in place where they say so, outputs poisoned with NaN before the
kernel writes them; on CUDA (when there is one) through `kernels.decoder_ops`' dispatch, and held by
a CUDA graph. Each kernel's result is its fp32 math rounded once, so it is compared with the
reference computed in fp32 and rounded to the row dtype, within one unit of that rounding (the
interpreter rounds fp32 to bf16 toward zero, CUDA to nearest even)."""
from __future__ import annotations

import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

from kernels import decoder_ops as ops
from kernels._triton import INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# one rounding of the output, relative (fp32: a GPU's exp and division are a few ulp off)
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
NORMS = [(1, 576), (7, 64), (33, 100), (3, 1)]                             # rows, hidden
ROPES = [(1, 9, 64), (6, 3, 16), (13, 2, 128), (4, 5, 6)]                  # rows, heads, D (D/2 = 3: padded)
SILUS = [(1, 1536), (17, 100), (3, 5), (2, 1025)]                          # past one program's 1024 elements


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))      # the same in the child


def _norm_inputs(n, h, dtype):
    g = _gen("norm", n, h, dtype)
    wide = torch.randn(n, h + 3, generator=g) * 3                          # rows of a wider tensor: stride(0) > H
    return (wide[:, :h].to(dtype), (torch.rand(h, generator=g) + 0.5).to(dtype),
            torch.randn(n, h, generator=g).to(dtype))


def _rope_inputs(n, heads, d, dtype, tables="llama"):
    """tables "llama": RoPE's (the two halves of cos and of sin equal); "any": random [N, D] tables,
    which the contract (the reference's formula) takes as well."""
    g = _gen("rope", n, heads, d, dtype, tables)
    x = torch.randn(n, heads + 2, d, generator=g).to(dtype)                # heads 1..heads: a head slice
    if tables == "any":
        return x, torch.randn(n, d, generator=g).to(dtype), torch.randn(n, d, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (n,), generator=g).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(0, d, 2).float() / d))[None]
    emb = torch.cat([freqs, freqs], -1)
    return x, emb.cos().to(dtype), emb.sin().to(dtype)


def _silu_inputs(shape, dtype):
    g = _gen("silu", shape, dtype)
    return (torch.randn(*shape, generator=g) * 4).to(dtype), torch.randn(*shape, generator=g).to(dtype)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def _poisoned_allocations() -> None:
    """torch.empty / empty_like give NaN-filled float tensors: a kernel that leaves an element of its
    output unwritten shows a NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.empty = lambda *a, **k: fill(empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(empty_like(*a, **k))


# ---- the Triton kernels, under the interpreter ----

def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    from kernels import decoder_ops_triton as dt
    _poisoned_allocations()
    res = {"kernel_type": type(dt._rms_norm_kernel).__name__}
    for dtype in DTYPES:
        for n, h in NORMS:
            x, w, delta = _norm_inputs(n, h, dtype)
            res["norm", n, h, dtype] = dt.rms_norm(x, w, 1e-5)
            res["norm_w32", n, h, dtype] = dt.rms_norm(x, w.float(), 1e-5)               # fp32 weight: fp32 out
            residual = x.clone()
            res["add", n, h, dtype] = (dt.add_rms_norm(residual, delta, w, 1e-6), residual)
        for n, heads, d in ROPES:
            x, cos, sin = _rope_inputs(n, heads, d, dtype)
            y = x[:, 1:1 + heads].clone()
            view = x[:, 1:1 + heads]
            assert dt.rope_(view, cos, sin) is view
            res["rope", n, heads, d, dtype] = x
            res["rope32", n, heads, d, dtype] = dt.rope_(y, cos.float(), sin.float())   # fp32 tables, rows in dtype
            x, cos, sin = _rope_inputs(n, heads, d, dtype, "any")
            res["rope_any", n, heads, d, dtype] = dt.rope_(x[:, 1:1 + heads].clone(), cos, sin)
        for shape in SILUS:
            res["silu", shape, dtype] = dt.silu_mul(*_silu_inputs(shape, dtype))
    torch.save(res, out_path)


interpreted = interpreted_fixture("tests.kernels.test_decoder_ops_triton")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, h", NORMS)
def test_rms_norm_kernels_match_reference(interpreted, n, h, dtype):
    x, w, delta = _norm_inputs(n, h, dtype)
    out = interpreted["norm", n, h, dtype]
    assert out.dtype == dtype and out.shape == (n, h) and not out.isnan().any()
    assert rel_err(out, _rounded(ops.rms_norm_reference(x.float(), w.float(), 1e-5), dtype)) <= TOL[dtype]
    assert rel_err(out, ops.rms_norm_reference(x, w, 1e-5)) <= 2 * TOL[dtype]          # the reference in dtype
    out32 = interpreted["norm_w32", n, h, dtype]
    want32 = ops.rms_norm_reference(x.float(), w.float(), 1e-5)
    assert out32.dtype == torch.float32 and rel_err(out32, want32) <= TOL[torch.float32]
    got, residual = interpreted["add", n, h, dtype]
    total = (x.float() + delta.float()).to(dtype)                                      # `residual += delta` rounds
    assert rel_err(residual, total) <= TOL[dtype], "the residual, summed in place"    # (the interpreter truncates)
    assert not got.isnan().any()                                                      # the norm of what it stored
    assert rel_err(got, _rounded(ops.rms_norm_reference(residual.float(), w.float(), 1e-6), dtype)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, heads, d", ROPES)
def test_rope_kernel_rotates_in_place_like_hf(interpreted, n, heads, d, dtype):
    x, cos, sin = _rope_inputs(n, heads, d, dtype)
    got = interpreted["rope", n, heads, d, dtype]
    want = ops.rope_reference(x[:, 1:1 + heads].float(), cos.float(), sin.float())
    assert rel_err(got[:, 1:1 + heads], _rounded(want, dtype)) <= TOL[dtype]
    assert torch.equal(got[:, 0], x[:, 0]) and torch.equal(got[:, -1], x[:, -1]), "heads outside the view untouched"
    got32 = interpreted["rope32", n, heads, d, dtype]
    want32 = ops.rope_reference(x[:, 1:1 + heads].float(), cos.float(), sin.float())
    assert got32.dtype == dtype and rel_err(got32, _rounded(want32, dtype)) <= TOL[dtype]
    x, cos, sin = _rope_inputs(n, heads, d, dtype, "any")
    want_any = ops.rope_reference(x[:, 1:1 + heads].float(), cos.float(), sin.float())
    assert rel_err(interpreted["rope_any", n, heads, d, dtype], _rounded(want_any, dtype)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILUS)
def test_silu_mul_kernel_matches_reference(interpreted, shape, dtype):
    gate, up = _silu_inputs(shape, dtype)
    got = interpreted["silu", shape, dtype]
    assert got.dtype == dtype and not got.isnan().any()
    assert rel_err(got, _rounded(F.silu(gate.float()) * up.float(), dtype)) <= TOL[dtype]


def test_launchers_name_bad_arguments():
    pytest.importorskip("triton")
    from kernels import decoder_ops_triton as dt
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="x must be fp32/bf16/fp16"):
        dt.rms_norm(x.long(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="x must have unit column stride"):
        dt.rms_norm(torch.randn(8, 4).T, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"w must be a contiguous float \[8\]"):
        dt.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="delta must be"):
        dt.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="x must be fp32/bf16/fp16 \\[N, heads, D\\] with even D"):
        dt.rope_(torch.randn(2, 3, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"sin must be a float \[2, 4\]"):
        dt.rope_(torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(1, 4))
    with pytest.raises(ValueError, match="up must be"):
        dt.silu_mul(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="gate must be a contiguous"):
        dt.silu_mul(torch.randn(8, 4).T, torch.randn(4, 8))


# ---- compiled for an H100 (no GPU needed) ----

@pytest.mark.parametrize("row", ["*bf16", "*fp32"])
def test_kernels_compile_for_hopper(row):
    from kernels import decoder_ops_triton as dt
    from tests.kernels.hopper import compile_for_hopper
    for add in (False, True):
        compile_for_hopper(dt._rms_norm_kernel, {"x_ptr": row, "d_ptr": row, "w_ptr": row, "out_ptr": row, "H": "i32",
                                                 "stride_x": "i32", "stride_d": "i32", "eps": "fp32"},
                           dict(ADD=add, BLOCK=1024), num_warps=4)
    compile_for_hopper(dt._rope_kernel, {"x_ptr": row, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "HEADS": "i32",
                                         "HALF": "i32", "stride_xn": "i32", "stride_xh": "i32", "stride_cn": "i32",
                                         "stride_sn": "i32"}, dict(BLOCK_H=16, BLOCK_D=32), num_warps=2)
    k = compile_for_hopper(dt._silu_mul_kernel, {"g_ptr": row, "u_ptr": row, "out_ptr": row, "total": "i32"},
                           dict(BLOCK=1024), num_warps=4)
    assert k.asm["cubin"]


# ---- on CUDA, through the dispatch ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here: the kernels run under the interpreter only")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dispatch_runs_the_kernels_and_matches_reference(dtype):
    from kernels import decoder_ops_triton as dt
    dev = torch.device("cuda")
    for n, h in NORMS:
        x, w, delta = (t.to(dev) for t in _norm_inputs(n, h, dtype))
        out = ops.rms_norm(x, w, 1e-5)
        assert torch.equal(out, dt.rms_norm(x, w, 1e-5)), "the dispatch took the Triton kernel"
        assert rel_err(out, _rounded(ops.rms_norm_reference(x.float(), w.float(), 1e-5), dtype)) <= TOL[dtype]
        residual = x.clone()
        got = ops.add_rms_norm(residual, delta, w, 1e-6)
        total = (x.float() + delta.float()).to(dtype)
        assert torch.equal(residual, total)
        assert rel_err(got, _rounded(ops.rms_norm_reference(total.float(), w.float(), 1e-6), dtype)) <= TOL[dtype]
    for n, heads, d in ROPES:
        x, cos, sin = (t.to(dev) for t in _rope_inputs(n, heads, d, dtype))
        want = ops.rope_reference(x[:, 1:1 + heads].float(), cos.float(), sin.float())
        y = x.clone()
        ops.rope_(y[:, 1:1 + heads], cos, sin)
        assert rel_err(y[:, 1:1 + heads], _rounded(want, dtype)) <= TOL[dtype] and torch.equal(y[:, 0], x[:, 0])
    for shape in SILUS:
        gate, up = (t.to(dev) for t in _silu_inputs(shape, dtype))
        got = ops.silu_mul(gate, up)
        assert torch.equal(got, dt.silu_mul(gate, up))
        assert rel_err(got, _rounded(F.silu(gate.float()) * up.float(), dtype)) <= TOL[dtype]


@cuda
def test_a_cuda_graph_holds_the_ops():
    """Captured once, replayed over new rows written into the same buffers: the same results as eager
    calls (no host sync and no allocation a graph could not hold)."""
    dev, dtype, n, hid, heads, d = torch.device("cuda"), torch.bfloat16, 16, 576, 9, 64
    g = _gen("graph")
    x, delta = torch.randn(n, hid, generator=g).to(dev, dtype), torch.randn(n, hid, generator=g).to(dev, dtype)
    w = (torch.rand(hid, generator=g) + 0.5).to(dev, dtype)
    q = torch.randn(n, heads, d, generator=g).to(dev, dtype)
    cos, sin = torch.randn(n, d, generator=g).to(dev, dtype), torch.randn(n, d, generator=g).to(dev, dtype)

    def step():
        y = ops.add_rms_norm(x, delta, w, 1e-5)
        ops.rope_(q, cos, sin)
        return ops.silu_mul(y, ops.rms_norm(y, w, 1e-5))

    step()                                        # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t in (x, delta, q, cos, sin):
        t.copy_(torch.randn(t.shape, generator=g).to(dev, dtype))
    x0, q0 = x.clone(), q.clone()
    graph.replay()
    got_x, got_q, got = x.clone(), q.clone(), out.clone()
    x.copy_(x0)
    q.copy_(q0)
    want = step()
    assert torch.equal(got, want) and torch.equal(got_x, x) and torch.equal(got_q, q)


if __name__ == "__main__":
    _child(sys.argv[1])
