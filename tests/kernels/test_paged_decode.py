"""Paged decode attention over the pool's mixed storage forms (`kernels.paged_decode`), on streams
built through `BlockTables` (`tests.kernels.paged_streams`: dense rows, every quant form with its
dense tail, skip pages, exact rows beside quant ones, codebook rows pre-RoPE with head masks and
absent rows, a merged pair sharing entries, then decode rows that flush tails), head dims 64 and
16, 1 to 9 query rows a stream, group_heads below h:

    the pool's rows (`BlockTables.stream`) against what was stored, independently of the kernels
    the reference against plain attention over each stream's rows, with its head masks
    the C++ kernel against the reference (out and lse, relative error < 1e-5); its result the
        same bit for bit at any thread count and whatever other streams share the call
    the Triton kernels under the interpreter (`tests.kernels.interp`) against the reference, at
        the default split count and at others
    the Triton kernels on CUDA, and inside a CUDA graph, where CUDA is; compiled for sm_90 here
    the launcher's ValueErrors naming the bad table"""
from __future__ import annotations

import sys

import pytest
import torch

from kernels import cpu_extension
from kernels import paged_decode as pd
from kernels._triton import HAS_TRITON, INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err
from tests.kernels.paged_streams import CASES, H, L, build, kernel_args

REFIT_REL = {1: 0.85, 2: 0.55}      # SpeCache's refitted forms: |dequantized - stored| / |stored| at most
                                    # (0.58 and 0.32 measured; rows out of place give about 1.4)


