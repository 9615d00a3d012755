"""Varlen paged prefill attention (`kernels.paged_prefill`): the reference against SDPA over each
segment's own K/V rows; the Triton kernel (interpreter child process, `tests.kernels.interp`; and on
CUDA when there is one) and the C++ kernel (where the extension exports it) against the reference.

The pools here are built by hand to the contract (not by the engine's pool): pages handed out in a
shuffled order, every byte no stream owns — page 0, which unused table entries name, and the slots
past each stream's last row — poisoned with NaN, so a kernel that reads a row it must not shows it;
outputs poisoned with NaN before the kernel writes them. Cases: GQA 3:1 at SmolLM2's shape, no
GQA, a head dim that is not a power of two, 8-row pages, fp32/bf16/fp16 queries, empty segments,
one-row segments, chunks continuing a stored context, 33 segments, tiles of 16 to 64 rows."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_extension
from kernels import paged_prefill as pp
from kernels._triton import INTERPRETED
from tests.kernels.interp import interpreted_fixture, rel_err

# name: (H, H_kv, D, R, segments [(query rows n, kv_len)], q dtype, block_m, block_n)
CASES = {
    "smol_fp32": (9, 3, 64, 16, [(40, 40), (1, 77), (0, 5), (23, 50)], torch.float32, 16, 32),
    "smol_bf16": (9, 3, 64, 16, [(40, 40), (1, 77), (0, 5), (23, 50)], torch.bfloat16, 32, 16),
    "nogqa_fp16": (4, 4, 32, 16, [(17, 17), (33, 100)], torch.float16, 16, 64),
    "d48_r8": (6, 2, 48, 8, [(9, 30), (30, 30)], torch.float32, 16, 16),
    "many_segments": (2, 1, 16, 16, [(i % 4, i % 4 + (7 * i) % 19) for i in range(33)], torch.float32, 16, 16),
    "long_bf16": (3, 1, 64, 16, [(150, 300)], torch.bfloat16, 64, 64),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}   # against the fp32 math


def build(name: str, device: str = "cpu"):
    """-> (args of paged_prefill, per segment the K, V [H_kv, L, D] fp32 its streams hold)."""
    h, hk, d, r, segs, dtype, _, _ = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    need = [(length + r - 1) // r for _, length in segs]
    mb = max(need) + 1                                                 # a spare column: unused entries (0)
    n_pages = 1 + sum(need) * hk
    rows = torch.full((n_pages * 2 * r, d), float("nan"), dtype=torch.float16)   # page p: rows [2rp, 2rp + 2r)
    free = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()     # page 0 belongs to no stream
    table = torch.zeros(len(segs), hk, mb, dtype=torch.int32)
    kvs = []
    for s, (_, length) in enumerate(segs):
        k = torch.randn(hk, length, d, generator=g).half()
        v = torch.randn(hk, length, d, generator=g).half()
        for j in range(hk):
            for b in range(need[s]):
                p = free.pop()
                table[s, j, b] = p
                span = slice(b * r, min((b + 1) * r, length))
                n = span.stop - span.start
                rows[2 * r * p:2 * r * p + n] = k[j, span]
                rows[2 * r * p + r:2 * r * p + r + n] = v[j, span]
        kvs.append((k.float(), v.float()))
    starts = torch.tensor([0] + [n for n, _ in segs]).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), h, d, generator=g).to(dtype)
    kv_len = torch.tensor([length for _, length in segs], dtype=torch.int32)
    args = (q, rows.view(-1).view(torch.uint8), table, kv_len, starts)
    return tuple(t.to(device) for t in args) + (r, d ** -0.5), kvs


def sdpa(name: str) -> torch.Tensor:
    """The plain attention each segment's rows pay their own K/V rows, by SDPA -> [N, H, D] fp32."""
    args, kvs = build(name)
    q, starts, scaling = args[0].float(), args[4].tolist(), args[-1]
    out = torch.zeros(q.shape)
    for s, (k, v) in enumerate(kvs):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        length = k.shape[1]
        pos = torch.arange(length - (b - a), length)
        mask = torch.arange(length)[None, :] <= pos[:, None]           # [n, L]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                           scale=scaling, enable_gqa=True)[0]
        out[a:b] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_causal_attention_over_each_segments_rows(name):
    args, _ = build(name)
    out = pp.paged_prefill_reference(*args)
    assert out.dtype == args[0].dtype and not out.isnan().any()
    ref = pp.paged_prefill_reference(args[0].float(), *args[1:]) if args[0].dtype != torch.float32 else out
    assert rel_err(ref, sdpa(name)) < 1e-5


def test_reference_bounds_its_query_chunks(monkeypatch):
    """Its logits are [H, chunk, L]: chunked rows give the same rows."""
    args, _ = build("long_bf16")
    whole = pp.paged_prefill_reference(args[0].float(), *args[1:])
    monkeypatch.setattr(pp, "REF_CHUNK", 7)
    assert rel_err(pp.paged_prefill_reference(args[0].float(), *args[1:]), whole) < 1e-6


def test_reference_checks_the_values_it_reads():
    args, _ = build("nogqa_fp16")
    q, arena, table, kv_len, starts, r, scaling = args
    with pytest.raises(ValueError, match="q_start must rise from 0 to 50"):
        pp.paged_prefill_reference(q, arena, table, kv_len, starts.flip(0).contiguous(), r, scaling)
    with pytest.raises(ValueError, match="segment 0: 17 query rows but kv_len 16"):
        pp.paged_prefill_reference(q, arena, table, kv_len - 1, starts, r, scaling)


