"""Paged decode attention over the pool: the reference against plain attention over each stream's
rows (dequantized groups, then dense rows), the C++ kernel and the Triton kernel (interpreter
child process, `tests.kernels.interp`) against the reference, on streams of every form — dense
rows only, quantized groups at 1/2/4/8 bits with a dense tail, a tail-only quant stream, an empty
stream, a dense span starting past freed pages or inside a page — with 1 to 4 query heads a stream."""
from __future__ import annotations

import sys

import pytest
import torch

from executor.engine.block_tables import BlockTables
from executor.engine.kv_pool import KVPool
from kernels import cpu_extension
from kernels import paged_decode as pd
from kernels._triton import INTERPRETED
from kvcore.blocks import Layout
from tests.kernels.interp import interpreted_fixture, rel_err

# name: (head dim, query heads a stream, streams: (rows, bits, residual)), bits 0 = dense
CASES = {
    "D64_h3_mixed": (64, 3, [(70, 0, 0), (150, 4, 8), (300, 2, 0), (33, 8, 32), (0, 0, 0)]),
    "D32_h1_quant_only": (32, 1, [(64, 4, 0), (96, 2, 0)]),
    "D64_h4_long_dense": (64, 4, [(600, 0, 0), (17, 0, 0)]),
    "D16_h2_tail_only": (16, 2, [(40, 8, 32), (5, 4, 16)]),
    # every width's page-sized group (8 bits: 24 rows, so dense spans start inside a page; 1 bit: 192)
    "D64_h3_widths": (64, 3, [(30, 8, 0), (46, 8, 0), (500, 1, 4), (120, 8, 7), (97, 2, 0), (200, 4, 3)]),
}


def _inputs(name: str, decode_rows: int = 3):
    d, h, streams = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    pool = KVPool(Layout(d), 8 << 20)
    tables = BlockTables(pool, 1, 1, len(streams), 2048)
    slots = []
    for rows, bits, residual in streams:
        s = tables.open([True])
        k, v = torch.randn(1, rows, d, generator=g), torch.randn(1, rows, d, generator=g)
        (tables.store_quant(0, s, k, v, bits, residual) if bits else tables.store_dense(0, s, k, v))
        for _ in range(decode_rows if rows else 0):               # decode rows: tails grow and flush
            w = tables.extend([s], [1])
            tables.write(w, 0, torch.randn(1, 1, d, generator=g), torch.randn(1, 1, d, generator=g))
            tables.flush([s])
        slots.append(s)
    st = tables.decode_view(slots, torch.device("cpu"))
    q = torch.randn(len(streams), h, d, generator=g)
    return (q, pool.arena, st.dtable[0], st.dstart[0], st.dend[0], st.qtable[0], st.qn[0], st.qbits[0],
            pool.layout, d ** -0.5), tables, slots


@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_attention_over_each_streams_rows(name):
    args, tables, slots = _inputs(name)
    q, scaling = args[0], args[-1]
    out = pd.paged_decode_reference(*args)
    for i, s in enumerate(slots):
        k, v = tables.stream(0, s, 0)                                                    # [U, D] fp32
        if not k.shape[0]:
            assert bool((out[i] == 0).all()), "a stream without rows gives zeros"
            continue
        want = torch.softmax(q[i] @ k.T * scaling, -1) @ v
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_kernel_matches_reference(name):
    if cpu_extension.module() is None:
        pytest.skip("no C++ compiler here")
    args, _, _ = _inputs(name)
    out = pd.paged_decode(*args)
    assert rel_err(out, pd.paged_decode_reference(*args)) < 1e-5


def test_launcher_names_bad_arguments():
    args, _, _ = _inputs("D32_h1_quant_only")
    with pytest.raises(ValueError, match="dtable must be int32"):
        pd.paged_decode(args[0], args[1], args[2].long(), *args[3:])
    with pytest.raises(ValueError, match="qn must be int32"):
        pd.paged_decode(*args[:6], args[6][:1], *args[7:])
    with pytest.raises(ValueError, match="q must be"):
        pd.paged_decode(args[0][0], *args[1:])


# ---- the Triton kernel, under the interpreter ----

def _child(out_path: str) -> None:
    assert INTERPRETED, "child must run with TRITON_INTERPRET=1"
    results = {"kernel_type": type(pd._paged_decode_kernel).__name__}
    for name in CASES:
        args, _, _ = _inputs(name)
        results[name] = pd.paged_decode_triton(*args)
    torch.save(results, out_path)


interpreted = interpreted_fixture("tests.kernels.test_paged_decode")


def test_child_really_ran_the_interpreter(interpreted):
    assert interpreted["kernel_type"] == "InterpretedFunction"


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(interpreted, name):
    args, _, _ = _inputs(name)
    out = interpreted[name]
    ref = pd.paged_decode_reference(*args)
    assert out.shape == ref.shape and not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-5


if __name__ == "__main__":
    _child(sys.argv[1])