def _min_max_bound(k: torch.Tensor, v: torch.Tensor, form) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain min/max form's error bound per element of stored rows k, v [n·g, D]: half a level of
    each group's range (K per key group and channel, V per row and value group), plus the fp16
    rounding of its scale and zero."""
    n, d = k.shape
    levels = (1 << form.bits) - 1

    def bound(groups: torch.Tensor, dim: int) -> torch.Tensor:
        lo, hi = groups.amin(dim, keepdim=True), groups.amax(dim, keepdim=True)
        return ((hi - lo) / (2 * levels) + (lo.abs() + hi - lo) * 2 ** -10).expand_as(groups)
    kb = bound(k.view(-1, form.key_group, d), 1).reshape(n, d)
    vb = bound(v.view(n, d // form.value_group, form.value_group), 2).reshape(n, d)
    return kb, vb


def _cpp():
    if cpu_extension.module() is None:
        pytest.skip("no C++ compiler here")
    return cpu_extension.module()


@pytest.fixture(scope="module")
def built():
    return {name: build(name) for name in CASES}


def _close(out, lse, ref_out, ref_lse, tol=1e-5):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_err(out, ref_out) < tol
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf) and bool((lse[inf] == ref_lse[inf]).all())
    assert rel_err(lse[~inf], ref_lse[~inf]) < tol


# ---- the pool's rows and the reference ----

@pytest.mark.parametrize("name", list(CASES))
def test_streams_hold_what_was_stored(built, name):
    b = built[name]
    lay, t = b.layout, b.tables
    for (layer, slot, head), e in b.expected.items():
        k, v, heads = t.stream(layer, slot, head, b.rope)                               # [U, D] fp32
        form = int(t.qform[layer, slot])
        nq = int(t.qn[layer, slot, head]) * (lay.quant_forms[form].rows if form else 0)
        rows_k, rows_v = torch.cat(e.rows_k).float(), torch.cat(e.rows_v).float()
        keep = torch.ones(nq, dtype=torch.bool)
        if e.skip is not None:
            keep[:e.skip.numel()] = ~e.skip[:nq]
        kept = int(keep.sum())
        if nq:
            f = lay.quant_forms[form]
            if f.refine or f.midpoint:
                for got, want in ((k[:kept], rows_k[:nq][keep]), (v[:kept], rows_v[:nq][keep])):
                    assert (got - want).norm() / want.norm() < REFIT_REL[f.bits], (layer, slot, head, form)
            else:
                kb, vb = _min_max_bound(rows_k[:nq], rows_v[:nq], f)
                assert bool(((k[:kept] - rows_k[:nq][keep]).abs() <= kb[keep]).all()), (layer, slot, head, form)
                assert bool(((v[:kept] - rows_v[:nq][keep]).abs() <= vb[keep]).all()), (layer, slot, head, form)
        c = 0 if e.coded_k is None else e.coded_k.shape[0]
        if c:
            torch.testing.assert_close(k[kept:kept + c], e.coded_k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[kept:kept + c], e.coded_v, rtol=0, atol=0)
            assert torch.equal(heads[kept:kept + c], e.coded_heads)
        assert torch.equal(k[kept + c:], rows_k[nq:]) and torch.equal(v[kept + c:], rows_v[nq:])
        assert k.shape[0] == kept + c + rows_k.shape[0] - nq


@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_attention_over_each_streams_rows(built, name):
    b = built[name]
    for layer in range(L):
        args = kernel_args(b, layer)
        q, scaling = args[0], args[-1]
        out, lse = pd.paged_decode_reference(*args, rope=b.rope, group_heads=b.group_heads)
        bit = 1 << (torch.arange(b.h) % b.group_heads)                                  # [h]
        for i, slot in enumerate(b.slots):
            for head in range(H):
                g = i * H + head
                k, v, heads = b.tables.stream(layer, slot, head, b.rope)
                if not k.shape[0]:
                    assert bool((out[g] == 0).all()) and bool(torch.isinf(lse[g]).all())
                    continue
                s = (q[g].double() @ k.double().T) * scaling                            # [h, U]
                seen = (heads.long()[None, :] & bit[:, None]) > 0
                s = s.masked_fill(~seen, float("-inf"))
                want = torch.logsumexp(s, -1)
                seen_any = torch.isfinite(want)
                assert torch.equal(torch.isfinite(lse[g]), seen_any)
                assert rel_err(out[g], torch.softmax(s, -1).nan_to_num(0.0) @ v.double()) < 1e-5
                assert rel_err(lse[g][seen_any], want[seen_any]) < 1e-5


# ---- the C++ kernel ----

@pytest.mark.parametrize("name", list(CASES))
def test_cpu_kernel_matches_reference(built, name):
    _cpp()
    b = built[name]
    for layer in range(L):
        args = kernel_args(b, layer)
        out, lse = pd.paged_decode(*args, rope=b.rope, group_heads=b.group_heads)
        _close(out, lse, *pd.paged_decode_reference(*args, rope=b.rope, group_heads=b.group_heads))


def test_cpu_kernel_small_tasks_match_reference(built, monkeypatch):
    """Split-K tasks of one page each: many partials a stream, combined in order."""
    _cpp()
    monkeypatch.setattr(pd, "TASK_ROWS", 1)
    b = built["D64_h9_g3_mixed"]
    args = kernel_args(b, 0)
    _close(*pd.paged_decode(*args, rope=b.rope, group_heads=b.group_heads),
           *pd.paged_decode_reference(*args, rope=b.rope, group_heads=b.group_heads))


def test_cpu_kernel_result_is_each_streams_own(built):
    """Bit for bit the same at 1, 2 and 3 threads, for a stream alone, among others in another order."""
    _cpp()
    b = built["D64_h9_g3_mixed"]
    args = kernel_args(b, 1)
    q, arena, tables, rest = args[0], args[1], args[2:13], args[13:]
    kw = dict(rope=b.rope, group_heads=b.group_heads)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(pd.paged_decode(*args, **kw))
    finally:
        torch.set_num_threads(threads)
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    full_out, full_lse = runs[0]
    g = q.shape[0]
    for pick in (torch.tensor([5]), torch.arange(g).flip(0), torch.tensor([9, 2, 2, 13, 0])):
        sub = [t[pick] for t in tables]
        out, lse = pd.paged_decode(q[pick], arena, *sub, *rest, **kw)
        assert torch.equal(out, full_out[pick]) and torch.equal(lse, full_lse[pick])


def test_cpu_kernel_refuses_bad_tables(built):
    """The C++ kernel's own checks: a page outside the arena, a position past the RoPE tables."""
    _cpp()
    b = built["D16_h1_g1"]
    args = list(kernel_args(b, 0))
    dtable = args[2].clone()
    dtable[0, 0] = b.pool.pages + 5
    with pytest.raises(RuntimeError, match="dense page"):
        pd.paged_decode(*args[:2], dtable, *args[3:], rope=b.rope, group_heads=b.group_heads)
    short = tuple(x[:3] for x in b.rope)
    with pytest.raises(RuntimeError, match="past the RoPE tables"):
        pd.paged_decode(*args, rope=short, group_heads=b.group_heads)


def test_launcher_names_bad_arguments(built):
    b = built["D16_h1_g1"]
    args = kernel_args(b, 0)
    names = pd.NAMES
    at = {n: 2 + i for i, n in enumerate(names)}

    def swap(name, value):
        x = list(args)
        x[at[name]] = value
        return x
    with pytest.raises(ValueError, match="dtable must be int32"):
        pd.paged_decode(*swap("dtable", args[at["dtable"]].long()))
    with pytest.raises(ValueError, match="qn must be int32"):
        pd.paged_decode(*swap("qn", args[at["qn"]][:1]))
    with pytest.raises(ValueError, match="ektable must be int32"):
        pd.paged_decode(*swap("ektable", args[at["ektable"]][:, 0]))
    with pytest.raises(ValueError, match="xpage must be int32"):
        pd.paged_decode(*swap("xpage", args[at["xpage"]].float()))
    with pytest.raises(ValueError, match="q must be"):
        pd.paged_decode(args[0][0], *args[1:])
    with pytest.raises(ValueError, match="arena must be uint8"):
        pd.paged_decode(args[0], args[1].view(torch.int16), *args[2:])


