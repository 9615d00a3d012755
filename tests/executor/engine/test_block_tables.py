"""The pool and its page tables on small worked examples: rows land where the tables say and read
back exactly; a quant stream keeps at most residual + g - 1 dense rows between steps and its
groups dequantize within half a step; the bytes the pages hold are the cost model's
(`kvcore.blocks`) at every step, and `pages_due` the pages a step takes; every page comes back
when a slot closes; any free page serves any form, in any order of frees; the pool refuses past
its arena, never silently."""
import numpy as np
import pytest
import torch

from executor.engine.block_tables import BlockTables
from executor.engine.kv_pool import KVPool, PoolExhausted
from kvcore.blocks import Layout

D = 64


def _tables(budget=4 << 20, layers=2, heads=2, slots=4, max_rows=2048):
    pool = KVPool(Layout(D), budget)
    return pool, BlockTables(pool, layers, heads, slots, max_rows)


def _rows(n, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, D, generator=g), torch.randn(n, heads, D, generator=g)      # [N, H, D]


def test_rows_written_through_the_tables_read_back_exactly_across_pages():
    pool, tables = _tables()
    a, b = tables.open(), tables.open()
    written = {a: [], b: []}
    for step, (na, nb) in enumerate([(5, 40), (1, 1), (30, 3), (1, 1)]):       # prefill chunks, then decode rows
        k, v = _rows(na + nb, seed=step)
        w = tables.extend([a, b], [na, nb])
        for layer in range(2):
            tables.write(w, layer, k, v)
        written[a].append((k[:na], v[:na]))
        written[b].append((k[na:], v[na:]))
    for slot in (a, b):
        ks, vs = (torch.cat([x[i] for x in written[slot]]) for i in (0, 1))                # [T, H, D]
        for layer in (0, 1):
            got_k, got_v = tables.dense(layer, slot)                                       # [H, T, D] fp16
            assert torch.equal(got_k, ks.transpose(0, 1).half()) and torch.equal(got_v, vs.transpose(0, 1).half())
    w = tables.extend([a, b], [2, 1], stored=[1, 0])          # SpeCache's steps: the guess and a pre-decoding row kept out
    k, v = _rows(3, seed=9)
    tables.write(w, 0, k, v)
    assert tables.dense(0, a)[0][:, -1].equal(k[0].half()) and int(tables.dend[0, b, 0]) == 45
    tables.close(a)
    tables.close(b)
    assert pool.bytes_in_use == 0


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_a_quant_stream_holds_the_cost_models_bytes_and_groups_within_half_a_step(bits):
    lay = Layout(D)
    g = lay.group_rows(bits)
    pool, tables = _tables(layers=1, heads=1)
    s = tables.open()
    k, v = _rows(37, heads=1)
    residual = 16
    tables.store_quant(0, s, k[:, 0][None], v[:, 0][None], lay.form_id(bits), residual)
    rows_k, rows_v, t = [k[:, 0]], [v[:, 0]], 37
    assert tables.layer_bytes(s)[0] == lay.quant_stream_held(t, bits, residual)
    for step, m in enumerate([1, 30, 27, 1, 2, 31, 33, 64, 7, 190, 3, 1]):
        before = pool.used_pages
        pool.peak_pages = before                           # this step's peak from here
        kn, vn = _rows(m, heads=1, seed=step + 1)
        due = tables.pages_due([s], [m])
        w = tables.extend([s], [m])
        tables.write(w, 0, kn, vn)
        tables.flush([s])
        t += m
        rows_k.append(kn[:, 0]), rows_v.append(vn[:, 0])
        assert tables.layer_bytes(s)[0] == pool.bytes_in_use == lay.quant_stream_held(t, bits, residual)
        assert pool.peak_bytes <= lay.quant_stream_bytes(t - m, m, bits, residual)        # groups before freeing
        assert pool.peak_pages - before <= due
        assert int(tables.dend[0, s, 0] - tables.dstart[0, s, 0]) < residual + g
    got_k, got_v, _ = tables.stream(0, s, 0)                                                # [t, D] fp32
    want_k, want_v = torch.cat(rows_k).half().float(), torch.cat(rows_v).half().float()
    n = int(tables.qn[0, s, 0]) * g
    assert n, "the steps flushed groups"
    gv = lay.value_group(bits)
    # per channel (K) / per row and value group (V): half a step of each group's range, plus fp16 rounding
    kg = want_k[:n].view(-1, g, D)
    k_step = (kg.amax(1) - kg.amin(1)) / (2 ** bits - 1)
    assert ((got_k[:n] - want_k[:n]).view(-1, g, D).abs() <= k_step[:, None] / 2 + 2e-2).all()
    vg = want_v[:n].view(n, D // gv, gv)
    v_step = (vg.amax(-1) - vg.amin(-1)) / (2 ** bits - 1)
    assert ((got_v[:n] - want_v[:n]).view(n, D // gv, gv).abs() <= v_step[..., None] / 2 + 2e-2).all()
    assert torch.equal(got_k[n:], want_k[n:]) and torch.equal(got_v[n:], want_v[n:])       # the dense tail exact
    tables.close(s)
    assert pool.bytes_in_use == 0


def test_any_free_page_serves_any_form_in_any_order_and_the_pool_never_hands_out_past_it():
    lay = Layout(D)
    pool = KVPool(lay, 40 * lay.page_bytes)
    assert pool.capacity == 40 * lay.page_bytes
    tables = BlockTables(pool, 1, 1, 8, 4096)
    rng = np.random.default_rng(0)
    slots = [tables.open() for _ in range(4)]
    for s in slots:                                        # 10 dense pages each: the whole arena
        k, v = torch.randn(1, 160, D), torch.randn(1, 160, D)
        tables.store_dense(0, s, k, v)
    assert pool.free_pages == 0
    with pytest.raises(PoolExhausted, match="0 free pages of 40, 1 asked"):
        pool.alloc(1)
    for s in rng.permutation(slots)[:2].tolist():          # free two streams' pages, scattered through the arena
        tables.close(s)
    a, b = tables.open(), tables.open()
    k, v = torch.randn(1, 30 * 96, D), torch.randn(1, 30 * 96, D)
    tables.store_quant(0, a, k[:, :10 * 96], v[:, :10 * 96], lay.form_id(2), 0)     # 10 pages of 2-bit groups
    tables.store_quant(0, b, k[:, :240], v[:, :240], lay.form_id(8), 0)             # 10 pages of 8-bit groups
    assert pool.free_pages == 0 and pool.bytes_in_use == 40 * lay.page_bytes
    for s in (a, b, *slots[:0]):
        tables.close(s)
    assert pool.free_pages == 20


def test_coded_rows_read_back_as_entries_times_magnitudes_turned_by_their_positions():
    """A coded stream: pre-RoPE keys come back turned by RoPE at their positions, exact rows as
    they are, absent rows (K entry -1) not at all; a merged pair's lower layer reads its partner's
    entries and holds no pages of them; a skip page hides quant rows."""
    from kernels.paged_decode import CodedRows, rotate
    lay = Layout(D)
    pool, tables = _tables(layers=2, heads=2)
    s = tables.open()
    g = torch.Generator().manual_seed(5)
    ek, ev = torch.randn(2, 6, D, generator=g).half(), torch.randn(2, 6, D, generator=g).half()
    ref = torch.tensor([[0, 1, 5, -1, 2], [3, 3, 4, 0, -1]], dtype=torch.int32)
    pos = torch.tensor([[7, -1, 100, 3, 0], [1, 2, -1, -1, 9]], dtype=torch.int32)
    mk, mv = torch.rand(2, 5, generator=g).half() + 0.5, torch.rand(2, 5, generator=g).half() + 0.5
    heads = torch.tensor([[1, 2, 3, 0, 0xFF], [0xFF] * 5], dtype=torch.uint8)
    coded = CodedRows(ref, ref.clamp_min(0), pos, mk, mv, heads, ek, ev)
    tables.store_coded(1, s, coded, torch.randn(2, 3, D), torch.randn(2, 3, D))
    pos_tab = torch.arange(200)[:, None] * 0.01 * torch.arange(D)[None]
    rope = (pos_tab.cos(), pos_tab.sin())
    for h in range(2):
        k, v, seen = tables.stream(1, s, h, rope)
        live = ref[h] >= 0
        kk = ek[h][ref[h][live].long()].float() * mk[h][live].float()[:, None]
        turned = pos[h][live] >= 0
        kk[turned] = rotate(kk[turned], pos[h][live][turned], rope)
        assert torch.allclose(k[:int(live.sum())], kk, atol=1e-3)
        assert torch.equal(seen[:int(live.sum())], heads[h][live]) and k.shape[0] == int(live.sum()) + 3
    pages = tables.layer_pages(s)[1]
    tables.store_coded(0, s, coded, entries=False)
    tables.share_entries(0, 1, s)
    assert tables.layer_pages(s)[0] == 2 * 1 and tables.layer_pages(s)[1] == pages       # one coded page a head, no entries
    assert torch.equal(tables.stream(0, s, 0, rope)[0], tables.stream(1, s, 0, rope)[0][:4])
    q = tables.open()
    tables.store_quant(0, q, torch.randn(2, 200, D), torch.randn(2, 200, D),
                       lay.form_id(2, 32, 32), 8)
    hide = torch.zeros(2, 128, dtype=torch.bool)
    hide[:, [0, 5, 127]] = True
    before = tables.stream(0, q, 0)[0]
    tables.set_skip(0, q, hide)
    after = tables.stream(0, q, 0)[0]
    assert after.shape[0] == before.shape[0] - 3 and torch.equal(after[:4], before[torch.tensor([1, 2, 3, 4])])
    tables.close(s)
    tables.close(q)
    assert pool.used_pages == 0