def test_launcher_names_bad_arguments():
    args, _ = build("smol_fp32")
    q, arena, table, kv_len, starts, r, scaling = args
    bad = {
        "q must be a contiguous": (q.transpose(0, 1), arena, table, kv_len, starts, r),
        "q must be a contiguous fp32/bf16/fp16": (q.double(), arena, table, kv_len, starts, r),
        "arena must be uint8": (q, arena.view(torch.float16), table, kv_len, starts, r),
        "table must be int32": (q, arena, table.long(), kv_len, starts, r),
        "H_kv dividing 9": (q, arena, table[:, :2].contiguous(), kv_len, starts, r),
        r"kv_len must be int32 \[4\]": (q, arena, table, kv_len[:3], starts, r),
        r"q_start must be int32 \[5\]": (q, arena, table, kv_len, starts.long(), r),
        "page_rows must be a positive int": (q, arena, table, kv_len, starts, 0),
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            pp.paged_prefill(*call, scaling)


def test_cpu_launcher_runs_a_kernel_that_matches_reference():
    """The launcher on the CPU: h39's C++ kernel where the extension exports it, else the reference."""
    for name in CASES:
        args, _ = build(name)
        want = pp.paged_prefill_reference(*args)
        got = pp.paged_prefill(*args)
        assert got.dtype == want.dtype and rel_err(got, want) <= TOL[args[0].dtype]
    if cpu_extension.module() is None or not hasattr(cpu_extension.module(), "paged_prefill"):
        pytest.skip("the CPU extension has no paged_prefill here (h39's C++ kernel): the launcher took the reference")


# ---- the Triton kernel, under the interpreter ----

def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    empty_like = torch.empty_like
    torch.empty_like = lambda *a, **k: empty_like(*a, **k).fill_(float("nan"))    # poisoned outputs
    results = {"kernel_type": type(pp._paged_prefill_kernel).__name__}
    for name, (*_, bm, bn) in CASES.items():
        args, _ = build(name)
        results[name] = pp.paged_prefill_triton(*args, block_m=bm, block_n=bn)
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_paged_prefill")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(interpreted, name):
    args, _ = build(name)
    out = interpreted[name]
    assert out.shape == args[0].shape and out.dtype == args[0].dtype and not out.isnan().any()
    assert rel_err(out, pp.paged_prefill_reference(args[0].float(), *args[1:])) <= TOL[args[0].dtype]


def test_triton_launcher_rejects_tiles_tl_dot_cannot_take():
    pytest.importorskip("triton")
    args, _ = build("d48_r8")
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        pp.paged_prefill_triton(*args, block_m=8)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        pp.paged_prefill_triton(*args, block_n=48)


# ---- compiled for an H100 (no GPU needed) ----

@pytest.mark.parametrize("q_type, lowp, d, r, bm, bn", [("*bf16", True, 64, 16, 64, 64), ("*fp32", False, 64, 16, 64, 64),
                                                        ("*fp16", True, 48, 8, 16, 16)])
def test_kernel_compiles_for_hopper(q_type, lowp, d, r, bm, bn):
    """The launcher's tiles at SmolLM2's shape and the tests' smallest: tensor-core products where
    the queries are 16-bit, none where they are fp32 (exact products)."""
    from tests.kernels.hopper import compile_for_hopper
    k = compile_for_hopper(pp._paged_prefill_kernel,
                           {"q_ptr": q_type, "arena_ptr": "*u8", "out_ptr": q_type, "table_ptr": "*i32",
                            "len_ptr": "*i32", "qs_ptr": "*i32", "S": "i32", "MB": "i32", "qk_scale": "fp32"},
                           dict(H=9, HKV=3, D=d, DP=64, R=r, SP=32, BLOCK_M=bm, BLOCK_N=bn, LOWP=lowp),
                           num_warps=4, num_stages=2)
    assert ("mma" in k.asm["ptx"]) == lowp


# ---- on CUDA ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here: the kernel runs under the interpreter only")


@cuda
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_matches_reference(name):
    args, _ = build(name, "cuda")
    out = pp.paged_prefill(*args)                                       # the dispatch: Triton on CUDA
    assert torch.equal(out, pp.paged_prefill_triton(*args)), "the dispatch took the Triton kernel"
    assert out.dtype == args[0].dtype and not out.isnan().any()
    assert rel_err(out, pp.paged_prefill_reference(args[0].float(), *args[1:])) <= TOL[args[0].dtype]
    *_, bm, bn = CASES[name]
    small = pp.paged_prefill_triton(*args, block_m=bm, block_n=bn)      # the interpreter's tiles, compiled
    assert rel_err(small, pp.paged_prefill_reference(args[0].float(), *args[1:])) <= TOL[args[0].dtype]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_at_smollm2_prompt_lengths(dtype):
    """SmolLM2's heads over prompts of 1,000 to 3,500 rows, one a chunk continuing a stored context."""
    h, hk, d, r = 9, 3, 64, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    segs = [(3500, 3500), (1000, 1000), (512, 2560), (1, 3000)]
    mb = max((length + r - 1) // r for _, length in segs)
    n_pages = len(segs) * hk * mb
    arena = torch.randn(n_pages * 2 * r * d, generator=g, device="cuda").half().view(torch.uint8)
    table = torch.randperm(n_pages, generator=g, device="cuda").view(len(segs), hk, mb).int()
    kv_len = torch.tensor([length for _, length in segs], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0] + [n for n, _ in segs], device="cuda").cumsum(0).int()
    q = torch.randn(int(starts[-1]), h, d, generator=g, device="cuda").to(dtype)
    out = pp.paged_prefill(q, arena, table, kv_len, starts, r, d ** -0.5)
    ref = pp.paged_prefill_reference(q.float(), arena, table, kv_len, starts, r, d ** -0.5)
    assert not out.isnan().any() and rel_err(out, ref) <= TOL[dtype]


if __name__ == "__main__":
    _child(sys.argv[1])