# ---- the Triton kernels, under the interpreter ----

SPLITS = (None, 3)      # by layer: the default split count (from the table widths), three splits a stream


def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(pd._paged_decode_split).__name__}
    for name in CASES:
        b = build(name)
        for layer, s in zip(range(L), SPLITS):
            results[name, layer] = pd.paged_decode_triton(*kernel_args(b, layer), rope=b.rope,
                                                          group_heads=b.group_heads, splits=s)
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_paged_decode")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(interpreted, built, name):
    b = built[name]
    for layer in range(L):
        ref = pd.paged_decode_reference(*kernel_args(b, layer), rope=b.rope, group_heads=b.group_heads)
        _close(*interpreted[name, layer], *ref)


def test_split_count_comes_from_the_table_widths():
    z = lambda w: torch.zeros(4, w, dtype=torch.int32)        # noqa: E731
    assert pd.triton_splits(z(1), z(1), z(1)) == 1
    assert pd.triton_splits(z(220), z(1), z(1)) == 14
    assert pd.triton_splits(z(5000), z(5000), z(1)) == pd.MAX_SPLITS


# ---- the Triton kernels compiled for an H100 here, and run on CUDA where it is ----

def test_triton_kernels_compile_for_sm90():
    from tests.kernels.hopper import compile_for_hopper
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    sig = {n: "*i32" for n in ("dt_ptr", "ds_ptr", "de_ptr", "qt_ptr", "qn_ptr", "qf_ptr", "ct_ptr", "cn_ptr",
                               "ekt_ptr", "evt_ptr", "xp_ptr", "form_ptr")}
    sig.update(q_ptr="*fp32", arena_ptr="*u8", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", cos_ptr="*fp32",
               sin_ptr="*fp32", T="i32", MBD="i32", MBQ="i32", MBC="i32", MBK="i32", MBV="i32", PAGE="i32", S="i32",
               GH="i32", scaling="fp32")
    for h, hc, hp, d, tq in ((3, 4, 4, 64, 16), (9, 8, 16, 64, 16), (4, 4, 4, 16, 16), (1, 1, 1, 128, 16)):
        k = compile_for_hopper(pd._paged_decode_split, sig, dict(H=h, HC=hc, HP=hp, D=d, R=16, M=240, E=32, TQ=tq,
                                                                 SP=pd.SPLIT_PAGES))
        assert "cubin" in k.asm
        k = compile_for_hopper(pd._paged_decode_merge,
                               dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*fp32", lse_ptr="*fp32",
                                    S="i32"), dict(H=h, HP=hp, D=d, SP=16))
        assert "cubin" in k.asm


cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON,
                          reason="no CUDA device (or no Triton) here: the CUDA runs need a GPU")


def _on_cuda(b, layer):
    args = kernel_args(b, layer)
    return (args[0].cuda(), args[1].cuda(), *(t.cuda() for t in args[2:13]), *args[13:])


@cuda
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_matches_reference(built, name):
    b = built[name]
    rope = tuple(x.cuda() for x in b.rope)
    for layer in range(L):
        ref = pd.paged_decode_reference(*kernel_args(b, layer), rope=b.rope, group_heads=b.group_heads)
        for s in SPLITS:
            x = _on_cuda(b, layer)
            out, lse = pd.paged_decode_triton(*x, rope=rope, group_heads=b.group_heads, splits=s)
            _close(out.cpu(), lse.cpu(), *ref)
        out, lse = pd.paged_decode(*_on_cuda(b, layer), rope=rope, group_heads=b.group_heads)   # the launcher
        _close(out.cpu(), lse.cpu(), *ref)


@cuda
def test_cuda_kernel_in_a_cuda_graph(built):
    b = built["D64_h9_g3_mixed"]
    rope = tuple(x.cuda() for x in b.rope)
    x = _on_cuda(b, 0)
    run = lambda: pd.paged_decode(*x, rope=rope, group_heads=b.group_heads)   # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()                                                 # warm: compiled, constants on the device
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    x[0].copy_(kernel_args(b, 1)[0].cuda())                   # new queries into the captured input
    graph.replay()
    torch.cuda.synchronize()
    q1 = kernel_args(b, 1)[0]
    ref = pd.paged_decode_reference(q1, *kernel_args(b, 0)[1:], rope=b.rope, group_heads=b.group_heads)
    _close(out.cpu(), lse.cpu(), *ref)


if __name__ == "__main__":
    _child(sys.argv[1])
