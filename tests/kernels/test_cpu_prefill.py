"""The C++ paged prefill kernel (`kernels/cpu_prefill.cpp`, `paged_prefill` of the CPU extension)
against the torch reference (`kernels.paged_prefill.paged_prefill_reference`) on pools built by hand
to the contract (`tests.kernels.test_paged_prefill.build`: pages in a shuffled order, every byte no
stream owns NaN; the kernel allocates its output, so a row it forgot shows as a mismatch): odd shapes (a head dim that is no
multiple of 16, 8-row pages, no GQA), chunks continuing a stored context over several query tiles
and key blocks, one-row and empty segments, fp32/bf16/fp16 queries (bf16 on AMX tiles and on
VDPBF16PS vectors where the CPU has both), any thread count; and bad
arguments refused by the kernel itself."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from kernels import paged_prefill as pp
from tests.kernels import test_paged_prefill as tp
from tests.kernels.interp import rel_err

ext = cpu_extension.module()
pytestmark = pytest.mark.skipif(ext is None or not hasattr(ext, "paged_prefill"), reason="no C++ compiler here")

# as tests.kernels.test_paged_prefill.CASES: (H, H_kv, D, R, segments [(query rows, kv_len)], q dtype, -, -)
CASES = {
    "tiles_fp32": (9, 3, 64, 16, [(70, 200), (33, 33), (1, 1), (0, 9), (5, 90)], torch.float32, 0, 0),
    "tiles_bf16": (9, 3, 64, 16, [(70, 200), (33, 33), (1, 1), (0, 9), (5, 90)], torch.bfloat16, 0, 0),
    "d40_r8_fp16": (4, 2, 40, 8, [(19, 19), (40, 77)], torch.float16, 0, 0),
    "d24_nogqa": (3, 3, 24, 16, [(17, 50), (2, 3)], torch.float32, 0, 0),
    "d72_r4": (2, 1, 72, 4, [(37, 41)], torch.float32, 0, 0),
    "smol_chunk_bf16": (9, 3, 64, 16, [(128, 640), (1, 300), (1, 17)], torch.bfloat16, 0, 0),
}
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 2e-3}    # against the fp32 math


@pytest.fixture(params=list(CASES) + list(tp.CASES))
def case(request, monkeypatch):
    for name, spec in CASES.items():
        monkeypatch.setitem(tp.CASES, name, spec)
    args, _ = tp.build(request.param)
    return request.param, args


@pytest.fixture(params=["tiles", "vector"])
def path(request):
    """bf16 queries on AMX tiles (oneDNN brgemm) or on VDPBF16PS vectors: both where the CPU has AMX."""
    amx = ext.prefill_tiles(-1)
    if request.param == "tiles" and not amx:
        pytest.skip("no AMX on this CPU: bf16 prefill takes the vector path only")
    ext.prefill_tiles(-1 if request.param == "tiles" else 0)
    yield request.param
    ext.prefill_tiles(-1)


def test_kernel_matches_the_reference(case, path):
    name, args = case
    q = args[0]
    out = ext.paged_prefill(*args)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.isnan().any()
    ref = pp.paged_prefill_reference(q.float(), *args[1:])          # fp32 math of the same (rounded) queries
    assert rel_err(out, ref) <= TOL[q.dtype], name
    assert torch.equal(ext.paged_prefill(*args), out)                # deterministic


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kind", ["smol_fp32", "smol_bf16"])
def test_rows_do_not_depend_on_the_thread_count(threads, kind):
    args, _ = tp.build(kind)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.paged_prefill(*args)
        torch.set_num_threads(threads)
        assert torch.equal(ext.paged_prefill(*args), one)
    finally:
        torch.set_num_threads(before)


def test_a_segment_is_the_same_alone_or_packed(monkeypatch):
    """A segment's rows come out the same whatever else the call packs beside it."""
    monkeypatch.setitem(tp.CASES, "tiles_fp32", CASES["tiles_fp32"])
    q, arena, table, kv_len, starts, r, scaling = tp.build("tiles_fp32")[0]
    both = ext.paged_prefill(q, arena, table, kv_len, starts, r, scaling)
    a, b = int(starts[1]), int(starts[2])                            # segment 1 alone
    alone = ext.paged_prefill(q[a:b].contiguous(), arena, table[1:2], kv_len[1:2],
                              torch.tensor([0, b - a], dtype=torch.int32), r, scaling)
    assert torch.equal(alone, both[a:b])


def test_the_launcher_takes_the_kernel(monkeypatch):
    calls = []
    real = ext.paged_prefill

    class Spy:
        def __getattr__(self, attr):
            if attr == "paged_prefill":
                return lambda *a: calls.append(attr) or real(*a)
            return getattr(ext, attr)
    monkeypatch.setattr(cpu_extension, "module", lambda: Spy())
    args, _ = tp.build("smol_bf16")
    out = pp.paged_prefill(*args)
    assert calls == ["paged_prefill"] and rel_err(out, pp.paged_prefill_reference(args[0].float(), *args[1:])) <= 8e-3


def test_bad_arguments_are_refused_by_the_kernel():
    q, arena, table, kv_len, starts, r, scaling = tp.build("smol_fp32")[0]
    bad = {
        "q must be a contiguous": (q.transpose(0, 1), arena, table, kv_len, starts),
        "q_start must rise from 0 to N": (q, arena, table, kv_len, starts.flip(0).contiguous()),
        "segment 0: 40 query rows but kv_len 39": (q, arena, table, kv_len - 1, starts),
        "needs more pages than the table": (q, arena, table[:, :, :1].contiguous(), kv_len, starts),
        "outside the arena": (q, arena[: arena.numel() // 2], table, kv_len, starts),
    }
    for message, call in bad.items():
        with pytest.raises(RuntimeError, match=message):
            ext.paged_prefill(*call, r, scaling)
